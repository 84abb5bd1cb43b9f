"""4-bit weight-only methods: AWQ (AutoAWQ GEMM), GPTQ (v1/v2, act-order) and in-situ int4.

The checkpoint tensors here are packed by the test itself from the published layouts, word by word
with shifts and ors (AutoAWQ's WQLinear_GEMM.from_linear order_map [0, 2, 4, 6, 1, 3, 5, 7] along N;
AutoGPTQ's eight rows a word along K, zeros eight columns a word along N, v1 storing z - 1), and
decoded by the test's own loops: the methods' dequantized weights must equal those exactly. Then
RTN round trips (within half a step), loading through the real linear layers at tensor-parallel
sizes 1 and 2, in-situ int4, the errors bad configs get, and a tiny Llama saved as AWQ and GPTQ
checkpoints against transformers running the same dequantized weights.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from builders import build_model
from chitu_core import LLM, SamplingParams
from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from chitu_core.ops.table import resolve_ops
from chitu_core.quantization.awq import AWQMethod
from chitu_core.quantization.gptq import GPTQMethod
from chitu_core.quantization.select import IN_SITU, QuantSpec, select_quantization
from test_models import batched_last_logits

OPS = resolve_ops("reference", {})
AWQ_NIBBLE_COLUMNS = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ GEMM: nibble i of word c holds column 8c + this


# ----- the layouts, written out -----


def int32_word(nibbles) -> int:
    """Eight 4-bit values, nibble i in bits 4i..4i+3, as the signed int32 a checkpoint stores."""
    word = 0
    for i, v in enumerate(nibbles):
        assert 0 <= int(v) < 16
        word |= int(v) << (4 * i)
    return word - (1 << 32) if word >= 1 << 31 else word


def awq_pack(q) -> torch.Tensor:
    """[R, C] -> int32 [R, C/8], AutoAWQ's column order."""
    q = torch.as_tensor(q).tolist()
    return torch.tensor([[int32_word([row[8 * c + col] for col in AWQ_NIBBLE_COLUMNS]) for c in range(len(row) // 8)]
                         for row in q], dtype=torch.int32)


def gptq_pack_rows(q) -> torch.Tensor:
    """[K, N] -> int32 [K/8, N]: nibble j of word [i, n] is q[8i + j, n]."""
    q = torch.as_tensor(q).tolist()
    return torch.tensor([[int32_word([q[8 * i + j][n] for j in range(8)]) for n in range(len(q[0]))]
                         for i in range(len(q) // 8)], dtype=torch.int32)


def gptq_pack_columns(z) -> torch.Tensor:
    """[G, N] -> int32 [G, N/8]: nibble j of word [g, c] is z[g, 8c + j]."""
    z = torch.as_tensor(z).tolist()
    return torch.tensor([[int32_word(row[8 * c: 8 * c + 8]) for c in range(len(row) // 8)] for row in z],
                        dtype=torch.int32)


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> [..., W, 8]: nibble i of each word."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], -1)


def awq_decode(qweight, qzeros, scales) -> torch.Tensor:
    """W float64 [N, K] from AutoAWQ GEMM tensors."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    order = torch.tensor(AWQ_NIBBLE_COLUMNS)
    q = torch.empty(k, n, dtype=torch.int64)
    z = torch.empty(qzeros.shape[0], n, dtype=torch.int64)
    q.view(k, n // 8, 8)[:, :, order] = nibbles(qweight)
    z.view(-1, n // 8, 8)[:, :, order] = nibbles(qzeros)
    g = k // scales.shape[0]
    return ((q - z.repeat_interleave(g, 0)) * scales.double().repeat_interleave(g, 0)).T


def gptq_decode(qweight, qzeros, scales, g_idx, v1: bool) -> torch.Tensor:
    """W float64 [N, K] from GPTQ tensors: rows by g_idx, zeros + 1 in v1."""
    q = nibbles(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [K, N]
    z = nibbles(qzeros).reshape(qzeros.shape[0], -1) + int(v1)
    g = g_idx.long()
    return ((q - z[g]) * scales.double()[g]).T


def test_the_layouts_as_published():
    assert awq_pack([[1, 2, 3, 4, 5, 6, 7, 8]]).item() == 0x86427531 - (1 << 32)  # columns 0,2,4,6,1,3,5,7 low to high
    assert gptq_pack_rows([[v] for v in range(1, 9)]).item() == 0x87654321 - (1 << 32)
    assert gptq_pack_columns([[15, 0, 0, 0, 0, 0, 0, 1]]).item() == 0x1000000F


# ----- building layers -----


def ctx(method: str, options: dict, rank: int = 0, world: int = 1, in_situ: bool = False,
        dtype=torch.float32) -> BuildContext:
    comm = SimpleNamespace(rank=rank, world_size=world, all_reduce=lambda x: x)
    return BuildContext(OPS, None, comm, dtype, torch.device("cpu"), QuantSpec(method, options, in_situ))


def load(layer, tensors: dict, shard_id=None) -> None:
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        params[name].weight_loader(params[name], t, shard_id)


def processed(layer):
    layer.quant.process_weights_after_loading(layer)
    return layer


def hand_values(k: int, n: int, g: int, min_zero: int = 0):
    """Integer q [K, N], zeros [K/G, N] and float16 scales [K/G, N] that cover every nibble value."""
    q = [[(7 * kk + 3 * nn + kk * nn) % 16 for nn in range(n)] for kk in range(k)]
    z = [[min_zero + (5 * gg + nn) % (16 - min_zero) for nn in range(n)] for gg in range(k // g)]
    s = torch.tensor([[(1 + nn / 16) * 2.0 ** -((gg + nn) % 5) for nn in range(n)] for gg in range(k // g)],
                     dtype=torch.float16)
    return q, z, s


def expected(q, z, s, group_of) -> torch.Tensor:
    """W [N, K] float32, computed entry by entry: (q[k][n] - z[group(k)][n]) * s[group(k)][n]."""
    k, n = len(q), len(q[0])
    return torch.tensor([[(q[kk][nn] - z[group_of(kk)][nn]) * s[group_of(kk), nn].item() for kk in range(k)]
                         for nn in range(n)], dtype=torch.float32)


def check_apply(layer, w: torch.Tensor) -> None:
    x = torch.randn(3, 2, w.shape[1])
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)


# ----- hand-worked checkpoints -----


def test_awq_hand_worked_dequantizes_exactly():
    k, n, g = 32, 16, 8
    q, z, s = hand_values(k, n, g)
    layer = ColumnParallelLinear(k, n, ctx("awq", {"group_size": g, "zero_point": True}))
    load(layer, {"qweight": awq_pack(q), "qzeros": awq_pack(z), "scales": s})
    w = expected(q, z, s, lambda kk: kk // g)
    assert processed(layer).quant.dequantize(layer).equal(w)
    assert not hasattr(layer, "perm") and layer.qweight.shape == (k // 8, n) and layer.zeros.dtype == torch.float16
    check_apply(layer, w)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_hand_worked_v1_stores_zero_minus_one(fmt):
    k, n, g = 32, 16, 8
    q, z, s = hand_values(k, n, g, min_zero=1)
    stored = [[v - 1 for v in row] for row in z]
    tensors = {"qweight": gptq_pack_rows(q), "qzeros": gptq_pack_columns(stored), "scales": s,
               "g_idx": torch.arange(k, dtype=torch.int32) // g}
    layer = ColumnParallelLinear(k, n, ctx("gptq", {"group_size": g, "checkpoint_format": fmt}))
    load(layer, tensors)
    # The same words: v1 reads z = stored + 1, v2 reads z = stored.
    w = expected(q, z if fmt == "gptq" else stored, s, lambda kk: kk // g)
    assert processed(layer).quant.dequantize(layer).equal(w)
    check_apply(layer, w)


def act_order_checkpoint(k=32, n=16, g=8, g_idx=None):
    q, z, s = hand_values(k, n, g, min_zero=1)
    g_idx = g_idx if g_idx is not None else [(3 * kk) % (k // g) for kk in range(k)]  # every group 8 scattered rows
    tensors = {"qweight": gptq_pack_rows(q), "qzeros": gptq_pack_columns([[v - 1 for v in r] for r in z]),
               "scales": s, "g_idx": torch.tensor(g_idx, dtype=torch.int32)}
    return tensors, expected(q, z, s, lambda kk: g_idx[kk])


def test_gptq_act_order_sorts_features_by_group():
    tensors, w = act_order_checkpoint()
    layer = ColumnParallelLinear(32, 16, ctx("gptq", {"group_size": 8, "desc_act": True}))
    load(layer, tensors)
    assert processed(layer).quant.dequantize(layer).equal(w)
    g_idx = tensors["g_idx"].long()
    assert layer.perm.tolist() == sorted(range(32), key=lambda kk: (g_idx[kk].item(), kk))
    check_apply(layer, w)
    # Without desc_act g_idx is not read (vLLM's rule): the rows are taken as k // G.
    plain = ColumnParallelLinear(32, 16, ctx("gptq", {"group_size": 8}))
    load(plain, tensors)
    assert processed(plain).quant.dequantize(plain).equal(
        gptq_decode(tensors["qweight"], tensors["qzeros"], tensors["scales"], torch.arange(32) // 8, True).float())


def test_gptq_act_order_with_uneven_groups_is_an_error():
    g_idx = [0] * 9 + [1] * 7 + [2] * 8 + [3] * 8
    tensors, _ = act_order_checkpoint(g_idx=g_idx)
    layer = ColumnParallelLinear(32, 16, ctx("gptq", {"group_size": 8, "desc_act": True}))
    load(layer, tensors)
    with pytest.raises(ModelLoadError, match="puts 9 input features in group 0"):
        processed(layer)


def test_gptq_act_order_all_zero_g_idx_of_dummy_weights_loads():
    tensors, _ = act_order_checkpoint(g_idx=[0] * 32)
    layer = ColumnParallelLinear(32, 16, ctx("gptq", {"group_size": 8, "desc_act": True}))
    load(layer, tensors)
    assert not hasattr(processed(layer), "perm")


# ----- quantize: round to nearest, in each checkpoint layout -----


ALL_OPTIONS = ([(AWQMethod, o) for o in AWQMethod.conformance_options()]
               + [(GPTQMethod, o) for o in GPTQMethod.conformance_options()]
               + [(GPTQMethod, {"group_size": 64, "sym": False, "desc_act": True, "checkpoint_format": "gptq_v2"}),
                  (GPTQMethod, {"group_size": -1, "sym": False}), (AWQMethod, {"group_size": -1})])


def decode(cls, options, tensors) -> torch.Tensor:
    if cls is AWQMethod:
        return awq_decode(tensors["qweight"], tensors["qzeros"], tensors["scales"])
    v1 = options.get("checkpoint_format", "gptq") == "gptq"
    return gptq_decode(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], v1)


@pytest.mark.parametrize("cls,options", ALL_OPTIONS, ids=lambda v: getattr(v, "name", None) or str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_is_within_half_a_step_and_repacks_to_the_same_weight(cls, options, dtype):
    n, k = 48, 256
    w = (torch.randn(n, k) * torch.rand(n, 1)).to(dtype)
    w[0, :32] = 0  # an all-zero group
    w[1, :64] = w[1, :64].abs()  # groups with no negative value (GPTQ v1 cannot store a zero of 0)
    method = cls(options)
    tensors = method.quantize(w)
    layer = torch.nn.Module()
    method.create_weights(layer, k, n, dtype, torch.device("cpu"))
    params = dict(layer.named_parameters())
    assert {name: (t.shape, t.dtype) for name, t in tensors.items()} == {
        name: (p.shape, p.dtype) for name, p in params.items()}
    ours = decode(cls, options, tensors)  # the test's decoder
    g = k if options["group_size"] == -1 else options["group_size"]
    if cls is GPTQMethod:
        steps = tensors["scales"].double()[tensors["g_idx"].long()].T
        if options.get("desc_act") and g < k:
            assert not torch.equal(tensors["g_idx"].long(), torch.arange(k) // g)  # act-order is exercised
    else:
        steps = tensors["scales"].double().repeat_interleave(g, 0).T
    assert ((ours - w.double()).abs() <= steps / 2).all()
    assert (ours[0, :32] == 0).all()
    for name, t in tensors.items():
        params[name].data.copy_(t)
    method.process_weights_after_loading(layer)
    assert method.dequantize(layer).equal(ours.float())


def test_quantize_keeps_the_weight_device():
    weight = torch.empty(64, 256, dtype=torch.bfloat16, device="meta")  # a device without data: no hidden CPU tensor
    for method in (AWQMethod({"group_size": 128}, in_situ=True), GPTQMethod({"desc_act": True})):
        assert {t.device.type for t in method.quantize(weight).values()} == {"meta"}


# ----- through the real layers, at tensor-parallel sizes 1 and 2 -----


CHECKPOINTS = [("awq", {"group_size": 32, "zero_point": True}), ("awq", {"group_size": 32, "zero_point": False}),
               ("gptq", {"group_size": 32, "sym": False}), ("gptq", {"group_size": 32, "sym": False, "desc_act": True})]


def quantized(method: str, options: dict, n: int, k: int, seed: int):
    """(checkpoint tensors, their weight decoded by the test) of a random [n, k] weight."""
    cls = AWQMethod if method == "awq" else GPTQMethod
    tensors = cls(options).quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return tensors, decode(cls, options, tensors).float()


def quantize_together(cls, options, linears: list) -> list[dict]:
    """Checkpoint tensors of linears that share their input (q, k, v; gate, up), quantized as one weight
    and split along N: with act-order they then share g_idx, as GPTQ's shared Hessian makes them."""
    sizes = [m.weight.shape[0] for m in linears]
    whole = cls(options).quantize(torch.cat([m.weight for m in linears]))
    parts = [{} for _ in linears]
    for key, t in whole.items():
        if key == "g_idx":
            chunks = [t.clone() for _ in linears]
        else:
            chunks = t.split([size * t.shape[1] // sum(sizes) for size in sizes], dim=1)
        for part, chunk in zip(parts, chunks):
            part[key] = chunk.contiguous()
    return parts


E2E = [("awq", {"group_size": 32, "zero_point": True}, {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                         "zero_point": True, "version": "gemm"}),
       ("gptq", {"group_size": 32, "sym": False, "desc_act": True},
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True,
         "checkpoint_format": "gptq"})]


@pytest.mark.parametrize("method,options", CHECKPOINTS, ids=str)
@pytest.mark.parametrize("world", [1, 2])
def test_column_and_merged_layers_load_their_slices(method, options, world):
    k = 64
    tensors, w = quantized(method, options, 32, k, 0)
    cls = AWQMethod if method == "awq" else GPTQMethod
    gen = torch.Generator().manual_seed(1)
    linears = [SimpleNamespace(weight=torch.randn(n, k, generator=gen)) for n in (32, 48)]
    gate, up = quantize_together(cls, options, linears)  # act-order: the parts share g_idx (GPTQ's shared input)
    w_gate, w_up = (decode(cls, options, t).float() for t in (gate, up))
    for rank in range(world):
        column = ColumnParallelLinear(k, 32, ctx(method, options, rank, world))
        load(column, tensors)
        rows = slice(rank * 32 // world, (rank + 1) * 32 // world)
        assert processed(column).quant.dequantize(column).equal(w[rows])
        check_apply(column, w[rows])
        merged = MergedColumnParallelLinear(k, [32, 48], ctx(method, options, rank, world))
        load(merged, gate, 0)
        load(merged, up, 1)
        want = torch.cat([w_gate[rank * 32 // world: (rank + 1) * 32 // world],
                          w_up[rank * 48 // world: (rank + 1) * 48 // world]])
        assert processed(merged).quant.dequantize(merged).equal(want)
        check_apply(merged, want)


@pytest.mark.parametrize("method,options", CHECKPOINTS[:3], ids=str)
@pytest.mark.parametrize("world", [1, 2])
def test_row_layer_loads_its_input_slice_and_partial_outputs_sum(method, options, world):
    k, n = 128, 40
    tensors, w = quantized(method, options, n, k, 3)
    x = torch.randn(5, k)
    total = torch.zeros(5, n)
    for rank in range(world):
        layer = RowParallelLinear(k, n, ctx(method, options, rank, world))
        load(layer, tensors)
        cols = slice(rank * k // world, (rank + 1) * k // world)
        assert processed(layer).quant.dequantize(layer).equal(w[:, cols])
        total += layer(x[:, cols])
    torch.testing.assert_close(total, x @ w.T, rtol=1e-5, atol=1e-5)


def test_act_order_cannot_split_the_input_features():
    options = {"group_size": 32, "desc_act": True}
    RowParallelLinear(128, 40, ctx("gptq", options))  # one rank: fine
    with pytest.raises(ChituError, match="act-order.*tensor-parallel size 2"):
        RowParallelLinear(128, 40, ctx("gptq", options, 0, 2))


# ----- in situ (--quantization int4) -----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_situ_int4_quantizes_a_dense_weight_at_load(dtype):
    backend = SimpleNamespace(name="fake", quant_methods=lambda: {"unquantized", "awq"}, quant_preferences=lambda m: {})
    spec = select_quantization(SimpleNamespace(), "int4", backend)
    assert (spec.method, spec.options, spec.in_situ) == ("awq", {"group_size": 128, "zero_point": True}, True)
    assert IN_SITU["int4"][0] == "awq"
    k, n = 256, 64
    w = torch.randn(n, k).to(dtype)
    ctx_ = BuildContext(OPS, None, SimpleNamespace(rank=0, world_size=1), dtype, torch.device("cpu"), spec)
    layer = ColumnParallelLinear(k, n, ctx_)
    assert [name for name, _ in layer.named_parameters()] == ["weight"]
    load(layer, {"weight": w})
    processed(layer)
    assert {name: (tuple(p.shape), p.dtype) for name, p in layer.named_parameters()} == {
        "qweight": ((k // 8, n), torch.int32), "scales": ((2, n), torch.float16), "zeros": ((2, n), torch.float16)}
    got = layer.quant.dequantize(layer)
    steps = layer.scales.float().repeat_interleave(128, 0).T
    assert ((got - w.float()).abs() <= steps / 2).all()
    x = torch.randn(3, k).to(dtype)
    torch.testing.assert_close(layer(x).float(), (x.float() @ got.T), rtol=2e-2, atol=2e-2)


# ----- errors -----


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False}


def test_checkpoint_configs_become_options():
    assert AWQMethod.claims(AWQ_CONFIG) and not GPTQMethod.claims(AWQ_CONFIG)
    assert AWQMethod.options_from_checkpoint(AWQ_CONFIG) == {"group_size": 128, "zero_point": True}
    assert AWQMethod.options_from_checkpoint({"w_bit": 4, "q_group_size": 64, "zero_point": False}) == {
        "group_size": 64, "zero_point": False}  # AutoAWQ's own quant_config.json names
    assert GPTQMethod.options_from_checkpoint(GPTQ_CONFIG) == {
        "group_size": 128, "desc_act": True, "sym": False, "checkpoint_format": "gptq"}
    v2 = GPTQMethod.options_from_checkpoint({**GPTQ_CONFIG, "checkpoint_format": "gptq_v2", "group_size": -1})
    assert (v2["checkpoint_format"], v2["group_size"]) == ("gptq_v2", -1)


@pytest.mark.parametrize("cls,config,message", [
    (AWQMethod, {**AWQ_CONFIG, "version": "gemv"}, "version 'gemv' is not supported"),
    (AWQMethod, {**AWQ_CONFIG, "version": "marlin"}, "version 'marlin' is not supported"),
    (AWQMethod, {**AWQ_CONFIG, "version": "exllama"}, "version 'exllama' is not supported"),
    (AWQMethod, {**AWQ_CONFIG, "bits": 8}, "bits 8 is not supported"),
    (AWQMethod, {**AWQ_CONFIG, "group_size": 100}, "group_size 100 is not -1 or a positive multiple of 8"),
    (AWQMethod, {**AWQ_CONFIG, "zero_point": "yes"}, "zero_point 'yes' is not true or false"),
    (GPTQMethod, {**GPTQ_CONFIG, "bits": 3}, "bits 3 is not supported"),
    (GPTQMethod, {**GPTQ_CONFIG, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    (GPTQMethod, {**GPTQ_CONFIG, "is_marlin_format": True}, "is_marlin_format"),
    (GPTQMethod, {**GPTQ_CONFIG, "desc_act": "no"}, "desc_act 'no' is not true or false"),
])
def test_bad_configs_name_the_field_and_value(cls, config, message):
    with pytest.raises(ChituError, match=message):
        cls.options_from_checkpoint(config)


def test_layer_shapes_that_do_not_fit_are_errors():
    with pytest.raises(ChituError, match="96 input features .* groups of 64"):
        ColumnParallelLinear(96, 16, ctx("awq", {"group_size": 64}))
    with pytest.raises(ChituError, match="12 output features .* not a multiple of 8"):
        ColumnParallelLinear(64, 12, ctx("gptq", {"group_size": 32}))
    with pytest.raises(ChituError, match="input features .* groups of 64"):  # a row split that cuts a group
        RowParallelLinear(192, 16, ctx("gptq", {"group_size": 64}, 0, 2))


# ----- a tiny Llama as AWQ and GPTQ checkpoints, end to end -----


FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
         ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


@pytest.mark.parametrize("method,options,config", E2E, ids=[e[0] for e in E2E])
def test_tiny_llama_checkpoint_matches_transformers_on_the_dequantized_weights(method, options, config, tmp_path,
                                                                              monkeypatch):
    hf = _int4_checkpoint(method, options, config, tmp_path, monkeypatch)
    llm = LLM(tmp_path, device="cpu", dtype="float32", load_progress=False)
    assert llm.engine.quant.method == method
    prompts = [[1, 2, 3, 4, 5], list(range(10, 43))]
    ours = batched_last_logits(llm, prompts)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert (ours - ref).abs().max().item() <= 1e-4
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], greedy)
    gen = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert out[0].outputs[0].token_ids == gen[0, len(prompts[0]):].tolist()


def _int4_checkpoint(method, options, config, tmp_path, monkeypatch):
    """A tiny Llama saved as a ``method`` checkpoint in tmp_path (every linear of its blocks quantized), the
    CPU backend set to run it on the method's own ops; the transformers model on the dequantized weights."""
    from chitu_cpu.backend import CpuBackend

    monkeypatch.setattr(CpuBackend, "quant_methods", lambda self: frozenset({"unquantized", "awq", "gptq"}))
    # The checkpoint layout read exactly, on the method's own ops: the CPU backend's packed kernel (bfloat16
    # products) is held to its own bound in tests/test_cpu_packed.py.
    monkeypatch.setattr(CpuBackend, "pack_linear", lambda self, method, layer, dtype: None)
    hf = build_model(tmp_path, "llama")
    cls = AWQMethod if method == "awq" else GPTQMethod
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    with torch.no_grad():
        for i, block in enumerate(hf.model.layers):
            for owner, names in FUSED:
                linears = [getattr(getattr(block, owner), name) for name in names]
                for name, linear, tensors in zip(names, linears, quantize_together(cls, options, linears)):
                    prefix = f"model.layers.{i}.{owner}.{name}"
                    del state[f"{prefix}.weight"]
                    state.update({f"{prefix}.{key}": t for key, t in tensors.items()})
                    linear.weight.copy_(decode(cls, options, tensors).float())
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf_config, "quantization_config": config}))
    return hf
