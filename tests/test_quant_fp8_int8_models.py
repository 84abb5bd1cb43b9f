"""8-bit checkpoints of a tiny Llama end to end against transformers running the same dequantized weights:
a DeepSeek-style FP8 block checkpoint, compressed-tensors int8 (activations quantized or not), and in-situ
quantization (the layouts and methods themselves: test_quant_fp8_int8.py)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from builders import build_model
from chitu_core import LLM
from chitu_core.quantization.fp8 import Fp8Method
from chitu_core.quantization.int8 import Int8Method
from test_models import batched_last_logits
from test_quant_fp8_int8 import BLOCK_FP8, ct_checkpoint, decode_blocks, decode_fp8


def _hf_linears(hf):
    """(checkpoint prefix, transformers Linear) of every linear layer of the decoder."""
    for i, block in enumerate(hf.model.layers):
        for owner, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                yield f"model.layers.{i}.{owner}.{name}", getattr(getattr(block, owner), name)


def _save(tmp_path, hf, tensors_of, config: dict | None) -> None:
    """Replace each linear's weight in the checkpoint by ``tensors_of(prefix, weight)`` (which also
    returns the dequantized weight, put back into ``hf``), and write config.json's quantization_config."""
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    with torch.no_grad():
        for prefix, linear in _hf_linears(hf):
            tensors, dense = tensors_of(prefix, linear.weight.detach().clone())
            del state[f"{prefix}.weight"]
            state.update({f"{prefix}.{key}": t for key, t in tensors.items()})
            linear.weight.copy_(dense.float())
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        hf_config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**hf_config, "quantization_config": config}))


PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 43))]


def _compare(llm, hf) -> None:
    ours = batched_last_logits(llm, PROMPTS)
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    assert (ours - want).abs().max().item() <= 1e-4  # W8A8: 7.7e-7 measured, 0.06 with 16-bit activations
    assert ours.argmax(-1).equal(want.argmax(-1))


@pytest.fixture
def cpu_runs_8bit(monkeypatch):
    from chitu_cpu.backend import CpuBackend

    monkeypatch.setattr(CpuBackend, "quant_methods", lambda self: frozenset({"unquantized", "fp8", "int8"}))


def test_deepseek_fp8_block_checkpoint_matches_transformers(tmp_path, cpu_runs_8bit):
    # head_dim 128 and 128-wide k and v: every fused part starts on a block boundary, as in real models
    hf = build_model(tmp_path, "llama", hidden_size=256, intermediate_size=384, num_attention_heads=2,
                     num_key_value_heads=1)
    method = Fp8Method({"weight_block_size": [128, 128]})

    def tensors_of(prefix, w):
        tensors = method.quantize(w)
        return tensors, decode_blocks(tensors["weight"], tensors["weight_scale_inv"])

    _save(tmp_path, hf, tensors_of, BLOCK_FP8)
    llm = LLM(tmp_path, device="cpu", dtype="float32", load_progress=False)
    assert llm.engine.quant.method == "fp8"
    _compare(llm, hf)


@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
def test_compressed_tensors_int8_checkpoint_matches_transformers(act_quant, tmp_path, cpu_runs_8bit):
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    hf = build_model(tmp_path, "llama")
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    config = ct_checkpoint("W8A8", torch.randn(8, 8))[0]
    if not act_quant:
        config["config_groups"]["group_0"]["input_activations"] = None

    def tensors_of(prefix, w):
        tensors = Int8Method().quantize(w)
        return tensors, IntQuantizationCompressor.decompress(tensors, scheme)["weight"]

    _save(tmp_path, hf, tensors_of, config)
    if act_quant:  # transformers sees what the int8 products see: each linear's input rows quantized
        for _, linear in _hf_linears(hf):
            linear.register_forward_pre_hook(lambda module, args: (_int8_rows(args[0]),))
    llm = LLM(tmp_path, device="cpu", dtype="float32", load_progress=False)
    assert (llm.engine.quant.method, llm.engine.quant.options["act_quant"]) == ("int8", act_quant)
    _compare(llm, hf)


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x / s).clamp(-127, 127) * s


def _fused_in_situ(hf, quantize_dequantize) -> None:
    """Put into ``hf`` the weights in-situ quantization gives: q, k, v (and gate, up) quantized as the
    one fused matrix the model holds."""
    with torch.no_grad():
        for block in hf.model.layers:
            for linears in ([block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj],
                            [block.self_attn.o_proj], [block.mlp.gate_proj, block.mlp.up_proj], [block.mlp.down_proj]):
                dense = quantize_dequantize(torch.cat([lin.weight for lin in linears]))
                for lin, part in zip(linears, dense.split([lin.weight.shape[0] for lin in linears])):
                    lin.weight.copy_(part)


@pytest.mark.parametrize("flag", ["fp8", "int8"])
def test_in_situ_quantization_matches_transformers_on_the_rounded_weights(flag, tmp_path, cpu_runs_8bit):
    hf = build_model(tmp_path, "llama")

    def fp8_blocks(w):  # 128 x 128 blocks, amax / 448, round to nearest even: written out here
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, (-k) % 128, 0, (-n) % 128))
        s = padded.abs().unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).amax((1, 3)) / 448
        s = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return decode_fp8((w / s).to(torch.float8_e4m3fn)) * s.double()

    def int8_rows(w):
        s = w.abs().amax(1, keepdim=True) / 127
        return torch.round(w / s).clamp(-127, 127) * s

    _fused_in_situ(hf, fp8_blocks if flag == "fp8" else int8_rows)
    if flag == "int8":  # in-situ int8 is W8A8
        for _, linear in _hf_linears(hf):
            linear.register_forward_pre_hook(lambda module, args: (_int8_rows(args[0]),))
    llm = LLM(tmp_path, device="cpu", dtype="float32", load_progress=False, quantization=flag)
    assert (llm.engine.quant.method, llm.engine.quant.in_situ) == (flag, True)
    layer = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == (torch.float8_e4m3fn if flag == "fp8" else torch.int8)
    _compare(llm, hf)
