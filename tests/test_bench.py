"""`python -m chitu_core.bench`: random-model writes a loadable model of a named config; offline
reports consistent numbers. Both run as subprocesses, as a user runs them."""

import json
import subprocess
import sys

import pytest
import torch

from chitu_core import LLM, SamplingParams
from chitu_core.bench.__main__ import main
from chitu_core.bench.configs import CONFIGS
from chitu_core.bench.random_model import hf_config


def bench(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "chitu_core.bench", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-tiny")
    out = bench("random-model", "--like", "tiny", "--out", str(path), "--dtype", "float32")
    assert out.startswith(f"wrote {path}: random tiny")
    return path


def test_random_model_loads_and_matches_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM

    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {k: config[k] for k in CONFIGS["tiny"]} == CONFIGS["tiny"]
    llm = LLM(tiny_dir, device="cpu", dtype="float32", load_progress=False)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.outputs[0].token_ids == ref[0, 3:].tolist()


@pytest.mark.parametrize("name, num_parameters", [("smollm2-135m", 134_515_008), ("llama-3.1-8b", 8_030_261_248)])
def test_named_configs_have_the_real_models_sizes(name, num_parameters):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(name))
    assert model.num_parameters() == num_parameters


def test_offline_json_is_consistent(tiny_dir):
    B, I, O = 3, 8, 5
    r = json.loads(bench("offline", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--batch-size", str(B),
                         "--input-len", str(I), "--output-len", str(O), "--warmup", "1", "--json"))
    assert (r["backend"], r["device"], r["dtype"], r["architecture"]) == ("cpu", "cpu:0", "float32", "LlamaForCausalLM")
    assert r["emulated"] is False
    c = r["model_config"]
    assert (c["num_hidden_layers"], c["hidden_size"], c["vocab_size"]) == (2, 64, 512)
    assert c["num_parameters"] > 0
    assert (r["batch_size"], r["input_len"], r["output_len"], r["warmup"]) == (B, I, O, 1)
    assert (r["input_tokens"], r["output_tokens"]) == (B * I, B * O)
    # The whole batch prefills in one step, then one decode step per further token.
    assert (r["num_steps"], r["prefill_steps"], r["decode_steps"]) == (O, 1, O - 1)
    assert r["total_s"] == pytest.approx(r["prefill_s"] + r["decode_s"], abs=2e-6)
    assert r["output_tok_per_s"] == pytest.approx(B * O / r["total_s"], rel=1e-3)
    assert r["prefill_tok_per_s"] == pytest.approx(B * I / r["prefill_s"], rel=1e-3)
    assert r["decode_tok_per_s"] == pytest.approx(B * (O - 1) / r["decode_s"], rel=1e-3)
    assert 0 < r["decode_step_median_ms"] and 0 < r["decode_forward_mean_ms"] <= r["decode_step_mean_ms"]
    assert r["decode_step_mean_ms"] * (O - 1) <= r["decode_s"] * 1e3 + 1e-2  # the steps and the loop between them
    assert 0 <= r["outside_forward_share"] <= 1 and 0 <= r["decode_outside_forward_share"] <= 1


def test_offline_text_report(tiny_dir):
    out = bench("offline", "--model", str(tiny_dir), "--device", "cpu", "--batch-size", "2", "--input-len", "4",
                "--output-len", "3", "--warmup", "0")
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["model", "backend", "batch", "total", "prefill", "decode", "outside",
                                                   "floor"]
    assert "LlamaForCausalLM, 2 layers" in lines[0] and "6 output tokens" in lines[3]


def test_offline_floor_runs_and_transformers_peer(tiny_dir):
    """--runs reports the run of median decode rate; the floor is the mean decode step's bytes (weights
    plus KV) over the copy bandwidth measured in the run; --peer hf runs transformers on the same prompts."""
    B, I, O = 2, 6, 5
    r = json.loads(bench("offline", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--batch-size", str(B),
                         "--input-len", str(I), "--output-len", str(O), "--runs", "3", "--no-profile", "--peer", "hf",
                         "--json"))
    assert r["runs"] == 3 and sorted(r["runs_decode_tok_per_s"])[1] == r["decode_tok_per_s"]
    assert r["decode_forward_mean_ms"] is None and r["outside_forward_share"] is None  # --no-profile
    f, c = r["floor"], CONFIGS["tiny"]
    # Untied: every parameter but the input embedding, float32.
    weights = 4 * (r["model_config"]["num_parameters"] - c["vocab_size"] * c["hidden_size"])
    assert f["weight_bytes"] == weights
    kv_per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"]) * 4
    assert f["kv_bytes_mean"] == round(kv_per_token * B * (I + (1 + O - 1) / 2))
    assert f["step_ms"] == pytest.approx((weights + f["kv_bytes_mean"]) / (f["copy_gbps"] * 1e9) * 1e3, rel=1e-2)
    assert f["decode_tok_per_s"] == pytest.approx(B / (f["step_ms"] / 1e3), rel=1e-2)  # step_ms is rounded
    assert r["floor_fraction"] == pytest.approx(r["decode_tok_per_s"] / f["decode_tok_per_s"], abs=1e-4)  # rounded
    p = r["peer"]
    assert p["mode"] == "eager generate, dynamic cache" and p["decode_tok_per_s"] > 0
    assert p["prefill_s"] < p["total_s"]
    assert r["speedup_over_peer"] == pytest.approx(r["decode_tok_per_s"] / p["decode_tok_per_s"], abs=1e-3)


def test_peer_mode_eager_keeps_transformers_default_at_batch_one(tiny_dir):
    """At batch 1 the peer's fastest mode is a static cache (compiled where transformers compiles it);
    --peer-mode eager runs transformers as it runs by default, as the issues' first figures did."""
    modes = {}
    for mode in ("fastest", "eager"):
        r = json.loads(bench("offline", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--batch-size",
                             "1", "--input-len", "4", "--output-len", "4", "--no-profile", "--peer", "hf", "--peer-mode",
                             mode, "--json"))
        modes[mode] = r["peer"]["mode"]
    assert modes["fastest"].startswith("static cache") and modes["eager"] == "eager generate, dynamic cache"


def test_unknown_config_is_an_argument_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["random-model", "--like", "gpt-5", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "invalid choice: 'gpt-5'" in capsys.readouterr().err


def test_committed_benchmark_pages_are_what_report_makes(monkeypatch):
    """Every docs/benchmarks/<name>.md is the output of `bench report` on the directory beside it (the report's
    renderer called in this process, from the repository root as the pages' commands run; the command line
    itself is checked by test_report_of_an_offline_run)."""
    from pathlib import Path

    from chitu_core.bench.report import render

    root = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    pages = sorted(root.glob("*.md"))
    assert pages
    monkeypatch.chdir(root.parents[1])
    for page in pages:
        directory = page.with_suffix("").relative_to(root.parents[1])
        assert render(directory) == page.read_text(), \
            f"{page} differs from `bench report {directory.as_posix()}`: regenerate it"


@pytest.fixture(scope="module")
def tiny_b2_json(tiny_dir):
    """`bench offline --json` of the tiny model at batch 2, shared by the report's tests."""
    return bench("offline", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--batch-size", "2",
                 "--input-len", "4", "--output-len", "3", "--warmup", "0", "--json")


def test_report_of_an_offline_run(tiny_b2_json, tmp_path):
    out = tiny_b2_json
    (tmp_path / "tiny-b2.json").write_text(out)
    r = json.loads(out)
    page = bench("report", str(tmp_path)).splitlines()
    assert page[0] == f"# Benchmarks: {tmp_path.name}"
    row = next(line for line in page if line.startswith("| tiny-b2 |")).split(" | ")
    assert row[2:4] == ["2", "4/3"]
    assert row[4].startswith(f"{r['decode_tok_per_s']:.1f} (") and row[7] == f"{100 * r['floor_fraction']:.1f}%"
    assert row[8:] == ["-", "- |"]  # no peer


def test_report_pairs_an_emulated_run_with_the_devices_own_backend_of_the_same_shape(tiny_b2_json, tmp_path):
    out = json.loads(tiny_b2_json)
    emulated = dict(out, backend="acme", emulated=True, decode_tok_per_s=out["decode_tok_per_s"] / 2)
    other_batch = dict(emulated, batch_size=4)  # no run of the device's own backend at batch 4: no row
    for name, r in (("own-b2", out), ("acme-b2", emulated), ("acme-b4", other_batch)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    page = bench("report", str(tmp_path))
    assert "## Backends in emulation against the device's own" in page
    rows = [line.split(" | ") for line in page.splitlines() if line.startswith("| acme-")]
    table = [r for r in rows if r[1] == "acme"]  # the emulation table's rows (the offline table names the model there)
    assert [(r[0], r[5], r[-1]) for r in table] == [("| acme-b2", "own-b2 (cpu)", "0.500 |")]


def test_moe_floor_counts_the_routed_experts(tmp_path):
    path = tmp_path / "tiny-mixtral"
    bench("random-model", "--like", "tiny-mixtral", "--out", str(path), "--dtype", "float32")
    r = json.loads(bench("offline", "--model", str(path), "--device", "cpu", "--dtype", "float32", "--batch-size", "1",
                         "--input-len", "6", "--output-len", "4", "--warmup", "0", "--no-profile", "--json"))
    f = r["floor"]
    per_expert = (2 * 128 * 64 + 64 * 128) * 4  # w13 [2I, H] and w2 [H, I] of one expert, float32
    assert f["expert_bytes_all"] == 2 * 8 * per_expert  # 2 layers of 8 experts
    # Batch 1: each decode step's token goes to its top-2, two distinct experts in each of the 2 layers.
    assert f["expert_bytes_routed_mean"] == 2 * 2 * per_expert
    assert f["weight_bytes"] == r["model_config"]["num_parameters"] * 4 - 512 * 64 * 4 - 6 * 2 * per_expert


def test_report_of_a_prefill_graphs_check(tmp_path):
    """``prefill_graphs_check.py``'s JSON renders as its section: the token rows and the step times with their ratio."""
    check = {"device": "Acme X1", "torch": "2.13.0", "tokens": [
        {"arch": "llama", "chunks": None, "graphs_on": True, "equal": 8, "of": 8, "max_logprob_diff": 4.77e-07},
        {"arch": "qwen3", "chunks": 48, "graphs_on": True, "equal": 7, "of": 8, "max_logprob_diff": 0.5}],
        "steps": [{"requests": 1, "tokens": 128, "eager_ms": 20.68, "graph_ms": 7.81}]}
    (tmp_path / "prefill_graphs_check.json").write_text(json.dumps(check))
    page = bench("report", str(tmp_path)).splitlines()
    start = page.index("## Prefill steps in graphs (`plugins/nvidia/scripts/prefill_graphs_check.py`)")
    assert "| llama | whole | True | 8 / 8 | 4.77e-07 |" in page[start:]
    assert "| qwen3 | 48 | True | 7 / 8 | 5.00e-01 |" in page[start:]
    assert "| 1 | 128 | 20.68 | 7.81 | 2.65x |" in page[start:]


def test_report_of_a_quant_check(tmp_path):
    """``quant_check.py``'s JSON renders as its section: a row per method with its bound's verdict, and the FP8
    KV cache's blocks and near-tie verdict."""
    check = {"bf16": {"blocks": 512, "weight_gb": 16.06},
             "fp8": {"nmse": 0.0141, "bound": 0.0416, "ok": True, "agree": [0, 32], "quant": "fp8 (in situ)",
                     "weight_gb": 9.08, "fallback": []},
             "int4": {"nmse": 0.2, "bound": 0.1408, "ok": False, "agree": [3, 0], "quant": "awq (in situ)",
                      "weight_gb": 5.81, "fallback": []},
             "kv_fp8": {"blocks": 1024, "ratio": 2.0, "agree": [29, 32], "near_tie_ok": True, "nmse_first": 0.00218}}
    (tmp_path / "quant_check.json").write_text(json.dumps(check))
    page = bench("report", str(tmp_path)).splitlines()
    start = page.index("## Quantized in situ against the bf16 model (`plugins/nvidia/scripts/quant_check.py`)")
    assert page[start + 4:start + 8] == [
        "| bf16 | unquantized | 16.06 | - | - | 512 |",
        "| fp8 | fp8 (in situ) | 9.08 | 1.41e-02 (0.0416: ok) | [0, 32] | - |",
        "| int4 | awq (in situ) | 5.81 | 2.00e-01 (0.1408: FAILED) | [3, 0] | - |",
        "| fp8 KV cache | bf16 weights | - | 2.18e-03 | [29, 32] (divergences on near-ties) | 1024 (2.00x) |"]


def test_report_names_each_attention_sweep(tmp_path):
    """``attention_sweep.json`` renders under the plain heading, ``attention_sweep-NAME.json`` files each under
    one naming its file; in the order of the file names."""
    row = {"shape": "8b-b1", "key_tile_kb": 16, "warps": 4, "stages": None, "splits": 4, "us": 6.34, "floor_us": 0.25,
           "of_floor": 0.039, "agrees": True}
    for name, us in (("attention_sweep", 7.0), ("attention_sweep-a", 6.34), ("attention_sweep-b", 6.63)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"device": "Acme X1", "copy_gbps": 4000.0,
                                                           "rows": [{**row, "us": us}]}))
    page = bench("report", str(tmp_path)).splitlines()
    heads = [i for i, line in enumerate(page) if line.startswith("## Decode attention by tile configuration")]
    assert [page[i] for i in heads] == [
        "## Decode attention by tile configuration (`plugins/nvidia/scripts/attention_sweep.py`, `attention_sweep-a.json`)",
        "## Decode attention by tile configuration (`plugins/nvidia/scripts/attention_sweep.py`, `attention_sweep-b.json`)",
        "## Decode attention by tile configuration (`plugins/nvidia/scripts/attention_sweep.py`)"]
    assert [page[i + 6] for i in heads] == [f"| 8b-b1 | 16 | 4 | default | 4 | {us} | 0.25 | 4% | yes |"
                                            for us in ("6.34", "6.63", "7.00")]


def test_report_includes_each_kernel_sweep(tmp_path):
    """``*_sweep*.txt`` (a sweep script's output): its device line and markdown table under a heading naming the
    script and the file, the progress lines left out; a sweep without a table, its text in a code block."""
    (tmp_path / "dense_gemv_sweep-rows.txt").write_text(
        "device NVIDIA H200, 132 units\n[('qkv', 'cuBLAS')]\n| shape | kernel |\n|---|---|\n| qkv | cuBLAS |\n")
    (tmp_path / "quant_sweep-int4.txt").write_text("device NVIDIA H200\nint4 qkv M=16: default 18.4 us\n")
    page = bench("report", str(tmp_path)).splitlines()
    at = page.index("## Kernel sweep (`plugins/nvidia/scripts/dense_gemv_sweep.py`, `dense_gemv_sweep-rows.txt`)")
    assert page[at + 1:at + 7] == ["", "device NVIDIA H200, 132 units", "", "| shape | kernel |", "|---|---|",
                                   "| qkv | cuBLAS |"]
    at = page.index("## Kernel sweep (`plugins/nvidia/scripts/quant_sweep.py`, `quant_sweep-int4.txt`)")
    assert page[at + 1:at + 6] == ["", "```", "device NVIDIA H200", "int4 qkv M=16: default 18.4 us", "```"]


def test_report_includes_each_check_table(tmp_path):
    """``*_check*.txt`` (a check script's output): its device line, wherever it is, and its table."""
    (tmp_path / "fusions_check.txt").write_text("{'prompt': 0}\ndevice: NVIDIA H200; int4\n| prompt |\n|---|\n| 0 |\n")
    page = bench("report", str(tmp_path)).splitlines()
    at = page.index("## Check (`plugins/nvidia/scripts/fusions_check.py`, `fusions_check.txt`)")
    assert page[at + 1:at + 7] == ["", "device: NVIDIA H200; int4", "", "| prompt |", "|---|", "| 0 |"]


def test_report_includes_each_profiled_step_verbatim(tmp_path):
    """``profile_step*.txt`` files (profile_step.py --out) each under a heading naming the file, as written."""
    texts = {"profile_step-b.txt": "/m batch 4: wall 2.763 ms/step\n   1085.3     28    38.76  _attention_kernel\n",
             "profile_step-a.txt": "/m batch 4: wall 2.807 ms/step\n"}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    page = bench("report", str(tmp_path)).splitlines()
    heads = [i for i, line in enumerate(page) if line.startswith("## A profiled decode step")]
    assert [page[i] for i in heads] == [
        "## A profiled decode step (`plugins/nvidia/scripts/profile_step.py`, `profile_step-a.txt`)",
        "## A profiled decode step (`plugins/nvidia/scripts/profile_step.py`, `profile_step-b.txt`)"]
    assert page[heads[1] + 2:heads[1] + 6] == ["```", "/m batch 4: wall 2.763 ms/step",
                                               "   1085.3     28    38.76  _attention_kernel", "```"]
