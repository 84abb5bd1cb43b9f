"""GGUF weights kept quantized: the reference block dequantizers against the gguf package and against
blocks packed by hand from the published layouts, the "gguf" quantization method, and tiny Llama
GGUFs (Q4_0, Q4_1, Q8_0 and K-quant tensors) loaded with their linear weights kept as blocks,
against the same files dequantized.

The CPU backend declares "gguf" and packs such layers into its own layout at load
(``chitu_cpu.packed``, tested in test_cpu_packed.py; it multiplies in bfloat16); these tests hold it
to the dequantized file (``packed_checks``).
"""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from builders import build_model, save_tokenizer, write_llama_gguf
from chitu_core import LLM
from chitu_core.errors import ModelLoadError
from chitu_core.loader import gguf as gguf_loader
from chitu_core.loader import resolve_model
from chitu_core.ops.table import resolve_ops
from chitu_core.quantization import UnquantizedMethod
from chitu_core.quantization.gguf import GGUFMethod
from chitu_core.quantization.gguf_blocks import (BLOCK, NAMES, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, dequantize,
                                                 random_blocks)
from packed_checks import assert_matches_dequantized

gguf = pytest.importorskip("gguf")
TYPES = list(BLOCK)
F16 = 1  # ggml's type id
REFERENCE = resolve_ops("reference", {})


def _gguf_dequantize(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(qtype)).copy())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype == torch.float32
            and torch.equal(a.view(torch.int32), b.view(torch.int32)))


# --- the block dequantizers ------------------------------------------------------------------------

def _any_finite_halves(gen: torch.Generator, n: int) -> torch.Tensor:
    """n random finite half floats as uint8 [n, 2]: every exponent but the all-ones one
    (subnormals and signed zeros included)."""
    bits = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32)
    bits = torch.where((bits & 0x7C00) == 0x7C00, bits & ~0x4000, bits)
    return torch.stack([bits & 0xFF, bits >> 8], 1).to(torch.uint8)


HALF_FIELDS = {Q4_0: (0,), Q4_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_dequantize_equals_the_gguf_package_bit_for_bit(qtype):
    e, b = BLOCK[qtype]
    gen = torch.Generator().manual_seed(qtype)
    for rows, k in [(1, e), (7, 4 * e), (33, 4096)]:
        blocks = random_blocks(qtype, rows, k, gen)
        assert blocks.shape == (rows, k // e * b) and blocks.dtype == torch.uint8
        assert _same_bits(dequantize(blocks, qtype), _gguf_dequantize(blocks, qtype))
    # Every bit pattern of the quants and scales, and any finite half-float d/dmin/m.
    raw = torch.randint(0, 256, (4096, b), generator=gen, dtype=torch.uint8)
    for at in HALF_FIELDS[qtype]:
        raw[:, at:at + 2] = _any_finite_halves(gen, raw.shape[0])
    ours = dequantize(raw.reshape(64, -1), qtype)
    assert ours.shape == (64, 64 * e) and torch.isfinite(ours).all()
    assert _same_bits(ours, _gguf_dequantize(raw.reshape(64, -1), qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_random_blocks_are_sized_like_weights(qtype):
    gen = torch.Generator().manual_seed(1)
    for k in (256, 4096):
        w = dequantize(random_blocks(qtype, 64, k, gen), qtype)
        rms = w.pow(2).mean().sqrt().item() * k**0.5
        assert torch.isfinite(w).all() and 0.4 < rms < 2.5, (NAMES[qtype], k, rms)


def _half(value: float) -> bytes:
    return struct.pack("<e", value)


def _pack_scale_min_k4(sc: list[int], mn: list[int]) -> bytes:
    """The 12 scale bytes of a Q4_K/Q5_K block, written from ggml's layout: bytes 0-3 hold the low
    6 bits of scales 0-3 and, in their top 2 bits, the top bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scale 4+i (low nibble) and min 4+i (high nibble)."""
    out = bytearray(12)
    for i in range(4):
        out[i] = (sc[i] & 63) | ((sc[4 + i] >> 4) << 6)
        out[4 + i] = (mn[i] & 63) | ((mn[4 + i] >> 4) << 6)
        out[8 + i] = (sc[4 + i] & 0xF) | ((mn[4 + i] & 0xF) << 4)
    return bytes(out)


def _f32(x: float) -> float:
    return float(np.float32(x))


def test_hand_packed_blocks_dequantize_to_their_values():
    """One block of each type, packed from the layout and dequantized by hand in float32."""
    q32 = [(7 * j + 3) % 16 for j in range(32)]
    cases = {
        # Q4_0: d = 0.5; byte j holds element j (low nibble) and 16 + j (high nibble); w = (q - 8) d
        Q4_0: (_half(0.5) + bytes(q32[j] | (q32[16 + j] << 4) for j in range(16)),
               [(q - 8) * 0.5 for q in q32]),
        # Q4_1: d = 0.25, m = -1.5; w = q d + m
        Q4_1: (_half(0.25) + _half(-1.5) + bytes(q32[j] | (q32[16 + j] << 4) for j in range(16)),
               [q * 0.25 - 1.5 for q in q32]),
        # Q8_0: d = -2^-10 (tiny, still a normal half); int8 quants
        Q8_0: (_half(-2.0**-10) + bytes((v * 37 - 128) & 0xFF for v in range(32)),
               [((v * 37 - 128 + 128) % 256 - 128) * -(2.0**-10) for v in range(32)]),
    }
    # Q4_K / Q5_K: scales and mins reaching 63 (their top bits live in other bytes), d = 2^-8, dmin = 3 * 2^-12
    sc, mn = [63, 1, 32, 17, 48, 5, 60, 33], [0, 63, 31, 40, 2, 58, 16, 47]
    q_k = [(5 * e + e // 64) % 32 for e in range(256)]
    d, dmin = 2.0**-8, 3 * 2.0**-12
    qs4 = bytes((q_k[64 * j + li] & 0xF) | ((q_k[64 * j + 32 + li] & 0xF) << 4) for j in range(4) for li in range(32))
    k4 = [_f32(_f32(d * sc[e // 32]) * (q_k[e] & 0xF) - _f32(dmin * mn[e // 32])) for e in range(256)]
    cases[Q4_K] = (_half(d) + _half(dmin) + _pack_scale_min_k4(sc, mn) + qs4, k4)
    qh5 = bytes(sum(((q_k[64 * j + 32 * u + li] >> 4) & 1) << (2 * j + u) for j in range(4) for u in range(2))
                for li in range(32))
    k5 = [_f32(_f32(d * sc[e // 32]) * q_k[e] - _f32(dmin * mn[e // 32])) for e in range(256)]
    cases[Q5_K] = (_half(d) + _half(dmin) + _pack_scale_min_k4(sc, mn) + qh5 + qs4, k5)
    # Q6_K: element 128h + 32t + l: low nibble in ql[64h + 32(t % 2) + l] (high half for t >= 2),
    # top 2 bits at bit 2t of qh[32h + l]; scale scales[e // 16] (int8); w = d * sc * (q - 32)
    q6 = [(11 * e + e // 16) % 64 for e in range(256)]
    scales6 = [(-1) ** s * (s * 8 + 1) for s in range(16)]
    ql, qh = bytearray(128), bytearray(64)
    for e, q in enumerate(q6):
        h, t, li = e // 128, (e % 128) // 32, e % 32
        ql[64 * h + 32 * (t % 2) + li] |= (q & 0xF) << (4 * (t // 2))
        qh[32 * h + li] |= (q >> 4) << (2 * t)
    d6 = 2.0**-14  # the smallest normal half
    cases[Q6_K] = (bytes(ql) + bytes(qh) + struct.pack("<16b", *scales6) + _half(d6),
                   [_f32(_f32(d6 * scales6[e // 16]) * (q6[e] - 32)) for e in range(256)])
    for qtype, (block, expected) in cases.items():
        assert len(block) == BLOCK[qtype][1], NAMES[qtype]
        got = dequantize(torch.tensor(list(block), dtype=torch.uint8), qtype)
        assert got.tolist() == [_f32(v) for v in expected], NAMES[qtype]


def test_dequantize_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"Q5_0|ggml type 6.*not a supported block type; supported: Q4_0 \(2\)"):
        dequantize(torch.zeros(22, dtype=torch.uint8), 6)
    with pytest.raises(ValueError, match=r"rows of \[35\] bytes are not whole 34-byte blocks"):
        dequantize(torch.zeros(35, dtype=torch.uint8), Q8_0)


# --- the method ------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0], ids=NAMES.get)
def test_quantize_is_the_gguf_packages_and_apply_multiplies_its_dequantization(qtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen, dtype=torch.float64) / 16
    method = GGUFMethod({"qtype": qtype})
    layer = torch.nn.Module()
    method.create_weights(layer, 256, 48, torch.float32, torch.device("cpu"))
    tensors = method.quantize(w)
    assert set(tensors) == {"qweight"} and tensors["qweight"].shape == layer.qweight.shape
    expected = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType(qtype))
    assert np.array_equal(tensors["qweight"].numpy(), expected)
    layer.qweight.data.copy_(tensors["qweight"])
    method.process_weights_after_loading(layer)
    dense = method.dequantize(layer)
    assert _same_bits(dense, _gguf_dequantize(tensors["qweight"], qtype))
    assert (dense - w.float()).abs().max() < 0.1 * w.abs().max()
    x = torch.randn(3, 5, 256, generator=gen, dtype=torch.float64)
    bias = torch.randn(48, generator=gen, dtype=torch.float64)
    assert torch.allclose(method.apply(layer, x, bias, REFERENCE), x @ dense.double().T + bias, rtol=0, atol=1e-12)
    assert method.weight_bytes(layer) == layer.qweight.numel()


def test_k_quants_cannot_be_produced_here():
    for qtype in (Q4_K, Q5_K, Q6_K):
        with pytest.raises(NotImplementedError, match=f"cannot quantize to {NAMES[qtype]}"):
            GGUFMethod({"qtype": qtype}).quantize(torch.zeros(4, 256))
    assert GGUFMethod.conformance_options() == [{"qtype": Q4_0}, {"qtype": Q4_1}, {"qtype": Q8_0}]


def test_parameters_split_at_block_boundaries():
    """qweight splits along the output rows and, row-split, at whole blocks: rank r of 2 takes
    bytes [r * half, (r + 1) * half) of each row."""
    from types import SimpleNamespace

    from chitu_core.layers.context import BuildContext
    from chitu_core.layers.linear import RowParallelLinear
    from chitu_core.quantization.select import QuantSpec

    for qtype in TYPES:
        e, _ = BLOCK[qtype]
        k, n = 4 * max(e, 64), 8
        full = random_blocks(qtype, n, k, torch.Generator().manual_seed(qtype))
        for rank in (0, 1):
            comm = SimpleNamespace(rank=rank, world_size=2, all_reduce=lambda x: x)
            spec = QuantSpec("gguf", {"qtype": qtype})
            ctx = BuildContext(REFERENCE, None, comm, torch.float32, torch.device("cpu"), spec)
            layer = RowParallelLinear(k, n, ctx)
            layer.qweight.weight_loader(layer.qweight, full)
            half = full.shape[1] // 2
            assert torch.equal(layer.qweight, full[:, rank * half:(rank + 1) * half]), NAMES[qtype]
            dense = dequantize(full, qtype)
            assert torch.equal(layer.quant.dequantize(layer), dense[:, rank * k // 2:(rank + 1) * k // 2])


def test_layer_options_take_each_layers_type():
    qc = {"quant_method": "gguf", "tensor_types": {
        "model.layers.0.self_attn.q_proj.weight": Q4_K, "model.layers.0.self_attn.k_proj.weight": Q4_K,
        "model.layers.0.self_attn.v_proj.weight": Q4_K, "model.layers.0.mlp.down_proj.weight": Q6_K,
        "model.layers.1.self_attn.q_proj.weight": Q4_K, "model.layers.1.self_attn.k_proj.weight": Q6_K}}
    assert GGUFMethod.options_from_checkpoint(qc) == {"qtype": Q4_K}
    parts = tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert GGUFMethod.layer_options(qc, "model.layers.0.self_attn.qkv_proj", parts) == {"qtype": Q4_K}
    assert GGUFMethod.layer_options(qc, "model.layers.0.mlp.down_proj", ()) == {"qtype": Q6_K}
    with pytest.raises(ModelLoadError, match=r"fuses .*q_proj, .*k_proj, whose GGUF types differ \(Q4_K, Q6_K\)"):
        GGUFMethod.layer_options(qc, "model.layers.1.self_attn.qkv_proj",
                                 ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"))
    with pytest.raises(ModelLoadError, match=r"no type for model.layers.0.mlp.up_proj.weight"):
        GGUFMethod.layer_options(qc, "model.layers.0.mlp.gate_up_proj", ("model.layers.0.mlp.up_proj",))
    with pytest.raises(ModelLoadError, match=r"Q3_K|ggml type 11.*does not run"):
        GGUFMethod.options_from_checkpoint({"quant_method": "gguf", "tensor_types": {"a.weight": 11}})
    with pytest.raises(ModelLoadError, match="non-empty 'tensor_types'"):
        GGUFMethod.options_from_checkpoint({"quant_method": "gguf"})


# --- GGUF files kept quantized ---------------------------------------------------------------------

SIZES = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
"""Every linear's input is a whole number of 256-element K-quant blocks."""


def write_quantized_gguf(path: Path, hf, tokenizer, types: dict[str, int], monkeypatch) -> Path:
    """``write_llama_gguf`` with the tensors named in ``types`` (GGUF names) stored as that ggml type:
    F16, Q4_0/Q4_1/Q8_0 by the gguf package's quantizers (of the already permuted rows, as llama.cpp
    does), K-quants as random blocks (the gguf package cannot quantize to them)."""

    class QuantizingWriter(gguf.GGUFWriter):
        def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None):
            qtype = types.get(name)
            if qtype is None:
                return super().add_tensor(name, tensor, raw_shape, raw_dtype)
            if qtype == F16:
                return super().add_tensor(name, tensor.astype(np.float16))
            if qtype in (Q4_0, Q4_1, Q8_0):
                blocks = gguf.quants.quantize(tensor, gguf.GGMLQuantizationType(qtype))
            else:
                gen = torch.Generator().manual_seed(len(name) * 1000 + qtype)
                blocks = random_blocks(qtype, tensor.shape[0], tensor.shape[1], gen).numpy()
            return super().add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType(qtype))

    with monkeypatch.context() as mp:
        mp.setattr(gguf, "GGUFWriter", QuantizingWriter)
        return write_llama_gguf(path, hf, tokenizer)


def layer_types(layers: int, **by_leaf: int) -> dict[str, int]:
    """{"blk.L.<leaf>.weight": type} for every layer."""
    return {f"blk.{i}.{leaf}.weight": t for i in range(layers) for leaf, t in by_leaf.items()}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chitu-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHITU_CACHE_DIR", str(path))
        yield path


@pytest.fixture
def cpu_runs_gguf(cache_dir):
    """The CPU backend runs "gguf" (packed): a kept directory loads on it."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-quant-gguf")
    hf = build_model(path / "hf", "llama", **SIZES)
    return hf, save_tokenizer(path / "hf"), path


PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 43)), [300, 200, 100]]


def _pair(path: Path) -> tuple[LLM, LLM, Path]:
    kept_dir = Path(resolve_model(path, keep_quantized=True))
    dense_dir = Path(resolve_model(path))
    opts = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=256, max_num_seqs=4)
    return LLM(model=str(kept_dir), **opts), LLM(model=str(dense_dir), **opts), kept_dir


def _dense_bf16(path: Path) -> LLM:
    return LLM(model=resolve_model(path), device="cpu", dtype="bfloat16", load_progress=False, max_model_len=256,
               max_num_seqs=4)


def _methods(llm: LLM) -> dict[str, str]:
    from chitu_core.layers.linear import LinearBase

    return {name: (m.quant.name, m.quant.options.get("qtype")) for name, m in llm.engine.model.named_modules()
            if isinstance(m, LinearBase)}


@pytest.mark.parametrize("types", [
    dict(attn_q=Q4_0, attn_k=Q4_0, attn_v=Q4_0, attn_output=Q8_0, ffn_gate=Q4_1, ffn_up=Q4_1, ffn_down=Q8_0),
    dict(attn_q=Q4_K, attn_k=Q4_K, attn_v=Q4_K, attn_output=Q5_K, ffn_gate=Q6_K, ffn_up=Q6_K, ffn_down=Q4_K),
], ids=["Q4_0-Q4_1-Q8_0", "K-quants"])
def test_kept_quantized_load_matches_the_dequantized_one(types, tiny, tmp_path, monkeypatch, cpu_runs_gguf):
    hf, tok, _ = tiny
    path = write_quantized_gguf(tmp_path / "model.gguf", hf, tok, layer_types(2, **types), monkeypatch)
    kept, dense, kept_dir = _pair(path)

    qc = json.loads((kept_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gguf" and qc["modules_to_not_convert"] == [] and len(qc["tensor_types"]) == 14
    names = {"attn_q": "self_attn.q_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for leaf, hf_name in names.items():
        assert qc["tensor_types"][f"model.layers.1.{hf_name}.weight"] == types[leaf]
    raw = load_file(kept_dir / "model.safetensors")
    q = raw["model.layers.0.self_attn.q_proj.qweight"]
    e, b = BLOCK[types["attn_q"]]
    assert q.dtype == torch.uint8 and q.shape == (256, 256 // e * b)
    assert raw["model.embed_tokens.weight"].dtype == torch.float32 and raw["model.norm.weight"].dtype == torch.float32
    # The kept rows are the file's rows, un-permuted like the dequantized ones.
    dense_q = load_file(Path(resolve_model(path)) / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert _same_bits(dequantize(q, types["attn_q"]), dense_q)

    methods = _methods(kept)
    assert methods["model.layers.0.self_attn.qkv_proj"] == ("gguf", types["attn_q"])
    assert methods["model.layers.1.mlp.gate_up_proj"] == ("gguf", types["ffn_gate"])
    assert methods["model.layers.1.mlp.down_proj"] == ("gguf", types["ffn_down"])
    assert set(_methods(dense).values()) == {("unquantized", None)}

    assert_matches_dequantized(kept, dense, _dense_bf16(path), PROMPTS)


def test_mixed_fused_groups_and_other_types_stay_dense(tiny, tmp_path, monkeypatch, cpu_runs_gguf):
    """Q4_K_M's pattern: attn_v (and ffn_down) in Q6_K beside Q4_K; a Q6_K attn_v splits layer 0's q/k/v
    group, an F16 ffn_down (another type) stays dense, layer 1 is all Q4_K."""
    hf, tok, _ = tiny
    types = layer_types(2, attn_q=Q4_K, attn_k=Q4_K, attn_v=Q4_K, attn_output=Q4_K, ffn_gate=Q4_K, ffn_up=Q4_K,
                        ffn_down=Q6_K)
    types["blk.0.attn_v.weight"] = Q6_K
    types["blk.1.ffn_down.weight"] = F16
    path = write_quantized_gguf(tmp_path / "mixed.gguf", hf, tok, types, monkeypatch)
    kept, dense, kept_dir = _pair(path)
    qc = json.loads((kept_dir / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                            "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]
    raw = load_file(kept_dir / "model.safetensors")
    assert raw["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float32
    assert raw["model.layers.1.self_attn.k_proj.qweight"].dtype == torch.uint8
    methods = _methods(kept)
    assert methods["model.layers.0.self_attn.qkv_proj"] == ("unquantized", None)
    assert methods["model.layers.1.self_attn.qkv_proj"] == ("gguf", Q4_K)
    assert methods["model.layers.0.mlp.down_proj"] == ("gguf", Q6_K)
    assert methods["model.layers.1.mlp.down_proj"] == ("unquantized", None)
    assert isinstance(kept.engine.model.model.layers[0].self_attn.qkv_proj.quant, UnquantizedMethod)
    assert_matches_dequantized(kept, dense, _dense_bf16(path), PROMPTS)


def test_a_gguf_with_nothing_to_keep_gets_no_quantization_config(tiny, tmp_path, cache_dir):
    hf, tok, _ = tiny
    path = write_llama_gguf(tmp_path / "f32.gguf", hf, tok)  # every matrix F32
    kept_dir = Path(resolve_model(path, keep_quantized=True))
    assert "quantization_config" not in json.loads((kept_dir / "config.json").read_text())
    assert kept_dir != Path(resolve_model(path))


def test_cache_key_and_marker_record_the_choice(tiny, tmp_path, monkeypatch, cache_dir):
    hf, tok, _ = tiny
    path = write_quantized_gguf(tmp_path / "key.gguf", hf, tok, layer_types(2, attn_q=Q8_0), monkeypatch)
    assert gguf_loader.cache_key(path, "float32", True) != gguf_loader.cache_key(path, "float32")
    assert gguf_loader.cache_key(path, "float32", False) == gguf_loader.cache_key(path)
    kept, dense = Path(resolve_model(path, keep_quantized=True)), Path(resolve_model(path))
    assert kept != dense and kept.parent == dense.parent
    assert json.loads((kept / gguf_loader.MARKER).read_text())["keep_quantized"] is True
    assert json.loads((dense / gguf_loader.MARKER).read_text())["keep_quantized"] is False
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    assert json.loads((dense / gguf_loader.MARKER).read_text())["converter_version"] == gguf_loader.CONVERTER_VERSION


def test_without_gguf_in_the_backend_a_kept_dir_is_refused(tiny, tmp_path, monkeypatch, cache_dir):
    from chitu_cpu.backend import CpuBackend

    hf, tok, _ = tiny
    path = write_quantized_gguf(tmp_path / "refused.gguf", hf, tok, layer_types(2, attn_output=Q8_0), monkeypatch)
    monkeypatch.setattr(CpuBackend, "quant_methods", lambda self: frozenset({"unquantized"}))
    with pytest.raises(Exception, match=r"backend 'cpu' does not run quantization method 'gguf'"):
        LLM(model=resolve_model(path, keep_quantized=True), device="cpu", dtype="float32", load_progress=False)
