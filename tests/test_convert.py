"""``python -m chitu_core.convert``: a 16-bit checkpoint quantized once into a quantized checkpoint.

Tiny random models (transformers' save_pretrained, float32) with every linear dimension a multiple of
128, so that FP8 blocks and 4-bit groups fit, are converted with each method installed, and with
``RowInt8`` (a method of this file) so the whole path runs before the real methods land. Checked
exactly: the output's tensor names, dtypes and shapes as the format's published layout gives them
(written out here, not taken from the code under test), untouched tensors bit for bit, each quantized
tensor equal to the method's own ``quantize`` of the original, config.json's quantization_config, the
copied files; then the engine loads the output into the same parameters as quantizing the original in
situ, and so gives the same logits and greedy tokens. Shards and their index, the refusals, an
interrupted run, and MoE models: Qwen2-MoE, whose routed experts fp8 quantizes per expert and projection
(an intermediate size of 128, one FP8 block of gate's rows and one of up's, as in situ; 32 is refused)
and the other methods keep in float32, and DeepSeek-V3 with latent attention.
"""

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import build_model, save_tokenizer
from chitu_cpu.backend import CpuBackend
from safetensors.torch import load_file, save_file

from chitu_core import LLM, SamplingParams
from chitu_core.convert import CHECKPOINT_FORMATS, Ignored, convert, main, parse_size
from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.quantization import QuantMethod, registry
from chitu_core.quantization.params import quant_param
from chitu_core.quantization.select import IN_SITU

for _module in ("awq", "fp8", "int8"):  # until chitu_core.quantization imports them itself
    if importlib.util.find_spec(f"chitu_core.quantization.{_module}"):
        importlib.import_module(f"chitu_core.quantization.{_module}")


class RowInt8(QuantMethod):
    """Test-only: int8 weights [N, K] and a float32 scale per ``rows`` output rows (``weight_scale``
    [N / rows]), W = weight * scale; it stands in for ``--quantization int8`` where named."""

    name = "test-row-int8"
    kernels = ("linear",)
    checkpoint_formats = ("test-row-int8",)
    defaults = {"rows": 1}

    @classmethod
    def options_from_checkpoint(cls, quantization_config):
        return {"rows": quantization_config["rows"]}

    def create_checkpoint_weights(self, layer, in_features, out_features, dtype, device):
        rows = self.options["rows"]
        quant_param(layer, "weight", (out_features, in_features), torch.int8, device, out_dim=0, in_dim=1)
        quant_param(layer, "weight_scale", (-(-out_features // rows),), torch.float32, device, out_dim=0,
                    out_pack=rows)

    def quantize(self, weight):
        rows = self.options["rows"]
        w = weight.float()
        scale = w.abs().amax(1).unflatten(0, (-1, rows)).amax(1) / 127
        q = torch.round(w / scale.repeat_interleave(rows)[:, None]).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}

    def apply(self, layer, x, bias, ops):
        w = layer.weight.float() * layer.weight_scale.repeat_interleave(self.options["rows"])[:, None]
        return ops.linear(x, w.to(x.dtype), bias)


def _row_int8_config(options, ignored: Ignored) -> dict:
    return {"quant_method": "test-row-int8", "rows": options["rows"], "ignore": ignored.modules + ignored.experts}


# What each format's checkpoint holds for a linear weight [N, K]: name -> (dtype, shape).
LAYOUTS = {
    "test-row-int8": lambda n, k: {"weight": (torch.int8, (n, k)), "weight_scale": (torch.float32, (n,))},
    "fp8": lambda n, k: {"weight": (torch.float8_e4m3fn, (n, k)),  # DeepSeek-V3 / transformers FineGrainedFP8
                         "weight_scale_inv": (torch.float32, (-(-n // 128), -(-k // 128)))},
    "awq": lambda n, k: {"qweight": (torch.int32, (k, n // 8)),  # AutoAWQ GEMM, group 128
                         "qzeros": (torch.int32, (k // 128, n // 8)), "scales": (torch.float16, (k // 128, n))},
    "int8": lambda n, k: {"weight": (torch.int8, (n, k)),  # compressed-tensors int-quantized, per channel
                          "weight_scale": (torch.float32, (n, 1))},
}


def _format_config(method: str, ignore: list[str]) -> dict:
    """config.json's quantization_config as each format's producer writes it."""
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
                "modules_to_not_convert": ignore}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": ignore}
    if method == "int8":
        return CHECKPOINT_FORMATS["int8"]({}, Ignored(ignore))  # checked against compressed-tensors itself below
    return {"quant_method": "test-row-int8", "rows": 1, "ignore": ignore}


# (--quantization, method): RowInt8 (standing in for int8 in its own case), then each real method installed.
REAL = [q for q, (m, _) in IN_SITU.items() if m in registry.all_quant_methods()]
CASES = [pytest.param(("int8", "test-row-int8"), id="test-row-int8")] + [
    pytest.param((q, IN_SITU[q][0]), id=IN_SITU[q][0]) for q in REAL]

LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
PROMPTS = [[1, 2, 3, 4, 5], [7] * 9, list(range(10, 40))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run_on_cpu(monkeypatch, method: str) -> None:
    runs = CpuBackend.quant_methods
    monkeypatch.setattr(CpuBackend, "quant_methods", lambda self: runs(self) | {method})


@pytest.fixture
def row_int8(monkeypatch) -> str:
    """RowInt8 registered, given a checkpoint format, run by the CPU backend and run by
    ``--quantization int8``, for this test only; returns "int8"."""
    monkeypatch.setitem(registry._METHODS, RowInt8.name, RowInt8)
    monkeypatch.setitem(registry._ORIGINS, RowInt8.name, __name__)
    monkeypatch.setitem(IN_SITU, "int8", (RowInt8.name, {"rows": 1}))
    monkeypatch.setitem(CHECKPOINT_FORMATS, RowInt8.name, _row_int8_config)
    _run_on_cpu(monkeypatch, RowInt8.name)
    return "int8"


@pytest.fixture(params=CASES)
def case(request, monkeypatch) -> tuple[str, str]:
    """(--quantization, method) of each method: RowInt8 and every real one installed."""
    quantization, method = request.param
    if method == RowInt8.name:
        request.getfixturevalue("row_int8")
    _run_on_cpu(monkeypatch, method)
    return quantization, method


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    build_model(path, "llama", hidden_size=256, intermediate_size=256)  # 4 heads of 64, 2 kv heads
    save_tokenizer(path)
    return path


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def load(path: Path, quantization: str | None = None) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", quantization=quantization, load_progress=False,
               num_threads=1, kv_cache_memory=8 << 20)


def state(llm: LLM) -> dict[str, torch.Tensor]:
    model = llm.engine.model
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}


def expected_layout(src: dict[str, torch.Tensor], quantized: set[str], method: str) -> dict:
    """The converted checkpoint's names, dtypes and shapes: each quantized ``X.weight`` [N, K] replaced
    by the format's tensors ``X.<key>``, every other tensor as it was."""
    out = {}
    for name, t in src.items():
        if name in quantized:
            out |= {name.removesuffix("weight") + key: v for key, v in LAYOUTS[method](*t.shape).items()}
        else:
            out[name] = (t.dtype, tuple(t.shape))
    return out


def assert_runs_as_in_situ(out: Path, src: Path, quantization: str) -> None:
    """The converted checkpoint loads into exactly the parameters in-situ quantization makes, and so
    gives the same logits and tokens."""
    from test_models import batched_last_logits

    converted, in_situ = load(out), load(src, quantization)
    got, want = state(converted), state(in_situ)
    assert got.keys() == want.keys()
    assert [n for n in got if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])] == []
    assert torch.equal(batched_last_logits(converted, PROMPTS), batched_last_logits(in_situ, PROMPTS))
    assert greedy(converted) == greedy(in_situ)


LLAMA_KEPT = ["lm_head", "model.embed_tokens", "model.layers.0.input_layernorm",
              "model.layers.0.post_attention_layernorm", "model.layers.1.input_layernorm",
              "model.layers.1.post_attention_layernorm", "model.norm"]


def test_llama_converts_to_the_format_and_runs_as_in_situ(case, llama, tmp_path):
    quantization, method_name = case
    out = tmp_path / "out"
    done = convert(llama, out, quantization, progress=False)
    assert (done.path, done.method, done.quantized, done.kept, done.shards) == (out, method_name, 14, 7, 1)

    src, got = tensors(llama), tensors(out)
    quantized = {n for n in src if LINEAR.search(n)}
    assert layout(got) == expected_layout(src, quantized, method_name)
    method = registry.get_quant_method(method_name)(IN_SITU[quantization][1])
    for name, t in src.items():
        if name in quantized:  # what the method makes of the original, bit for bit
            for key, value in method.quantize(t).items():
                stem = name.removesuffix("weight")
                assert torch.equal(got[stem + key].view(torch.uint8), value.view(torch.uint8)), stem + key
        else:
            assert torch.equal(got[name], t), name

    config, original = (json.loads((p / "config.json").read_text()) for p in (out, llama))
    qc = config.pop("quantization_config")
    assert config == original
    ignore_key = "ignore" if "ignore" in qc else "modules_to_not_convert"
    assert sorted(qc[ignore_key]) == LLAMA_KEPT
    assert qc == _format_config(method_name, qc[ignore_key])
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (llama / name).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in llama.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left behind
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # as os.makedirs would make it, not private

    assert_runs_as_in_situ(out, llama, quantization)


def test_shards_of_at_most_the_size_asked_with_an_index(row_int8, llama, tmp_path):
    quantization = row_int8
    out = tmp_path / "out"
    limit = 300_000  # the embedding and the LM head (512 x 256 float32, 524288 bytes) get a shard each
    done = convert(llama, out, quantization, max_shard_bytes=limit, progress=False)
    files = sorted(out.glob("*.safetensors"))
    n = len(files)
    assert n == done.shards and n > 2
    assert [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = {name: f.name for f in files for name in load_file(f)}
    assert index["weight_map"] == weight_map
    sizes = {f.name: [t.numel() * t.element_size() for t in load_file(f).values()] for f in files}
    assert index["metadata"]["total_size"] == sum(map(sum, sizes.values())) == done.total_bytes
    assert all(sum(s) <= limit or len(s) == 1 for s in sizes.values())
    assert_runs_as_in_situ(out, llama, quantization)


def test_an_existing_output_is_replaced_only_with_force(row_int8, llama, tmp_path):
    quantization = row_int8
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ChituError, match=rf"^{re.escape(str(out))} exists already; pass --force to replace it"):
        convert(llama, out, quantization, progress=False)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    convert(llama, out, quantization, force=True, progress=False)
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_interrupted_run_leaves_the_old_output_and_nothing_else(row_int8, llama, tmp_path, monkeypatch):
    quantization = row_int8
    out = tmp_path / "out"
    convert(llama, out, quantization, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def interrupted(self, weight):
        calls.append(1)
        if len(calls) % 3 == 0:  # the third linear weight of each run
            raise KeyboardInterrupt
        return {"weight": weight}

    monkeypatch.setattr(RowInt8, "quantize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(llama, out, quantization, force=True, progress=False)
    with pytest.raises(KeyboardInterrupt):
        convert(llama, tmp_path / "new", quantization, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_errors_say_what_is_wrong(case, llama, tmp_path):
    quantization, _ = case
    with pytest.raises(ChituError, match=r"model path '.*nowhere' is not a directory"):
        convert(tmp_path / "nowhere", tmp_path / "out", quantization)
    with pytest.raises(ChituError, match=r"^unknown --quantization 'int3'; choose one of fp8, int8, int4$"):
        convert(llama, tmp_path / "out", "int3")
    with pytest.raises(ChituError, match=r"is the model directory itself"):
        convert(llama, llama, quantization, force=True)
    quantized = tmp_path / "quantized"
    convert(llama, quantized, quantization, progress=False)
    with pytest.raises(ChituError, match=r"is quantized already \(its config.json's quantization_config is '.+'\); "
                                         r"convert reads 16-bit checkpoints only"):
        convert(quantized, tmp_path / "again", quantization)
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]  # a quantized checkpoint whose config lost its quantization_config
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ChituError, match=r"(: tensor '.+_proj.weight' is stored as (I8|F8_E4M3), not a 16- or 32-bit "
                                         r"float|the checkpoint has \d+ tensor\(s\) LlamaForCausalLM has no parameter "
                                         r"for, e.g. .+_proj.q\w+, .+): is this checkpoint quantized already"):
        convert(quantized, tmp_path / "again", quantization)
    with pytest.raises(ChituError, match=r"^no backend named 'nonsense' is installed"):
        convert(llama, tmp_path / "out", quantization, device="nonsense")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantized"]


def test_a_method_that_is_not_installed_or_has_no_format(row_int8, llama, tmp_path, monkeypatch):
    monkeypatch.setitem(IN_SITU, "int4", ("int4-from-a-plugin", {}))
    with pytest.raises(ChituError, match=r"^--quantization int4 quantizes with method 'int4-from-a-plugin', which "
                                         r"is not installed \(installed: .*test-row-int8.*\)$"):
        convert(llama, tmp_path / "out", "int4")
    monkeypatch.delitem(CHECKPOINT_FORMATS, RowInt8.name)
    with pytest.raises(ChituError, match=r"^quantization method 'test-row-int8' has no checkpoint format convert can "
                                         r"write; it writes awq, fp8, int8$"):
        convert(llama, tmp_path / "out", row_int8)
    assert list(tmp_path.iterdir()) == []


def test_tensors_the_model_skips_are_left_out(row_int8, llama, tmp_path):
    quantization = row_int8
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    stale = {**load_file(src / "model.safetensors"), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)}
    save_file(stale, src / "model.safetensors", metadata={"format": "pt"})
    done = convert(src, tmp_path / "out", quantization, progress=False)
    assert (done.quantized, done.kept, done.dropped) == (14, 7, 1)
    assert not any("inv_freq" in name for name in tensors(tmp_path / "out"))


def test_a_format_that_cannot_hold_the_fused_layers_is_refused_before_anything_is_written(row_int8, llama, tmp_path,
                                                                                         monkeypatch):
    # One scale per 256 output rows: q (256 rows) and k (128) fit, v starts at row 384, inside a block.
    monkeypatch.setitem(IN_SITU, row_int8, (RowInt8.name, {"rows": 256}))
    with pytest.raises(ChituError, match=r"^model.layers.0.self_attn.qkv_proj: its part 'v' starts at output 384, "
                                         r"inside one of the 256-output elements of the test-row-int8 tensor "
                                         r"'weight_scale'.*--quantization int8 with the 16-bit checkpoint\)$"):
        convert(llama, tmp_path / "out", row_int8)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif("fp8" not in registry.all_quant_methods(), reason="the fp8 method is not installed")
def test_fp8_blocks_cannot_hold_fused_layers_of_64_rows(tmp_path, monkeypatch):
    _run_on_cpu(monkeypatch, "fp8")
    build_model(tmp_path / "small", "llama")  # 4 query heads of 16: k starts at row 64, inside a 128-row block
    with pytest.raises(ChituError, match=r"^model.layers.0.self_attn.qkv_proj: its part 'k' starts at output 64, "
                                         r"inside one of the 128-output elements of the fp8 tensor 'weight_scale_inv'"):
        convert(tmp_path / "small", tmp_path / "out", "fp8")
    assert [p.name for p in tmp_path.iterdir()] == ["small"]
    load(tmp_path / "small", "fp8")  # in situ, the fused layer is quantized whole: it runs


def test_the_command_line(row_int8, llama, tmp_path, capsys):
    quantization, method_name = row_int8, RowInt8.name
    out = tmp_path / "out"
    assert main([str(llama), str(out), "--quantization", quantization, "--quiet", "--max-shard-size", "1MB"]) == 0
    assert re.fullmatch(rf"wrote {re.escape(str(out))}: 14 linear weights quantized \({method_name}\), 7 tensors "
                        r"kept, 0\.\d\d GiB in \d shard\(s\)\n", capsys.readouterr().out)
    assert main([str(llama), str(out), "--quantization", quantization, "--quiet"]) == 1
    assert capsys.readouterr().err == f"convert: {out} exists already; pass --force to replace it, or choose " \
                                      "another output directory\n"
    assert (parse_size("2GiB"), parse_size("500MB"), parse_size("1048576")) == (2 << 30, 500 * 10**6, 1 << 20)


def test_python_m_chitu_core_convert_refuses_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "chitu_core.convert", str(tmp_path / "nowhere"), str(tmp_path / "out"),
                          "--quantization", "int4"], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1
    assert re.fullmatch(r"convert: .*\n", run.stderr) and "nowhere" in run.stderr, run.stderr


def test_the_int8_config_is_compressed_tensors_w8a8():
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.utils.match import match_name

    qc = CHECKPOINT_FORMATS["int8"]({}, Ignored(["lm_head"], ["model.layers.0.mlp.experts"]))
    parsed = ct.QuantizationConfig.model_validate(qc)
    w8a8 = ct.preset_name_to_scheme("W8A8", ["Linear"])
    group = parsed.config_groups["group_0"]
    assert (group.targets, group.weights, group.input_activations) == (["Linear"], w8a8.weights,
                                                                       w8a8.input_activations)
    assert (parsed.format, parsed.quantization_status) == ("int-quantized", "compressed")
    ignored = lambda name: any(match_name(name, target) for target in parsed.ignore)
    assert ignored("lm_head") and ignored("model.layers.0.mlp.experts.3.gate_proj")
    assert not ignored("model.layers.0.mlp.shared_expert.gate_proj") and not ignored("model.layers.10.mlp.experts.0.up_proj")


# --- MoE: routed experts quantized where the method holds them, kept as they are otherwise ------------


def save_random(config, path: Path) -> Path:
    """A transformers model of ``config`` with random float32 weights (wide, so logits are far from ties)
    saved to ``path``."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def build_qwen2_moe(path: Path, moe_intermediate_size: int) -> Path:
    """A random Qwen2-MoE (layer 0 MoE with 4 experts and a shared expert, layer 1 dense)."""
    import transformers as tf

    return save_random(tf.Qwen2MoeConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=512, intermediate_size=256,
                                         moe_intermediate_size=moe_intermediate_size,
                                         shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                         mlp_only_layers=[1]), path)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> Path:
    return build_qwen2_moe(tmp_path_factory.mktemp("qwen2_moe"), 128)  # gate and up: one FP8 block of rows each


MOE_QUANTIZED = re.compile(r"\.self_attn\.[qkvo]_proj\.weight$|\.mlp\.shared_expert\.\w+_proj\.weight$|"
                           r"layers\.1\.mlp\.\w+_proj\.weight$")
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def test_moe_experts_routers_and_dense_parts(case, qwen2_moe, tmp_path):
    quantization, method_name = case
    holds_experts = registry.get_quant_method(method_name).holds_experts  # fp8: yes; RowInt8, int8, awq: no
    out = tmp_path / "out"
    done = convert(qwen2_moe, out, quantization, progress=False)
    src, got = tensors(qwen2_moe), tensors(out)
    quantized = {n for n in src if MOE_QUANTIZED.search(n) or holds_experts and ROUTED_EXPERT.search(n)}
    # attention of both layers, shared expert, dense MLP; with fp8, 4 experts' gate, up and down
    assert done.quantized == len(quantized) == 4 + 4 + 3 + 3 + (4 * 3 if holds_experts else 0)
    assert layout(got) == expected_layout(src, quantized, method_name)
    method = registry.get_quant_method(method_name)(IN_SITU[quantization][1])
    for name in filter(ROUTED_EXPERT.search, quantized):  # each expert's projection on its own
        stem = name.removesuffix("weight")
        assert all(torch.equal(got[stem + key].view(torch.uint8), value.view(torch.uint8))
                   for key, value in method.quantize(src[name]).items()), name
    # routers (mlp.gate, shared_expert_gate), norms, embeddings and (but with fp8) experts: as they were
    assert [n for n, t in src.items() if n not in quantized and not torch.equal(got[n], t)] == []
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    ignore = qc.get("ignore", qc.get("modules_to_not_convert"))
    experts = "re:model\\.layers\\.0\\.mlp\\.experts\\." if method_name == "int8" else "model.layers.0.mlp.experts"
    assert sorted(ignore) == sorted(
        ["lm_head", "model.embed_tokens", "model.norm", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"]
        + ([] if holds_experts else [experts])
        + [f"model.layers.{i}.{norm}" for i in (0, 1) for norm in ("input_layernorm", "post_attention_layernorm")])


def test_a_converted_moe_model_runs_as_in_situ(case, qwen2_moe, tmp_path):
    quantization, _ = case
    convert(qwen2_moe, tmp_path / "out", quantization, progress=False)
    assert_runs_as_in_situ(tmp_path / "out", qwen2_moe, quantization)


@pytest.mark.skipif("fp8" not in registry.all_quant_methods(), reason="the fp8 method is not installed")
def test_fp8_experts_whose_gate_and_up_share_a_block_are_refused(tmp_path, monkeypatch):
    _run_on_cpu(monkeypatch, "fp8")
    build_qwen2_moe(tmp_path / "small", 32)  # in situ, gate's 32 rows and up's share one 128-row block
    with pytest.raises(ChituError, match=r"^model\.layers\.0\.mlp\.experts: its routed experts cannot be stored as "
                                         r"fp8: fp8 MoE experts: 32 intermediate rows per rank .* not a multiple of "
                                         r"the checkpoint's 128x128 scale blocks.*in situ \(--quantization fp8\)$"):
        convert(tmp_path / "small", tmp_path / "out", "fp8")
    assert [p.name for p in tmp_path.iterdir()] == ["small"]
    load(tmp_path / "small", "fp8")  # in situ, each expert's [2I, H] matrix is quantized whole: it runs


DEEPSEEK_QUANTIZED = re.compile(r"\.self_attn\.(q_a|q_b|kv_a|kv_b|o)_proj(_with_mqa)?\.weight$|"
                                r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight$")


def test_deepseek_v3_latent_attention_and_shared_experts_quantized_routed_experts_kept(row_int8, tmp_path):
    from test_deepseek import build_deepseek

    build_deepseek(tmp_path / "src", "v3")  # layer 0 dense, layer 1 MoE (sigmoid router with a correction bias)
    done = convert(tmp_path / "src", tmp_path / "out", row_int8, progress=False)
    src, got = tensors(tmp_path / "src"), tensors(tmp_path / "out")
    quantized = {n for n in src if DEEPSEEK_QUANTIZED.search(n)}
    assert done.quantized == len(quantized) == 5 + 3 + 5 + 3
    assert layout(got) == expected_layout(src, quantized, RowInt8.name)
    assert [n for n, t in src.items() if n not in quantized and not torch.equal(got[n], t)] == []
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    norms = ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")
    assert sorted(ignore) == sorted(["lm_head", "model.embed_tokens", "model.norm", "model.layers.1.mlp.gate",
                                     "model.layers.1.mlp.experts"]
                                    + [f"model.layers.{i}.{norm}" for i in (0, 1) for norm in norms])
