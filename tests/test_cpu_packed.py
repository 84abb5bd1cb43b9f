"""The CPU backend's packed linears (contract 1.7, ``chitu_cpu.packed``) and GGUF vocabulary tables kept
quantized.

Each GGUF type is packed from random blocks and multiplied against the reference dequantizer in
float64, within bfloat16's rounding (the kernel's; the K-quants come only from files, so the conformance suite, which quantizes, cannot make
them); AWQ's int4 layout likewise. Then tiny Llama GGUFs whose token embedding (tied to the LM head,
or not, with a quantized head of its own) load with every table and linear kept in blocks, packed,
and match the same files dequantized (``packed_checks``: they multiply in bfloat16).
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from chitu_core import LLM
from chitu_core.layers.embedding import LMHead
from chitu_core.layers.linear import LinearBase
from chitu_core.loader import resolve_model
from chitu_core.ops.table import resolve_ops
from chitu_core.quantization.awq import AWQMethod
from chitu_core.quantization.gguf import GGUFMethod
from chitu_core.quantization.gguf_blocks import (AFFINE_BITS, BLOCK, NAMES, Q4_0, Q4_1, Q6_K, Q8_0, affine_groups,
                                                 dequantize, random_blocks)
from chitu_cpu.packed import DenseLinear, ExactTopHead, Int4PackLinear, Q8_0Head, pack_linear
from packed_checks import assert_matches_dequantized
from test_quant_gguf import PROMPTS, SIZES, layer_types, write_quantized_gguf

gguf = pytest.importorskip("gguf")


def _gguf_layer(qtype: int, n: int, k: int, seed: int = 0) -> tuple[GGUFMethod, nn.Module]:
    method, layer = GGUFMethod({"qtype": qtype}), nn.Module()
    method.create_weights(layer, k, n, torch.float32, torch.device("cpu"))
    layer.qweight.data.copy_(random_blocks(qtype, n, k, torch.Generator().manual_seed(seed)))
    return method, layer


def _nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).pow(2).sum() / want.pow(2).sum()).item()


@pytest.mark.parametrize("qtype", list(BLOCK), ids=NAMES.get)
def test_affine_groups_are_the_dequantized_values(qtype):
    blocks = random_blocks(qtype, 32, 512, torch.Generator().manual_seed(qtype))
    if qtype not in AFFINE_BITS:
        with pytest.raises(ValueError, match="no groups of 32"):
            affine_groups(blocks, qtype)
        return
    q, scale, offset = affine_groups(blocks, qtype)
    assert int(q.min()) >= 0 and int(q.max()) < 2 ** AFFINE_BITS[qtype]
    w = (q.reshape(32, -1, 32).float() * scale[..., None] + offset[..., None]).reshape(32, 512)
    assert torch.equal(w, dequantize(blocks, qtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", list(BLOCK), ids=NAMES.get)
def test_each_gguf_type_packs_and_multiplies_like_its_dequantization(qtype, dtype):
    method, layer = _gguf_layer(qtype, 48, 512, seed=qtype)
    packed = pack_linear(method, layer, dtype)
    assert isinstance(packed, DenseLinear if qtype == Q6_K else Int4PackLinear)
    x, bias = torch.randn(5, 512).to(dtype), torch.randn(48).to(dtype)
    want = x.double() @ dequantize(layer.qweight, qtype).double().t() + bias.double()
    got = packed(x, bias)
    assert got.shape == (5, 48) and got.dtype == dtype
    assert _nmse(got, want) <= 1e-4  # both dtypes multiply in bfloat16 (the module docstring)


def test_eight_bit_weights_take_twice_the_nibbles_and_x_twice():
    method, layer = _gguf_layer(Q8_0, 32, 256)
    packed = pack_linear(method, layer, torch.float32)
    assert packed.parts == 2 and packed.scales_zeros.shape == (2 * 256 // 32, 32, 2)
    x = torch.randn(3, 256).bfloat16().float()  # what the kernel multiplies: no rounding of x left to blame
    assert _nmse(packed(x, None), x.double() @ dequantize(layer.qweight, Q8_0).double().t()) <= 3e-5


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1], ids=NAMES.get)
def test_a_tied_heads_largest_logits_are_the_exact_weights(qtype):
    """The packed product's logits are bfloat16 values (close ones tie); a tied head recomputes each row's
    largest in float32 from the blocks, so the greedy choice is the exact weights' (the unpacked path's).
    (A tied Q8_0 head is not packed: ``test_gguf_head``.)"""
    method, layer = _gguf_layer(qtype, 512, 256, seed=qtype)
    layer.tied = nn.Module()  # what LMHead.tie sets: the embedding keeps the blocks anyway
    packed = pack_linear(method, layer, torch.float32)
    assert isinstance(packed, ExactTopHead)
    x = torch.randn(4, 256)
    want = x.double() @ dequantize(layer.qweight, qtype).double().t()
    got = packed(x, None)
    top = want.topk(ExactTopHead.TOP // 2, dim=-1).indices  # well inside the recomputed ones
    assert torch.allclose(got.gather(-1, top).double(), want.gather(-1, top), rtol=1e-6, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert _nmse(got, want) <= 1e-4  # the rest stay the packed product's
    del layer.tied
    assert type(pack_linear(method, layer, torch.float32)) is Int4PackLinear  # an untied head: no blocks kept


def test_rows_not_a_multiple_of_16_are_dequantized_once():
    method, layer = _gguf_layer(Q4_1, 40, 256)
    packed = pack_linear(method, layer, torch.bfloat16)
    assert isinstance(packed, DenseLinear) and packed.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_packs_its_int4_layout(group_size):
    method, layer = AWQMethod({"group_size": group_size, "zero_point": True}), nn.Module()
    method.create_weights(layer, 256, 64, torch.float32, torch.device("cpu"))
    w = torch.randn(64, 256) / 16
    for name, t in method.quantize(w).items():
        getattr(layer, name).data.copy_(t)
    method.process_weights_after_loading(layer)
    packed = pack_linear(method, layer, torch.float32)
    assert isinstance(packed, Int4PackLinear)
    x = torch.randn(4, 256)
    want = method.apply(layer, x.double(), None, resolve_ops("reference", {}))
    assert _nmse(packed(x, None), want.double()) <= 1e-4


def test_other_methods_are_declined():
    from chitu_core.quantization.int8 import Int8Method

    method, layer = Int8Method({}), nn.Module()
    method.create_weights(layer, 64, 32, torch.float32, torch.device("cpu"))
    assert pack_linear(method, layer, torch.float32) is None


# --- GGUF files with their tables kept -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two small Llamas, by whether the LM head is tied to the embedding."""
    from builders import build_model, save_tokenizer

    models = {}
    for tied in (True, False):
        path = tmp_path_factory.mktemp(f"tiny-packed-{tied}")
        models[tied] = build_model(path / "hf", "llama", tie_word_embeddings=tied, **SIZES), save_tokenizer(path / "hf")
    return models


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CHITU_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("tied, embed_type, head_type", [(True, Q8_0, None), (False, Q4_0, Q8_0)],
                         ids=["tied-Q8_0", "untied-Q4_0-Q8_0"])
def test_kept_vocabulary_tables_match_the_dequantized_file(tied, embed_type, head_type, tiny, tmp_path, monkeypatch,
                                                          cache_dir):
    hf, tok = tiny[tied]
    types = {**layer_types(2, attn_q=Q4_1, attn_k=Q4_1, attn_v=Q4_1, attn_output=Q4_0, ffn_gate=Q4_1, ffn_up=Q4_1,
                           ffn_down=Q8_0), "token_embd.weight": embed_type}
    if head_type is not None:
        types["output.weight"] = head_type
    path = write_quantized_gguf(tmp_path / "tables.gguf", hf, tok, types, monkeypatch)
    kept_dir = Path(resolve_model(path, keep_quantized=True))
    qc = json.loads((kept_dir / "config.json").read_text())["quantization_config"]
    assert qc["tensor_types"]["model.embed_tokens.weight"] == embed_type
    assert qc["tensor_types"].get("lm_head.weight") == head_type
    opts = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=256, max_num_seqs=4)
    kept, dense = LLM(model=str(kept_dir), **opts), LLM(model=resolve_model(path), **opts)
    dense_bf16 = LLM(model=resolve_model(path), **{**opts, "dtype": "bfloat16"})

    model = kept.engine.model
    embed, head = model.model.embed_tokens, model.lm_head
    assert embed.qweight.dtype == torch.uint8 and embed.quant.options["qtype"] == embed_type  # the lookups' blocks
    assert (head.tied is embed) == tied and head.quant.options["qtype"] == (head_type or embed_type)
    assert isinstance(head.packed, Q8_0Head if tied else Int4PackLinear) and not hasattr(head, "qweight")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.packed, Int4PackLinear) and not hasattr(m, "qweight") for m in linears)

    assert_matches_dequantized(kept, dense, dense_bf16, PROMPTS)


def test_pack_linear_off_keeps_the_methods_layers_and_the_files_exact_weights(tiny, tmp_path, monkeypatch, cache_dir):
    """EngineConfig.pack_linear=False (``bench agree --unpacked``): no layer is offered to the backend, so the
    GGUF method's own blocks and ops run, and greedy tokens are the dequantized float32 file's."""
    from chitu_core import SamplingParams

    hf, tok = tiny[False]
    types = layer_types(2, attn_q=Q4_1, attn_k=Q4_1, attn_v=Q4_1, attn_output=Q4_0, ffn_gate=Q4_1, ffn_up=Q4_1,
                        ffn_down=Q8_0)
    path = write_quantized_gguf(tmp_path / "unpacked.gguf", hf, tok, types, monkeypatch)
    opts = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=256, max_num_seqs=4)
    unpacked = LLM(model=resolve_model(path, keep_quantized=True), pack_linear=False, **opts)
    dense = LLM(model=resolve_model(path), **opts)
    linears = [m for m in unpacked.engine.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.packed is None and m.qweight.dtype == torch.uint8 for m in linears)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert ([o.outputs[0].token_ids for o in unpacked.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in dense.generate(prompts, params)])
