"""DeepSeek-V2 / V3 (multi-head latent attention, routed + shared experts) against transformers on the
same random weights, float32 on CPU.

Configs, tiny but of each kind: V2-Lite-like (no q LoRA, greedy softmax routing, one dense layer then
MoE, YaRN with mscale == mscale_all_dim), V2-like (q LoRA, group-limited greedy, attention biases),
V3-like (q LoRA, sigmoid routing with a random e_score_correction_bias, groups scored by their top-2
sum, renormalised and scaled, YaRN whose mscale differs from mscale_all_dim), and a dense V3 with
rope_interleave false (rotate-half pairs). Each: last-token logits NMSE <= 1e-5 after one batched
prefill, 64-token greedy continuations equal to transformers' generate; one request alone decodes as it
does in a batch of 16 mixed-length prompts; two tensor-parallel ranks (gloo) give what one does.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers as tf

from chitu_core import LLM, SamplingParams
from chitu_core.attention.mla import MLAAttentionBackend
from chitu_core.layers.rotary import yarn_mscale
from test_models import batched_last_logits

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32, beta_slow=1)

CONFIGS = {
    "v2-lite": lambda: tf.DeepseekV2Config(
        q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="greedy", rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707), **SMALL),
    "v2": lambda: tf.DeepseekV2Config(
        q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0, attention_bias=True,
        **SMALL),
    "v3": lambda: tf.DeepseekV3Config(
        q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.8), **SMALL),
    "v3-dense-neox": lambda: tf.DeepseekV3Config(
        q_lora_rank=48, first_k_dense_replace=SMALL["num_hidden_layers"], rope_interleave=False,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, **SMALL),
}
PROMPTS = [[1, 2, 3, 4, 5], [7] * 17, list(range(10, 43)), [300, 200, 100], list(range(100, 160, 3))]
NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
TP_PROMPTS, TP_GREEDY = PROMPTS[:3], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def build_deepseek(path, name: str, seed: int = 0):
    """A random-weight transformers model of CONFIGS[name], saved to ``path``; returns it (eval)."""
    config = CONFIGS[name]()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # wide weights: logits far from ties (as tests/builders.py)
        for pname, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in pname else p.normal_(0.0, 0.08)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)  # enough to change which experts are chosen
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # our greedy runs ignore EOS; so does transformers' then
    return model


_BUILT: dict[str, tuple] = {}


def built(name: str, tmp_path_factory) -> tuple:
    """(name, path, transformers model, our LLM) of CONFIGS[name], built once per module."""
    if name not in _BUILT:
        path = tmp_path_factory.mktemp(name)
        hf = build_deepseek(path, name)
        _BUILT[name] = name, path, hf, LLM(path, device="cpu", dtype="float32", load_progress=False, num_threads=1)
    return _BUILT[name]


@pytest.fixture(params=list(CONFIGS))
def pair(request, tmp_path_factory):
    return built(request.param, tmp_path_factory)


@pytest.fixture
def v3(tmp_path_factory):
    return built("v3", tmp_path_factory)


def test_served_by_the_plugin_on_latent_attention(pair):
    name, _, hf, llm = pair
    assert type(llm.engine.model).__name__ == hf.config.architectures[0]
    assert type(llm.engine.model).__module__ == "chitu_models.deepseek"
    attention = llm.engine.attention
    assert isinstance(attention, MLAAttentionBackend)
    assert (attention.num_heads, attention.kv_lora_rank, attention.rope_dim) == (4, 32, 8)
    scale = llm.engine.model.model.layers[0].self_attn.scale
    assert scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    if name == "v3":
        assert scale == pytest.approx(24**-0.5 * yarn_mscale(4.0, 0.8) ** 2)


def test_last_token_logits_match_transformers(pair):
    name, _, hf, llm = pair
    ours = batched_last_logits(llm, PROMPTS)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    nmse = ((ours - ref).square().sum() / ref.square().sum()).item()
    print(f"{name}: last-token logits NMSE {nmse:.2e}, max abs {(ours - ref).abs().max().item():.2e}")
    assert nmse <= 1e-5, f"{name}: NMSE {nmse:.3g}"
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks


def largest_change_without(llm, modules, flag: str) -> float:
    """The largest change of PROMPTS' last-token logits when ``flag`` (a path each module takes while it is
    true) is turned off on every module; it is turned back on after."""
    taken = batched_last_logits(llm, PROMPTS)
    for m in modules:
        setattr(m, flag, False)
    try:
        return (taken - batched_last_logits(llm, PROMPTS)).abs().max().item()
    finally:
        for m in modules:
            setattr(m, flag, True)


def test_latent_attention_takes_mla_inputs_and_agrees_without_it(pair):
    """The CPU backend serves contract 1.10's mla_inputs, so the comparisons with transformers judge that path;
    the rotary, product, norm and concatenations it replaces (a backend without it) give the same logits."""
    name, _, _, llm = pair
    attns = [layer.self_attn for layer in llm.engine.model.model.layers]
    assert all(a.fused_inputs and a.fusion_max_tokens is None for a in attns)
    assert largest_change_without(llm, attns, "fused_inputs") <= 1e-5, name


def test_latent_attention_takes_the_decode_step_fusions_and_agrees_without_them(pair):
    """On one rank with dense weights the query's first projection and kv_a_proj_with_mqa become views of one
    matrix (biases too, V2's), so the CPU backend's layers run the input norm in that product's prologue and
    the residual add in o_proj's epilogue (contract 1.9), and MoE layers add the residual in their shared
    experts' down product; the unfused layers give the same logits."""
    name, _, _, llm = pair
    layers = llm.engine.model.model.layers
    for layer in layers:
        attn = layer.self_attn
        first = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
        rows = first.weight.shape[0]
        assert first.weight.data_ptr() == attn.input_weight.data_ptr(), name
        assert attn.kv_a_proj_with_mqa.weight.data_ptr() == attn.input_weight[rows:].data_ptr(), name
        assert (attn.input_bias is not None) == (name == "v2"), name
        assert layer.takes_fusions(len(PROMPTS[2])), name
    moe = [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]
    assert all(m.fuses() for m in moe if m.shared_experts is not None), name  # shared experts: fused path
    assert largest_change_without(llm, layers, "fusions") <= 1e-5, name


def test_greedy_continuations_match_transformers(pair):
    name, _, hf, llm = pair
    prompts = PROMPTS[1:3]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, f"{name}: prompt {prompt[:5]}..."


def test_a_request_decodes_alike_alone_and_in_a_batch_of_16(v3):
    name, _, _, llm = v3
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 40, (16,), generator=generator)]
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for i in (0, 7, 15):
        alone = llm.generate([{"prompt_token_ids": prompts[i]}], GREEDY)[0]
        assert alone.outputs[0].token_ids == batched[i].outputs[0].token_ids, f"{name}: prompt {i}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_run(rank: int, port: int, path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    try:
        llm = LLM(path, device="cpu", dtype="float32", load_progress=False, num_threads=1)  # one core per rank
        logits = batched_last_logits(llm, PROMPTS)
        tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in TP_PROMPTS], TP_GREEDY)]
        if rank == 0:
            torch.save({"logits": logits, "tokens": tokens, "heads": llm.engine.attention.num_heads}, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_tensor_parallel_ranks_match_one(v3, tmp_path):
    _, path, _, one = v3
    logits = batched_last_logits(one, PROMPTS)
    tokens = [o.outputs[0].token_ids for o in one.generate([{"prompt_token_ids": p} for p in TP_PROMPTS], TP_GREEDY)]
    mp.spawn(_rank_run, args=(_free_port(), str(path), str(tmp_path / "tp2.pt")), nprocs=2, join=True)
    two = torch.load(tmp_path / "tp2.pt")
    assert two["heads"] == 2
    torch.testing.assert_close(two["logits"], logits, rtol=0, atol=1e-4)
    assert two["tokens"] == tokens


def test_the_router_stays_float32_in_a_bfloat16_model(v3):
    """As DeepSeek's reference code and transformers (``_keep_in_fp32_modules_strict``): the gate's
    weight keeps the checkpoint's float32 values in a bfloat16 model, and its logits are float32."""
    _, path, hf, _ = v3
    llm = LLM(path, device="cpu", dtype="bfloat16", load_progress=False, num_threads=1)
    layer = next(i for i, l in enumerate(hf.model.layers) if hasattr(l.mlp, "gate"))
    ours = llm.engine.model.model.layers[layer].mlp.gate
    assert ours.weight.dtype == torch.float32
    assert torch.equal(ours.weight, hf.model.layers[layer].mlp.gate.weight.detach())
    x = torch.randn(3, hf.config.hidden_size, dtype=torch.bfloat16)
    assert ours(x).dtype == torch.float32
