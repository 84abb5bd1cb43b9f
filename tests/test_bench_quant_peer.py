"""`bench offline --peer hf` on quantized runs: transformers loads a converted checkpoint where it can
read the format on the device, and the peer's mode says what it computes; where it cannot, ours still
runs and the report says why (``peer: null``, ``peer_unavailable``). In situ, the peer is labelled for
what it is. A tiny random Llama (every linear dimension a multiple of 128, so that FP8 blocks and AWQ
groups fit) converted with ``chitu_core.convert``, the bench run in this process on the CPU."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from builders import build_model

from chitu_core.bench import floor
from chitu_core.bench.__main__ import main
from chitu_core.bench.offline import render
from chitu_core.bench.peer import Peer, choose_peer
from chitu_core.convert import convert

EAGER = "eager generate, dynamic cache"  # the peer's generation mode at batch 2


@pytest.fixture(autouse=True)
def small_copy(monkeypatch):
    """The floor's bandwidth copy at 16 MiB instead of 1 GiB: seconds less a run, and the floor is not
    what these tests check."""
    monkeypatch.setattr(floor, "COPY_BYTES", 16 << 20)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    build_model(path, "llama", hidden_size=256, intermediate_size=256)  # float32
    return path


@pytest.fixture(scope="module")
def converted(llama, tmp_path_factory) -> dict[str, Path]:
    """--quantization -> the checkpoint convert wrote: int8 compressed-tensors W8A8, fp8 fine-grained
    FP8, int4 AutoAWQ GEMM."""
    root = tmp_path_factory.mktemp("converted")
    for quantization in ("int8", "fp8", "int4"):
        convert(llama, root / quantization, quantization, progress=False)
    return {q: root / q for q in ("int8", "fp8", "int4")}


def offline(capsys, model: Path, *args: str) -> dict:
    assert main(["offline", "--model", str(model), "--device", "cpu", "--batch-size", "2", "--input-len", "4",
                 "--output-len", "6", "--warmup", "0", "--no-profile", "--peer", "hf", "--peer-runs", "3", "--json",
                 *args]) == 0
    return json.loads(capsys.readouterr().out)


def missing(*packages: str) -> list[str]:
    return [p for p in packages if importlib.util.find_spec(p) is None]


def test_int8_checkpoint_peer_runs_it_through_compressed_tensors(converted, capsys):
    r = offline(capsys, converted["int8"])
    assert r["quantization"].startswith("int8") and r["decode_tok_per_s"] > 0
    p = r["peer"]
    assert p["mode"] == ("compressed-tensors int-quantized checkpoint, decompressed to float32 at the first forward: "
                         f"dense matmuls, activations quantized and dequantized on the fly; {EAGER}")
    assert p["weights"] == "checkpoint" and p["decode_tok_per_s"] > 0 and "peer_unavailable" not in r
    assert r["speedup_over_peer"] == pytest.approx(r["decode_tok_per_s"] / p["decode_tok_per_s"], abs=1e-3)
    assert render(r).splitlines()[-1].startswith(f"peer     transformers ({p['mode']}): ")


def test_what_the_int8_mode_says_is_what_transformers_does(converted):
    """transformers loads the int8 weights as they are, through compressed-tensors, and at the first
    forward replaces them with int8 * scale in the model dtype; each linear then quantizes and
    dequantizes its input per token (the scheme's dynamic input activations) around a dense matmul."""
    from compressed_tensors.quantization import QuantizationStatus
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted["int8"], dtype=torch.float32).eval()
    assert type(model.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer"
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.int8 and q_proj.quantization_status == QuantizationStatus.COMPRESSED
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    saved = load_file(converted["int8"] / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    assert q_proj.quantization_status == QuantizationStatus.DECOMPRESSED
    assert torch.equal(q_proj.weight, saved[f"{name}.weight"].float() * saved[f"{name}.weight_scale"])
    activations = q_proj.quantization_scheme.input_activations
    assert (activations.num_bits, activations.strategy, activations.dynamic) == (8, "token", True)


def test_awq_checkpoint_has_no_peer_and_says_why(converted, capsys):
    need = missing("gptqmodel", "accelerate")
    if not need:
        pytest.skip("gptqmodel and accelerate are installed: transformers loads AWQ")
    r = offline(capsys, converted["int4"])
    assert r["quantization"].startswith("awq") and r["output_tok_per_s"] > 0  # ours ran
    reason = f"transformers loads AWQ checkpoints through gptqmodel: pip install {' '.join(need)}"
    assert (r["peer"], r["peer_unavailable"]) == (None, reason) and "speedup_over_peer" not in r
    assert render(r).splitlines()[-1] == f"peer     transformers not run: {reason}"


def test_fp8_checkpoint_on_cpu_is_dequantized_by_transformers_or_says_why(converted, capsys):
    """transformers' FP8 kernels need CUDA of compute capability 8.9+ or XPU; on the CPU it dequantizes
    a fine-grained FP8 checkpoint at load, and loads one at all only with accelerate."""
    r = offline(capsys, converted["fp8"])
    assert r["quantization"].startswith("fp8") and r["output_tok_per_s"] > 0
    if missing("accelerate"):
        reason = "transformers loads fine-grained FP8 (quant_method fp8) only with accelerate: pip install accelerate"
        assert (r["peer"], r["peer_unavailable"]) == (None, reason)
        assert render(r).splitlines()[-1] == f"peer     transformers not run: {reason}"
    else:
        assert r["peer"]["mode"] == ("fine-grained FP8 checkpoint dequantized to float32 at load: dense matmuls "
                                     "(transformers' FP8 kernels need a GPU of compute capability 8.9+ or an XPU); " + EAGER)
        assert r["peer"]["output_tok_per_s"] > 0


def test_in_situ_int8_peer_is_the_unquantized_model_labelled_so(llama, capsys):
    r = offline(capsys, llama, "--quantization", "int8")
    assert r["quantization"] == "int8 (in situ)"
    assert r["peer"]["mode"] == ("unquantized float32 model, not int8: transformers has no in-situ int8 W8A8 "
                                 f"(compressed-tensors checkpoints come quantized); {EAGER}")
    assert r["peer"]["output_tok_per_s"] > 0


CPU = torch.device("cpu")
FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("quantization_config, quantization, dummy, want", [
    (None, None, False, Peer()),
    (None, "fp8", False, Peer("unquantized bfloat16 model, not fp8: transformers quantizes to FP8 in situ only on "
                              "a GPU of compute capability 8.9+ or an XPU, not on cpu")),
    (None, "fp8", True, Peer("unquantized bfloat16 model, not fp8: transformers quantizes to FP8 only while loading "
                             "a checkpoint, not with --load-format dummy")),
    (None, "int4", False, Peer("unquantized bfloat16 model, not int4: transformers has no in-situ AWQ (AWQ "
                               "checkpoints come calibrated)")),
    (FP8_CONFIG, None, True, ("transformers draws no random weights in a quantized checkpoint's format "
                              "(--load-format dummy)")),
    ({"quant_method": "bitnet"}, None, False, "no transformers path known to the peer for quant_method 'bitnet'"),
])
def test_choose_peer(quantization_config, quantization, dummy, want):
    assert choose_peer(quantization_config, quantization, CPU, torch.bfloat16, dummy) == want
