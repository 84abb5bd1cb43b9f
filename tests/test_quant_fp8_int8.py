"""8-bit methods: "fp8" (DeepSeek-V3 / transformers 128x128 blocks, vLLM per-tensor, compressed-tensors
channel/tensor/block) and "int8" (compressed-tensors W8A8 / W8A16, in-situ per channel).

The FP8 bytes here are decoded by the test's own table, built from e4m3's published bit layout
(sign, four exponent bits biased by 7, three mantissa bits; subnormals below 2**-6), on a hand-made
2 x 3 grid of block scales whose last blocks are partial. compressed-tensors checkpoints come from
the compressed-tensors package's own compressors and its own decompression is the oracle. Then the
real linear layers (column, merged, QKV, row; tensor-parallel ranks simulated) with per-tensor
scales per fused part, round-to-nearest bounds of ``quantize``, activation quantization on and off,
and the errors unsupported configs get. A tiny Llama end to end: test_quant_fp8_int8_models.py.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from chitu_core.ops.table import resolve_ops
from chitu_core.quantization.fp8 import Fp8Method
from chitu_core.quantization.int8 import Int8Method
from chitu_core.quantization.select import QuantSpec, select_quantization

OPS = resolve_ops("reference", {})
BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def e4m3_value(byte: int) -> float:
    """The float8_e4m3fn number a byte holds, from the bit layout: s eeee mmm, bias 7, no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * 2.0**-6 * (mantissa / 8)
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


E4M3_TABLE = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float64)


def decode_fp8(weight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..] -> float64 by the table above (never through torch's own conversion)."""
    return E4M3_TABLE[weight.view(torch.uint8).long()]


def decode_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, bn: int = 128, bk: int = 128) -> torch.Tensor:
    """DeepSeek-V3's dequantization, element by block: W[n, k] = weight[n, k] * scale_inv[n // bn, k // bk]."""
    n, k = weight.shape
    rows = torch.arange(n)[:, None] // bn
    cols = torch.arange(k)[None, :] // bk
    return decode_fp8(weight) * scale_inv.double()[rows, cols]


def random_fp8(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 bytes (0x7F and 0xFF are NaN)."""
    b = torch.randint(0, 255, (n, k), generator=gen, dtype=torch.int32)
    b = torch.where(b == 0x7F, 0x7E, b).to(torch.uint8)
    return b.view(torch.float8_e4m3fn)


def ctx(method: str, options: dict, rank: int = 0, world: int = 1, in_situ: bool = False) -> BuildContext:
    comm = SimpleNamespace(rank=rank, world_size=world, all_reduce=lambda x: x)
    return BuildContext(OPS, None, comm, torch.float32, torch.device("cpu"), QuantSpec(method, options, in_situ))


def load(layer, tensors: dict, shard_id=None) -> None:
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        params[name].weight_loader(params[name], t, shard_id)


def finish(layer) -> torch.Tensor:
    """Run the load-time transform; return the layer's dequantized weight."""
    layer.quant.process_weights_after_loading(layer)
    return layer.quant.dequantize(layer)


# ----- the published layouts, by hand -----


def test_the_e4m3_table_is_the_published_format():
    assert [e4m3_value(b) for b in (0x38, 0x7E, 0xFE, 0x01, 0x08, 0xC4, 0x00, 0x80)] == \
        [1.0, 448.0, -448.0, 2.0**-9, 2.0**-6, -3.0, 0.0, -0.0]
    finite = ~E4M3_TABLE.isnan()
    assert E4M3_TABLE[finite].equal(torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn).double()[finite])


def test_deepseek_block_checkpoint_by_hand():
    """A [136, 264] weight: 2 x 3 blocks of 128 x 128, the last row of blocks 8 rows, the last column 8 wide."""
    gen = torch.Generator().manual_seed(0)
    weight = random_fp8(136, 264, gen)
    raw = weight.view(torch.uint8)
    raw[0, 0], raw[5, 200], raw[129, 3], raw[130, 260] = 0x38, 0xC4, 0x01, 0x7E  # 1, -3, 2**-9, 448
    scale_inv = torch.tensor([[0.5, 0.25, 2.0], [1.5, 0.125, 3.0]])
    layer = ColumnParallelLinear(264, 136, ctx("fp8", Fp8Method.options_from_checkpoint(BLOCK_FP8)))
    assert {n: (p.dtype, tuple(p.shape)) for n, p in layer.named_parameters()} == {
        "weight": (torch.float8_e4m3fn, (136, 264)), "weight_scale_inv": (torch.float32, (2, 3))}
    load(layer, {"weight": weight, "weight_scale_inv": scale_inv})
    w = finish(layer)
    assert (w[0, 0].item(), w[5, 200].item(), w[129, 3].item(), w[130, 260].item()) == (0.5, -0.75, 1.5 * 2**-9, 1344.0)
    assert w.double().equal(decode_blocks(weight, scale_inv))
    assert layer.weight_scale.equal(scale_inv) and not hasattr(layer, "weight_scale_inv")  # canonical names
    x = torch.randn(3, 264, generator=gen)
    torch.testing.assert_close(layer(x).double(), x.double() @ decode_blocks(weight, scale_inv).T, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("rank", [0, 1])
def test_block_scales_split_across_ranks_by_whole_blocks(rank):
    gen = torch.Generator().manual_seed(rank)
    options = Fp8Method.options_from_checkpoint(BLOCK_FP8)
    weight, scale_inv = random_fp8(256, 512, gen), torch.rand(2, 4, generator=gen) + 0.5
    full = decode_blocks(weight, scale_inv).float()  # each product rounded once, as float32 dequantization does
    column = ColumnParallelLinear(512, 256, ctx("fp8", options, rank, 2))
    load(column, {"weight": weight, "weight_scale_inv": scale_inv})
    assert finish(column).equal(full[128 * rank:128 * rank + 128])
    row = RowParallelLinear(512, 256, ctx("fp8", options, rank, 2))
    load(row, {"weight": weight, "weight_scale_inv": scale_inv})
    assert finish(row).equal(full[:, 256 * rank:256 * rank + 256])


def test_a_fused_part_that_starts_inside_a_block_is_an_error():
    layer = QKVParallelLinear(128, 64, 2, 1, ctx("fp8", Fp8Method.options_from_checkpoint(BLOCK_FP8)))
    gen = torch.Generator().manual_seed(0)
    load(layer, {"weight": random_fp8(128, 128, gen), "weight_scale_inv": torch.ones(1, 1)}, "q")
    load(layer, {"weight": random_fp8(64, 128, gen), "weight_scale_inv": torch.ones(1, 1)}, "k")  # starts at 128
    with pytest.raises(ModelLoadError, match=r"v_proj: features \[192, 256\) .* packs 128 features per element"):
        load(layer, {"weight": random_fp8(64, 128, gen), "weight_scale_inv": torch.ones(1, 1)}, "v")


def test_per_tensor_scales_of_fused_parts_become_rows_of_a_per_channel_scale():
    """vLLM's FP8: one 0-d weight_scale (and, static, input_scale) per checkpoint tensor."""
    gen = torch.Generator().manual_seed(1)
    options = Fp8Method.options_from_checkpoint({"quant_method": "fp8", "activation_scheme": "static"})
    qkv = QKVParallelLinear(32, 8, 4, 2, ctx("fp8", options))
    parts = {sid: (random_fp8(rows, 32, gen), torch.tensor(0.5 + i)) for i, (sid, rows) in
             enumerate([("q", 32), ("k", 16), ("v", 16)])}
    for sid, (w, s) in parts.items():
        load(qkv, {"weight": w, "weight_scale": s, "input_scale": torch.tensor(9.0)}, sid)
    want = torch.cat([decode_fp8(w) * s.item() for w, s in parts.values()])
    assert finish(qkv).double().equal(want) and not hasattr(qkv, "input_scale")
    gate_up = MergedColumnParallelLinear(32, [24, 24], ctx("fp8", options, 1, 2))
    halves = [(random_fp8(24, 32, gen), torch.tensor(s)) for s in (0.25, 4.0)]
    for i, (w, s) in enumerate(halves):
        load(gate_up, {"weight": w, "weight_scale": s, "input_scale": torch.tensor(1.0)}, i)
    assert finish(gate_up).double().equal(torch.cat([decode_fp8(w[12:]) * s.item() for w, s in halves]))
    down = RowParallelLinear(32, 16, ctx("fp8", options, 1, 2))
    w = random_fp8(16, 32, gen)
    load(down, {"weight": w, "weight_scale": torch.tensor(2.0), "input_scale": torch.tensor(1.0)})
    assert finish(down).double().equal(decode_fp8(w[:, 16:]) * 2.0)


# ----- compressed-tensors, encoded and decoded by its own package -----


def ct_checkpoint(preset: str, weight: torch.Tensor):
    """(quantization_config dict, checkpoint tensors, the package's own dequantized weight) for a preset."""
    from compressed_tensors.compressors.naive_quantized.base import (FloatQuantizationCompressor,
                                                                     IntQuantizationCompressor)
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    if args.strategy == "channel":
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif args.strategy == "tensor":
        low, high = weight.min().reshape(1), weight.max().reshape(1)
    else:
        bn, bk = args.block_structure
        blocks = torch.nn.functional.pad(weight, (0, (-weight.shape[1]) % bk, 0, (-weight.shape[0]) % bn))
        blocks = blocks.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    scale, zero_point = calculate_qparams(low, high, args)
    compressor = IntQuantizationCompressor if args.type == "int" else FloatQuantizationCompressor
    tensors = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
    if scheme.input_activations is not None and not scheme.input_activations.dynamic:
        tensors["input_scale"] = torch.tensor([0.02])
    fmt = "int-quantized" if args.type == "int" else "float-quantized"
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"]).model_dump()
    config = json.loads(json.dumps(config, default=str))  # as config.json holds it
    return config, tensors, compressor.decompress(tensors, scheme)["weight"]


CT_PRESETS = [("W8A8", Int8Method), ("FP8_DYNAMIC", Fp8Method), ("FP8_BLOCK", Fp8Method), ("FP8", Fp8Method)]


@pytest.mark.parametrize("preset,cls", CT_PRESETS)
@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_compressed_tensors_checkpoints_dequantize_as_the_package_does(preset, cls, rank, world):
    gen = torch.Generator().manual_seed(2)
    config, tensors, want = ct_checkpoint(preset, torch.randn(256, 512, generator=gen))
    assert [c.claims(config) for c in (Fp8Method, Int8Method)] == [cls is Fp8Method, cls is Int8Method]
    options = cls.options_from_checkpoint(config)
    column = ColumnParallelLinear(512, 256, ctx(cls.name, options, rank, world))
    load(column, tensors)
    rows = slice(256 // world * rank, 256 // world * (rank + 1))
    assert finish(column).equal(want[rows])
    row = RowParallelLinear(512, 256, ctx(cls.name, options, rank, world))
    load(row, tensors)
    assert finish(row).equal(want[:, 512 // world * rank:512 // world * (rank + 1)])


def test_int8_scales_stored_in_16_bits_load_exactly():
    gen = torch.Generator().manual_seed(3)
    config, tensors, _ = ct_checkpoint("W8A8", torch.randn(64, 96, generator=gen))
    tensors["weight_scale"] = tensors["weight_scale"].bfloat16()  # as llm-compressor saves bfloat16 models
    layer = ColumnParallelLinear(96, 64, ctx("int8", Int8Method.options_from_checkpoint(config)))
    load(layer, tensors)
    assert finish(layer).equal(tensors["weight"].float() * tensors["weight_scale"].float())
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (64,)


def test_select_reads_both_formats_and_the_backends_preference():
    backend = SimpleNamespace(name="fake", quant_methods=lambda: {"unquantized", "fp8", "int8"},
                              quant_preferences=lambda m: {"act_quant": True} if m == "fp8" else {})
    spec = select_quantization(SimpleNamespace(quantization_config=BLOCK_FP8), None, backend)
    assert (spec.method, spec.options) == ("fp8", {"weight_block_size": [128, 128], "strategy": "block",
                                                   "format": "fp8", "static_input_scale": False, "act_quant": True})
    config = ct_checkpoint("W8A8", torch.randn(8, 8))[0]
    spec = select_quantization(SimpleNamespace(quantization_config=config), None, backend)
    assert (spec.method, spec.options, spec.ignored) == ("int8", {"strategy": "channel", "act_quant": True},
                                                         ("lm_head",))


# ----- quantize: round to nearest -----


def e4m3_half_step(v: torch.Tensor) -> torch.Tensor:
    """Half the distance between neighbouring e4m3 values around |v| (<= 448)."""
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6)))
    return 2.0 ** (exponent - 4)


@pytest.mark.parametrize("options", [{"weight_block_size": [128, 128]}, {}, {"strategy": "tensor"},
                                     {"format": "compressed-tensors"}])
def test_fp8_quantize_rounds_to_nearest_with_amax_over_448(options):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(200, 300, generator=gen) * torch.logspace(-4, 1, 300)  # columns across many binades
    w[:, 5] = 0
    method = Fp8Method(options)
    tensors = method.quantize(w)
    layer = ColumnParallelLinear(300, 200, ctx("fp8", options))
    assert {n: (t.dtype, t.shape) for n, t in tensors.items()} == {
        n: (p.dtype, p.shape) for n, p in layer.named_parameters()}
    scales = tensors.get("weight_scale_inv", tensors.get("weight_scale")).double()
    if options.get("weight_block_size"):
        padded = torch.nn.functional.pad(w.abs(), (0, 84, 0, 56)).unflatten(0, (2, 128)).unflatten(2, (3, 128))
        assert scales.equal((padded.amax((1, 3)) / 448).double())
        expanded = scales.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    elif options.get("strategy") == "tensor":
        assert scales.eq((w.abs().max() / 448).double()).all()
        expanded = scales[:, None]
    else:
        assert scales.reshape(-1).equal((w.abs().amax(1) / 448).double())
        expanded = scales.reshape(-1, 1)
    v = w.double() / expanded
    q = decode_fp8(tensors["weight"])
    assert ((q - v).abs() <= e4m3_half_step(v)).all()
    assert q.abs().max() == 448 and q[:, 5].eq(0).all()


def test_int8_quantize_rounds_to_nearest_with_amax_over_127():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 96, generator=gen)
    w[3] = 0
    tensors = Int8Method().quantize(w)
    scales = tensors["weight_scale"][:, 0]
    assert tensors["weight_scale"].shape == (64, 1) and tensors["weight"].dtype == torch.int8
    assert scales[3] == 1 and scales.equal(torch.where(w.abs().amax(1) > 0, w.abs().amax(1) / 127, 1.0))
    assert ((tensors["weight"].double() - w.double() / scales.double()[:, None]).abs() <= 0.5 + 1e-9).all()
    assert tensors["weight"].abs().amax(1)[torch.arange(64) != 3].eq(127).all()


# ----- activation quantization on and off -----


@pytest.mark.parametrize("block", [[128, 128], None])
def test_fp8_act_quant_multiplies_fp8_activations_per_token_group(block):
    gen = torch.Generator().manual_seed(6)
    w, x = torch.randn(64, 256, generator=gen) / 16, torch.randn(5, 256, generator=gen)
    x[2] = 0
    outs = {}
    for act_quant in (False, True):
        layer = ColumnParallelLinear(256, 64, ctx("fp8", {"weight_block_size": block, "act_quant": act_quant}))
        load(layer, Fp8Method({"weight_block_size": block}).quantize(w))
        dense = finish(layer).double()
        group = 128 if block else 256
        xg = x.double().unflatten(1, (-1, group))
        s = xg.abs().amax(-1, keepdim=True) / 448
        s = torch.where(s > 0, s, 1.0)
        x_used = (decode_fp8((xg / s).float().to(torch.float8_e4m3fn)) * s).flatten(1) if act_quant else x.double()
        outs[act_quant] = layer(x)
        torch.testing.assert_close(outs[act_quant].double(), x_used @ dense.T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outs[False], outs[True], rtol=1e-4, atol=0)


def test_int8_act_quant_multiplies_int8_activations_per_token():
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(48, 96, generator=gen), torch.randn(4, 96, generator=gen)
    outs = {}
    for act_quant in (False, True):
        layer = ColumnParallelLinear(96, 48, ctx("int8", {"act_quant": act_quant}))
        load(layer, Int8Method().quantize(w))
        dense = finish(layer).double()
        s = x.double().abs().amax(1, keepdim=True) / 127
        x_used = torch.round(x.double() / s).clamp(-127, 127) * s if act_quant else x.double()
        outs[act_quant] = layer(x)
        torch.testing.assert_close(outs[act_quant].double(), x_used @ dense.T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outs[False], outs[True], rtol=1e-4, atol=0)


def test_conformance_options_cover_blocks_channels_and_both_activation_modes():
    assert Fp8Method.conformance_options() == [
        {"weight_block_size": [128, 128], "act_quant": False}, {"weight_block_size": [128, 128], "act_quant": True},
        {"weight_block_size": None, "act_quant": False}, {"weight_block_size": None, "act_quant": True}]
    assert Int8Method.conformance_options() == [{"act_quant": True}, {"act_quant": False}]
    for cls in (Fp8Method, Int8Method):  # quantize() returns exactly what create_weights registers
        for options in cls.conformance_options():
            layer = torch.nn.Module()
            cls(options).create_weights(layer, 256, 40, torch.float32, torch.device("cpu"))
            tensors = cls(options).quantize(torch.randn(40, 256))
            assert {n: (t.dtype, t.shape) for n, t in tensors.items()} == {
                n: (p.dtype, p.shape) for n, p in layer.named_parameters()}


# ----- errors -----


def _ct(weights: dict, acts: dict | None = None, fmt: str = "int-quantized", **group) -> dict:
    base = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    act_base = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {**base, **weights},
        "input_activations": None if acts is None else {**act_base, **acts}, **group}}}


BAD = [
    (Fp8Method, {**BLOCK_FP8, "fmt": "e5m2"}, r"quantization_config.fmt is 'e5m2'; the fp8 method reads e4m3"),
    (Fp8Method, {**BLOCK_FP8, "weight_block_size": [128]}, r"weight_block_size is \[128\]; expected two positive"),
    (Fp8Method, {**BLOCK_FP8, "activation_scheme": "weird"}, r"activation_scheme is 'weird'"),
    (Int8Method, _ct({"symmetric": False}, {}), r"group_0.weights.symmetric is False; the int8 method reads True"),
    (Int8Method, _ct({"strategy": "group", "group_size": 128}, {}),
     r"group_0.weights.strategy is 'group'; the int8 method reads 'channel' or 'tensor'"),
    (Int8Method, _ct({}, {"dynamic": False, "strategy": "tensor"}),
     r"group_0.input_activations.dynamic is False: static activation scales are not supported"),
    (Int8Method, _ct({"num_bits": 4}, None), r"group_0.weights.num_bits is 4; the int8 method reads 8"),
    (Int8Method, _ct({}, {"symmetric": False}), r"input_activations.symmetric is False"),
    (Int8Method, _ct({}, {}, targets=["re:.*mlp.*"]), r"group_0.targets is \['re:.\*mlp.\*'\]; only \['Linear'\]"),
    (Fp8Method, _ct({"type": "float", "strategy": "group", "group_size": 32}, None, "float-quantized"),
     r"weights.strategy is 'group'; the fp8 method reads 'block' or 'channel' or 'tensor'"),
    (Fp8Method, _ct({"type": "float"}, {"type": "int"}, "float-quantized"),
     r"input_activations.type is 'int'; the fp8 method reads 'float'"),
]


@pytest.mark.parametrize("cls,config,message", BAD)
def test_unsupported_configs_name_the_field(cls, config, message):
    assert cls.claims(config)
    with pytest.raises(ChituError, match=message):
        cls.options_from_checkpoint(config)


def test_claims_keep_the_formats_apart():
    mixed = _ct({}, {})
    mixed["config_groups"]["group_1"] = {**mixed["config_groups"]["group_0"],
                                         "weights": {**mixed["config_groups"]["group_0"]["weights"], "type": "float"}}
    packed = _ct({"num_bits": 4, "group_size": 128, "strategy": "group"}, None, "pack-quantized")
    for config, fp8, int8 in [(BLOCK_FP8, True, False), (_ct({}, {}), False, True), (packed, False, False),
                              (mixed, False, False), ({"quant_method": "awq"}, False, False),
                              (_ct({"type": "float"}, None, "float-quantized"), True, False)]:
        assert (Fp8Method.claims(config), Int8Method.claims(config)) == (fp8, int8), config
    differing = _ct({}, {})
    differing["config_groups"]["group_1"] = {**differing["config_groups"]["group_0"], "input_activations": None}
    with pytest.raises(ChituError, match="group_1 quantizes differently from .*group_0"):
        Int8Method.options_from_checkpoint(differing)
