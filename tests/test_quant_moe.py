"""Routed MoE experts held in FP8 (contract 1.3): the ``fused_experts_fp8`` op, the fp8 method's expert
hooks, ``FusedMoE`` loading a DeepSeek-V3-style FP8 checkpoint, and in-situ ``--quantization fp8``.

The reference is checked against a float64 computation written out here (each e4m3 byte decoded by
the published bit layout, each weight times its block's or channel's scale, slot by slot); the CPU
op against the reference. Then the layer: checkpoint names, tensor-parallel slices of block scales,
the errors for sizes the blocks cannot split and for backends without the op, and whole tiny models
on the CPU: a DeepSeek-V2 whose experts are saved as DeepSeek-V3 FP8 (``weight`` e4m3 +
``weight_scale_inv`` per 128x128 block) against transformers on the dequantized weights, on one
tensor-parallel rank and two; and a Qwen3-MoE quantized in situ. The Triton kernels are in
test_triton_moe_fp8.py (they need the interpreter in a module of their own).
"""

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from chitu_core import LLM, SamplingParams
from chitu_core.errors import ModelLoadError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.moe import ExpertShard, FusedMoE, map_expert_weight
from chitu_core.ops import quant_reference, reference
from chitu_core.ops.table import resolve_ops
from chitu_core.quantization.fp8 import Fp8Method
from chitu_core.quantization.select import QuantSpec
from chitu_cpu.moe import fused_experts_fp8 as cpu_fused_experts_fp8
from test_communicator import free_port
from test_models import batched_last_logits
from test_quant_fp8_int8 import BLOCK_FP8, decode_fp8

REFERENCE_OPS = resolve_ops("reference", {})
CPU_OPS = resolve_ops("cpu", {"fused_experts_fp8": cpu_fused_experts_fp8})


def quantized_experts(gen: torch.Generator, experts: int, hidden: int, inter: int, block) -> tuple:
    """(w13, w13_scale, w2, w2_scale) of random experts quantized by the fp8 method (block or per channel)."""
    method = Fp8Method({"weight_block_size": list(block) if block else None})
    out = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        parts = [method.quantize(torch.randn(n, k, generator=gen) * k**-0.5) for _ in range(experts)]
        out += [torch.stack([p["weight"] for p in parts]), torch.stack([p[method.scale_name] for p in parts])]
    return tuple(out)


def dequantized(w: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float64 [E, N, K]: each byte decoded by the table, times scale[e, n // bn, k // bk] (or scale[e, n])."""
    e, n, k = w.shape
    if block is None:
        return decode_fp8(w) * scale.double()[:, :, None]
    rows, cols = torch.arange(n)[:, None] // block[0], torch.arange(k)[None, :] // block[1]
    return decode_fp8(w) * scale.double()[:, rows, cols]


def slot_by_slot(x, w13, w2, weights, ids) -> torch.Tensor:
    """The contract in float64, one token and slot at a time (w13, w2 dequantized float64)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0:
                h = w13[e] @ x[t].double()
                out[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def routing(gen, tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k]
    ids[0, 1], ids[-1] = -1, -1  # a slot and a whole token routed to no expert held here
    return torch.rand(tokens, top_k, generator=gen) + 0.1, ids


@pytest.mark.parametrize("block", [(32, 32), (16, 64), None], ids=["32x32", "16x64", "channel"])
def test_reference_is_the_dequantized_computation_slot_by_slot(block):
    gen = torch.Generator().manual_seed(1)
    w13, s13, w2, s2 = quantized_experts(gen, 6, 80, 40, block)  # 80 and 40: last blocks partial
    x = torch.randn(5, 80, generator=gen, dtype=torch.float64)
    weights, ids = routing(gen, 5, 6, 2)
    got = reference.fused_experts_fp8(x, w13, s13, w2, s2, block, weights, ids)
    want = slot_by_slot(x, dequantized(w13, s13, block), dequantized(w2, s2, block), weights, ids)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[-1], torch.zeros(80, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
def test_cpu_op_matches_the_reference(block, dtype):
    gen = torch.Generator().manual_seed(2)
    w13, s13, w2, s2 = quantized_experts(gen, 8, 96, 64, block)
    x = torch.randn(9, 96, generator=gen).to(dtype)
    weights, ids = routing(gen, 9, 8, 3)
    for activation in ("silu", "gelu"):
        got = cpu_fused_experts_fp8(x, w13, s13, w2, s2, block, weights, ids, activation)
        want = reference.fused_experts_fp8(x.double(), w13, s13, w2, s2, block, weights, ids, activation)
        assert got.dtype == dtype
        nmse = ((got.double() - want).square().sum() / want.square().sum()).item()
        assert nmse <= (1e-12 if dtype == torch.float32 else 1e-4), (activation, nmse)


# ----- the layer -----


def ctx(spec: QuantSpec, rank: int = 0, world: int = 1, ops=CPU_OPS) -> BuildContext:
    comm = SimpleNamespace(rank=rank, world_size=world, all_reduce=lambda x: x)
    return BuildContext(ops, None, comm, torch.float32, torch.device("cpu"), spec)


FP8_CHECKPOINT = QuantSpec("fp8", Fp8Method.options_from_checkpoint(BLOCK_FP8))


def test_checkpoint_names_map_onto_the_stacked_families():
    assert map_expert_weight("m.layers.1.mlp.experts.7.up_proj.weight") == ("m.layers.1.mlp.experts.w13", ExpertShard(7, "up"))
    assert map_expert_weight("m.layers.1.mlp.experts.7.down_proj.weight_scale_inv") == (
        "m.layers.1.mlp.experts.w2_weight_scale_inv", ExpertShard(7, "down"))
    assert map_expert_weight("m.layers.1.mlp.experts.0.gate_proj.weight_scale") == (
        "m.layers.1.mlp.experts.w13_weight_scale", ExpertShard(0, "gate"))
    assert map_expert_weight("m.layers.1.mlp.shared_experts.gate_proj.weight_scale_inv") is None
    layer = FusedMoE(4, 256, 256, ctx(FP8_CHECKPOINT), 2)
    assert {n: (p.dtype, tuple(p.shape)) for n, p in layer.named_parameters()} == {
        "w13": (torch.float8_e4m3fn, (4, 512, 256)), "w13_weight_scale_inv": (torch.float32, (4, 4, 2)),
        "w2": (torch.float8_e4m3fn, (4, 256, 256)), "w2_weight_scale_inv": (torch.float32, (4, 2, 2))}


@pytest.mark.parametrize("world", [1, 2])
def test_each_rank_loads_its_slice_of_every_expert_and_its_block_scales(world):
    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter, block = 3, 48, 64, (16, 16)
    spec = QuantSpec("fp8", {"weight_block_size": list(block)})
    method = Fp8Method(spec.options)
    tensors = {(e, p): method.quantize(torch.randn(*((hidden, inter) if p == "down" else (inter, hidden)), generator=gen))
               for e in range(experts) for p in ("gate", "up", "down")}
    for rank in range(world):
        layer = FusedMoE(experts, hidden, inter, ctx(spec, rank, world), 2)
        params = dict(layer.named_parameters())
        for (e, part), qt in tensors.items():
            family = "w2" if part == "down" else "w13"
            for key, t in qt.items():
                name = family if key == "weight" else f"{family}_{key}"
                params[name].weight_loader(params[name], t, ExpertShard(e, part))
        layer.process_weights_after_loading()
        local = inter // world
        for e in range(experts):
            full = {p: dequantized(qt["weight"][None], qt["weight_scale_inv"][None], block)[0]
                    for (ee, p), qt in tensors.items() if ee == e}
            rows = slice(rank * local, (rank + 1) * local)
            want13 = torch.cat([full["gate"][rows], full["up"][rows]])
            assert torch.equal(dequantized(layer.w13[e:e + 1], layer.w13_scale[e:e + 1], block)[0], want13)
            assert torch.equal(dequantized(layer.w2[e:e + 1], layer.w2_scale[e:e + 1], block)[0], full["down"][:, rows])


def test_block_scales_that_cannot_split_are_a_one_line_error():
    with pytest.raises(ModelLoadError, match=r"^fp8 MoE experts: 704 intermediate rows per rank \(moe intermediate size "
                                             r"1408 over 2 tensor-parallel rank\(s\)\) is not a multiple of the "
                                             r"checkpoint's 128x128 scale blocks.*--quantization fp8\)$"):
        FusedMoE(4, 256, 1408, ctx(FP8_CHECKPOINT, 1, 2), 2)
    with pytest.raises(ModelLoadError, match=r"^fp8 MoE experts: 96 intermediate rows per rank .* over 1 "):
        FusedMoE(4, 256, 96, ctx(FP8_CHECKPOINT), 2)
    in_situ = QuantSpec("fp8", {"weight_block_size": [128, 128]}, in_situ=True)
    assert FusedMoE(4, 256, 1408, ctx(in_situ, 1, 2), 2).w13.dtype == torch.float32  # quantized whole, after loading


def test_methods_and_backends_that_cannot_run_the_experts():
    int8 = QuantSpec("int8", {})
    with pytest.raises(ModelLoadError, match=r"^quantized MoE experts \('int8'\) are not supported yet"):
        FusedMoE(4, 64, 32, ctx(int8), 2)
    dense = FusedMoE(4, 64, 32, ctx(QuantSpec("int8", {}, in_situ=True)), 2)  # in-situ int8 keeps experts dense
    assert (dense.quant_method.name, dense.w13.dtype) == ("unquantized", torch.float32)
    ignored = QuantSpec("fp8", Fp8Method.options_from_checkpoint(BLOCK_FP8), ignored=("model.layers.1.mlp.experts",))
    assert FusedMoE(4, 64, 32, ctx(ignored), 2).w13.dtype == torch.float32
    shared_only = QuantSpec("fp8", Fp8Method.options_from_checkpoint(BLOCK_FP8), ignored=("*shared_experts*",))
    assert FusedMoE(4, 256, 128, ctx(shared_only), 2).w13.dtype == torch.float8_e4m3fn
    acme = resolve_ops("acme", {"linear": reference.linear})  # a backend written for 1.2: no fused_experts_fp8
    with pytest.raises(ModelLoadError, match=r"^backend 'acme' does not run fp8 MoE experts \(its op table lacks "
                                             r"fused_experts_fp8\); use another device, or an unquantized checkpoint$"):
        FusedMoE(4, 256, 128, ctx(FP8_CHECKPOINT, ops=acme), 2)
    assert FusedMoE(4, 256, 128, ctx(FP8_CHECKPOINT, ops=REFERENCE_OPS), 2).w13.dtype == torch.float8_e4m3fn


def test_in_situ_quantizes_each_expert_as_the_method_quantizes_a_weight():
    gen = torch.Generator().manual_seed(4)
    spec = QuantSpec("fp8", {"weight_block_size": [32, 32]}, in_situ=True)
    layer = FusedMoE(3, 48, 40, ctx(spec), 2)
    w13, w2 = torch.randn(3, 80, 48, generator=gen) / 7, torch.randn(3, 48, 40, generator=gen) / 6
    layer.w13.data.copy_(w13)
    layer.w2.data.copy_(w2)
    layer.process_weights_after_loading()
    method = Fp8Method({"weight_block_size": [32, 32]})
    for e in range(3):
        for family, dense in (("w13", w13[e]), ("w2", w2[e])):
            want = method.quantize(dense)
            assert torch.equal(getattr(layer, family)[e].view(torch.uint8), want["weight"].view(torch.uint8))
            assert torch.equal(getattr(layer, f"{family}_scale")[e], want["weight_scale_inv"])
    x, logits = torch.randn(4, 48, generator=gen), torch.randn(4, 3, generator=gen)
    want = reference.fused_experts_fp8(x.double(), layer.w13, layer.w13_scale, layer.w2, layer.w2_scale, (32, 32),
                                       *reference.moe_route(logits, 2))
    torch.testing.assert_close(layer(x, logits).double(), want, rtol=1e-5, atol=1e-6)


# ----- whole models -----

TINY_V2 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               max_position_embeddings=512, rms_norm_eps=1e-6, q_lora_rank=None, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, topk_method="greedy")
PROMPTS = [[1, 2, 3, 4, 5], [7] * 17, list(range(10, 43))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Everything but the routed experts stays float32 (the engine's FP8 linears have tests of their own),
# so that each rank's share of the 256-wide intermediate dimension is whole 128x128 blocks at TP 2 too.
KEPT_DENSE = ["lm_head", "model.embed_tokens", "*self_attn*", "*shared_experts*", "model.layers.0.mlp*", "*mlp.gate"]


def save_fp8_experts_checkpoint(path) -> object:
    """A random tiny DeepSeek-V2 saved with its routed experts in DeepSeek-V3's FP8 format; returns the
    transformers model holding the dequantized weights (float32, eval)."""
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tf.DeepseekV2Config(**TINY_V2), dtype=torch.float32).eval()
    with torch.no_grad():  # wide weights: logits far from ties
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.08)
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None
    state = load_file(path / "model.safetensors")
    method = Fp8Method(Fp8Method.options_from_checkpoint(BLOCK_FP8))
    experts = hf.model.layers[1].mlp.experts
    inter = TINY_V2["moe_intermediate_size"]
    with torch.no_grad():
        for e in range(TINY_V2["n_routed_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.1.mlp.experts.{e}.{proj}"
                qt = method.quantize(state.pop(f"{name}.weight"))
                state.update({f"{name}.{key}": t for key, t in qt.items()})
                dense = dequantized(qt["weight"][None], qt["weight_scale_inv"][None], (128, 128))[0].float()
                if proj == "down_proj":
                    experts.down_proj[e].copy_(dense)
                else:
                    experts.gate_up_proj[e, (0 if proj == "gate_proj" else inter):][:inter].copy_(dense)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {**BLOCK_FP8, "modules_to_not_convert": KEPT_DENSE}
    (path / "config.json").write_text(json.dumps(config))
    return hf


def load(path, **kwargs) -> LLM:
    return LLM(path, device="cpu", dtype="float32", load_progress=False, num_threads=1, **kwargs)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-v2-fp8-experts")
    return path, save_fp8_experts_checkpoint(path)


def test_deepseek_v3_style_fp8_experts_load_and_match_transformers_on_the_dequantized_weights(fp8_checkpoint):
    path, hf = fp8_checkpoint
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in load_file(path / "model.safetensors")
    llm = load(path)
    experts = llm.engine.model.model.layers[1].mlp.experts
    assert {n: (p.dtype, tuple(p.shape)) for n, p in experts.named_parameters()} == {
        "w13": (torch.float8_e4m3fn, (8, 512, 64)), "w13_scale": (torch.float32, (8, 4, 1)),
        "w2": (torch.float8_e4m3fn, (8, 64, 256)), "w2_scale": (torch.float32, (8, 1, 2))}
    assert llm.engine.model.model.layers[1].mlp.shared_experts.gate_up_proj.weight.dtype == torch.float32
    ours = batched_last_logits(llm, PROMPTS)
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    nmse = ((ours - want).square().sum() / want.square().sum()).item()
    assert nmse <= 1e-5, nmse
    for prompt, tokens in zip(PROMPTS, greedy(llm)):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref


def _tp_rank(rank: int, port: int, path: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    llm = load(path)
    experts = llm.engine.model.model.layers[1].mlp.experts
    queue.put((rank, greedy(llm), tuple(experts.w13.shape), tuple(experts.w2_scale.shape)))
    import torch.distributed as dist

    dist.destroy_process_group()


def test_two_tensor_parallel_ranks_give_the_tokens_of_one(fp8_checkpoint):
    path, _ = fp8_checkpoint
    one = greedy(load(path))
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_tp_rank, args=(free_port(), str(path), queue), nprocs=2, join=True)
    for rank, tokens, w13_shape, w2_scale_shape in sorted(queue.get() for _ in range(2)):
        assert (w13_shape, w2_scale_shape) == ((8, 256, 64), (8, 1, 1)), rank  # 128 rows of gate and of up each
        assert tokens == one, f"rank {rank}"


def test_in_situ_fp8_quantizes_the_experts_and_stays_near_the_float32_model(tmp_path):
    from test_moe_models import build_moe

    build_moe(tmp_path, "qwen3_moe")
    dense, fp8 = load(tmp_path), load(tmp_path, quantization="fp8")
    experts = fp8.engine.model.model.layers[1].mlp.experts
    assert (experts.w13.dtype, experts.w2.dtype, experts.w13_scale.dtype) == (torch.float8_e4m3fn,) * 2 + (torch.float32,)
    assert fp8.engine.model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    a, b = batched_last_logits(dense, PROMPTS), batched_last_logits(fp8, PROMPTS)
    nmse = ((b - a).square().sum() / a.square().sum()).item()
    # Each linear and expert in one 128x128 block: e4m3's relative rounding (2**-4 / sqrt(3) at most, ~1.3e-3
    # in mean square) over 3 layers' worth of products; measured 5.4e-3.
    assert 1e-4 <= nmse <= 2e-2, nmse
    hf_experts = build_moe(tmp_path / "again", "qwen3_moe").model.layers[1].mlp.experts  # the same weights
    method = Fp8Method({"weight_block_size": [128, 128]})
    for e in (0, 5):
        want = method.quantize(hf_experts.gate_up_proj[e].detach())  # gate and up quantized as one matrix
        assert torch.equal(experts.w13[e].view(torch.uint8), want["weight"].view(torch.uint8))
        assert torch.equal(experts.w13_scale[e], want["weight_scale_inv"])


def test_in_situ_fp8_deepseek_absorbs_its_dequantized_kv_b_proj(tmp_path):
    from test_deepseek import build_deepseek

    build_deepseek(tmp_path, "v2-lite")
    dense, fp8 = load(tmp_path), load(tmp_path, quantization="fp8")
    layers = fp8.engine.model.model.layers
    assert (layers[1].mlp.experts.w13.dtype, layers[0].self_attn.kv_b_proj.weight.dtype) == (torch.float8_e4m3fn,) * 2
    attn = layers[0].self_attn
    w = attn.kv_b_proj.quant.dequantize(attn.kv_b_proj).reshape(attn.num_heads, attn.nope + attn.v_dim, -1)
    assert torch.equal(attn.w_uk, w[:, : attn.nope]) and torch.equal(attn.w_uv, w[:, attn.nope:].transpose(1, 2))
    a, b = batched_last_logits(dense, PROMPTS), batched_last_logits(fp8, PROMPTS)
    nmse = ((b - a).square().sum() / a.square().sum()).item()
    assert 1e-5 <= nmse <= 2e-2, nmse  # as the Qwen3-MoE bound above
