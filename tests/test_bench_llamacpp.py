"""llama.cpp as the peer of `bench offline --peer llama.cpp`, and `bench agree`. Without llama-cpp-python
(simulated by ``sys.modules["llama_cpp"] = None``) the peer is unavailable with the install hint and
agree exits with it; a model that is not a GGUF file is refused whatever is installed. With it
(``importorskip``), both run on the embedded default GGUF at tiny lengths. The bench runs in this
process, on the CPU."""

import json
import sys
from pathlib import Path

import pytest
from builders import build_model

from chitu_core.bench import floor, peer_llamacpp
from chitu_core.bench.__main__ import main
from chitu_core.bench.agree import PROMPTS, compare
from chitu_core.bench.agree import render as render_agree
from chitu_core.bench.offline import render
from chitu_core.loader.gguf import default_model_file

HINT = ("llama-cpp-python is not installed: pip install 'chitu-core[bench-llamacpp]' "
        "(it builds llama.cpp from source, about 14 minutes)")


@pytest.fixture(autouse=True)
def small_copy(monkeypatch):
    """The floor's bandwidth copy at 16 MiB instead of 1 GiB: the floor is not what these tests check."""
    monkeypatch.setattr(floor, "COPY_BYTES", 16 << 20)


@pytest.fixture
def no_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    build_model(path, "llama")
    return path


def offline(capsys, *args: str) -> dict:
    assert main(["offline", "--device", "cpu", "--warmup", "0", "--no-profile", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_peer_without_llama_cpp_reports_the_install_hint(no_llama_cpp, capsys):
    assert peer_llamacpp.missing() == HINT
    r = offline(capsys, "--batch-size", "1", "--input-len", "8", "--output-len", "2", "--dtype", "bfloat16", "--peer", "llama.cpp")
    assert r["model"] == str(default_model_file())  # no --model: the embedded default's GGUF
    assert (r["peer"], r["peer_unavailable"], r["peer_name"]) == (None, HINT, "llama.cpp")
    assert "speedup_over_peer" not in r
    assert render(r).splitlines()[-1] == f"peer     llama.cpp not run: {HINT}"


def test_agree_without_llama_cpp_exits_with_the_install_hint(no_llama_cpp, capsys):
    assert main(["agree"]) == 1
    assert capsys.readouterr().err == HINT + "\n"


def test_peer_on_an_hf_directory_needs_a_gguf(hf_dir, capsys):
    r = offline(capsys, "--model", str(hf_dir), "--batch-size", "2", "--input-len", "4", "--output-len", "3",
                "--peer", "llama.cpp")
    reason = (f"llama.cpp runs GGUF files, and {hf_dir} is not one: pass --model FILE.gguf (or no --model: the "
              "embedded default)")
    assert (r["peer"], r["peer_unavailable"]) == (None, reason)
    assert render(r).splitlines()[-1] == f"peer     llama.cpp not run: {reason}"
    assert main(["agree", "--model", str(hf_dir)]) == 1
    assert capsys.readouterr().err == reason + "\n"


def test_render_names_the_llama_cpp_peer(hf_dir, capsys):
    r = offline(capsys, "--model", str(hf_dir), "--batch-size", "2", "--input-len", "4", "--output-len", "3")
    assert "peer" not in r and not render(r).splitlines()[-1].startswith("peer")
    peer = {"name": "llama.cpp", "mode": "llama.cpp batch 1, 2 threads", "weights": "the GGUF file's own blocks (llama ?B Q4_1)",
            "output_tok_per_s": 150.0, "decode_tok_per_s": 160.0, "batch_size": 1}
    r.update(peer=peer, peer_name="llama.cpp", speedup_over_peer=1.25, per_sequence_speedup_over_peer=0.625)
    assert render(r).splitlines()[-1] == (
        "peer     llama.cpp (llama.cpp batch 1, 2 threads): 150.0 tok/s in all, decode 160.0 tok/s; chitu/llama.cpp "
        "decode 1.25x (chitu's batch of 2 in all against llama.cpp's one sequence; per sequence 0.62x); llama.cpp on "
        "the GGUF file's own blocks (llama ?B Q4_1)")
    r["peer"] = {"name": "llama.cpp", "mode": "failed", "error": "ValueError: no", "output_tok_per_s": None,
                 "decode_tok_per_s": None}
    assert render(r).splitlines()[-1] == "peer     llama.cpp failed: ValueError: no"


def test_compare_finds_the_first_difference_and_the_gaps_there():
    ours, lp = [5, 6, 7], [{5: -0.1, 9: -3.0}, {6: -0.5, 8: -0.52}, {7: -0.2, 1: -2.0}]
    assert compare(ours, lp, [5, 6, 7], [2.0, 0.1, 1.0]) == {"identical": True, "first_diff": None}
    assert compare(ours, lp, [5, 8, 1], [2.0, 0.01, 1.0]) == {
        "identical": False, "first_diff": 1, "ours_token": 6, "llamacpp_token": 8, "ours_gap": 0.02, "llamacpp_gap": 0.01}


def test_the_agreement_table_shows_the_control_beside_ours():
    rows = [{"prompt": "a", "prompt_tokens": 3, "identical": True, "first_diff": None, "control_first_diff": 2},
            {"prompt": "b", "prompt_tokens": 4, "identical": False, "first_diff": 1, "ours_text": "x", "ours_gap": 0.02,
             "llamacpp_text": "y", "llamacpp_gap": 0.01, "control_first_diff": None}]
    text = render_agree({"model": "m", "backend": "cpu", "dtype": "float32", "quantization": "gguf", "threads": 1,
                         "llama_cpp_version": "v", "llamacpp_weights": "w", "tokens": 4, "rows": rows, "identical": 1,
                         "control_identical": 1})
    lines = text.splitlines()
    assert lines[-5].split()[-1] == "control"
    assert lines[-4].split() == ["1", "a", "3", "identical", "differ", "at", "2"]
    assert lines[-3].split() == ["2", "b", "4", "differ", "at", "1", "'x'", "(0.020)", "'y'", "(0.010)", "identical"]
    assert lines[-1] == "1 of 2 identical; control: llama.cpp against itself, 1 of 2"


def test_the_control_peer_keeps_its_kv_cache_in_float32():
    llama_cpp = pytest.importorskip("llama_cpp")
    default, control = (peer_llamacpp.load(default_model_file(), 64, 1, float32_kv=f) for f in (False, True))
    try:
        assert (default.context_params.type_k, default.context_params.type_v) == (llama_cpp.GGML_TYPE_F16,) * 2
        assert (control.context_params.type_k, control.context_params.type_v) == (llama_cpp.GGML_TYPE_F32,) * 2
    finally:
        default.close()
        control.close()


def test_llama_cpp_peer_runs_on_the_default_gguf(capsys):
    llama_cpp = pytest.importorskip("llama_cpp")
    # One thread each: on a shared machine, two spinning OpenMP pools (torch's, llama.cpp's) can stall each other.
    r = offline(capsys, "--batch-size", "2", "--input-len", "16", "--output-len", "4", "--threads", "1",
                "--dtype", "bfloat16", "--peer", "llama.cpp", "--peer-runs", "2")
    p = r["peer"]
    assert (p["name"], p["mode"], p["threads"], p["batch_size"]) == ("llama.cpp", "llama.cpp batch 1, 1 thread", 1, 1)
    assert p["llama_cpp_version"] == llama_cpp.__version__ and "Q4_1" in p["weights"]
    assert p["decode_tok_per_s"] > 0 and len(p["runs_decode_tok_per_s"]) == 2
    assert p["output_tok_per_s"] == pytest.approx(4 / p["total_s"], rel=1e-3)
    assert p["prefill_tok_per_s"] == pytest.approx(16 / p["prefill_s"], rel=1e-3)
    assert r["speedup_over_peer"] == pytest.approx(r["decode_tok_per_s"] / p["decode_tok_per_s"], abs=1e-3)
    assert r["per_sequence_speedup_over_peer"] == pytest.approx(r["decode_tok_per_s"] / 2 / p["decode_tok_per_s"], abs=1e-3)
    assert render(r).splitlines()[-1].startswith("peer     llama.cpp (llama.cpp batch 1, 1 thread): ")


def test_agree_on_the_default_gguf(capsys):
    pytest.importorskip("llama_cpp")
    assert main(["agree", "--threads", "1", "--tokens", "4", "--dtype", "bfloat16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [row["prompt"] for row in r["rows"]] == PROMPTS and r["tokens"] == 4 and r["threads"] == 1
    assert r["identical"] == sum(row["identical"] for row in r["rows"])
    assert r["control_identical"] == sum(row["control_first_diff"] is None for row in r["rows"])
    for row in r["rows"]:
        assert row["identical"] or (0 <= row["first_diff"] < 4 and row["ours_gap"] >= 0 and row["llamacpp_gap"] >= 0)
        assert row["control_first_diff"] is None or 0 <= row["control_first_diff"] < 4
