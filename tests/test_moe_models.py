"""MoE architectures (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on the same random weights.

Each tiny config keeps its family's structure: Mixtral top-2 of 4 experts, renormalised; Qwen2-MoE
top-2 of 8 with a shared expert and a dense layer (mlp_only_layers); Qwen3-MoE top-4 of 8, normalised,
q/k norm, every second layer sparse (decoder_sparse_step). transformers' save_pretrained writes one
checkpoint tensor per expert and projection, which our loader stacks.

float32 on CPU: last-token logits of one batched prefill within NMSE 1e-5 of transformers, and 64-token
greedy continuations identical. Then: a request's greedy tokens are the same alone and in a batch of
16, and the same on two tensor-parallel ranks (gloo) as on one.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from chitu_core import LLM, SamplingParams
from chitu_core.errors import ModelLoadError
from test_communicator import free_port
from test_models import batched_last_logits

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5)
PROMPTS = [[1, 2, 3, 4, 5], [7] * 17, list(range(10, 43)), [300, 200, 100], list(range(100, 160, 3))]
NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
NMSE_LIMIT = 1e-5


def config_for(arch: str):
    import transformers as tf

    if arch == "mixtral":
        return tf.MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **TINY)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                 num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], **TINY)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=2, **TINY)
    raise ValueError(arch)


def build_moe(path, arch: str, seed: int = 0):
    """A random-weight transformers model of ``arch`` saved to ``path``; returns it (float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_for(arch), dtype=torch.float32).eval()
    with torch.no_grad():  # wide weights, as tests/builders.py: logits far from ties
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model


def load(path) -> LLM:
    # One host thread: these tiny GEMMs gain nothing from more, and on a busy machine threads that
    # wait for each other make every step milliseconds slower.
    return LLM(path, device="cpu", dtype="float32", load_progress=False, num_threads=1)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_moe(path, request.param)
    return request.param, hf, load(path)


def test_checkpoint_has_one_tensor_per_expert_and_loads_into_stacked_experts(pair):
    arch, hf, llm = pair
    assert type(llm.engine.model).__name__ == hf.config.architectures[0]
    params = dict(llm.engine.model.named_parameters())
    sparse = [n for n in params if n.endswith(".experts.w13")]
    assert sparse == {"mixtral": ["model.layers.0.mlp.experts.w13", "model.layers.1.mlp.experts.w13",
                                  "model.layers.2.mlp.experts.w13"],
                      "qwen2_moe": ["model.layers.0.mlp.experts.w13", "model.layers.2.mlp.experts.w13"],
                      "qwen3_moe": ["model.layers.1.mlp.experts.w13"]}[arch]
    ref = hf.model.layers[int(sparse[0].split(".")[2])].mlp.experts  # [E, 2I, H] and [E, H, I] in transformers 5 too
    assert torch.equal(params[sparse[0]], ref.gate_up_proj)
    assert torch.equal(params[sparse[0].replace("w13", "w2")], ref.down_proj)


def test_last_token_logits_match_transformers(pair):
    arch, hf, llm = pair
    ours = batched_last_logits(llm, PROMPTS)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    assert ours.shape == ref.shape == (len(PROMPTS), hf.config.vocab_size)
    nmse = ((ours - ref).pow(2).sum() / ref.pow(2).sum()).item()
    print(f"{arch}: last-token logits NMSE {nmse:.3g}")
    assert nmse <= NMSE_LIMIT, f"{arch}: NMSE {nmse:.3g}"


def test_greedy_continuations_match_transformers(pair):
    arch, hf, llm = pair
    prompts = PROMPTS[:3]
    for prompt, ours in zip(prompts, greedy(llm, prompts)):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == ref, f"{arch}: prompt of {len(prompt)} tokens"
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks


def test_every_expert_projection_must_be_in_the_checkpoint_and_in_range(tmp_path):
    build_moe(tmp_path, "mixtral")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    up = "model.layers.2.block_sparse_moe.experts.3.w3.weight"
    save_file({k: v for k, v in tensors.items() if k != up}, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor\(s\) the model needs: model\.layers\.2\.mlp\.experts\.w13 "
                                             r"\[ExpertShard\(expert=3, part='up'\)\]$"):
        load(tmp_path)
    extra = "model.layers.0.block_sparse_moe.experts.4.w2.weight"
    save_file({**tensors, extra: tensors[up.replace("w3", "w2")].clone()}, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"tensor '{extra}': expert 4 is out of range: config.json gives 4 experts"):
        load(tmp_path)


def test_a_request_alone_and_in_a_batch_of_16_gets_the_same_tokens(tmp_path):
    build_moe(tmp_path, "qwen2_moe", seed=1)
    llm = load(tmp_path)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(1 + 5 * i % 37)] for i in range(16)]
    assert len({len(p) for p in prompts}) > 8
    batched = greedy(llm, prompts)
    for i in (0, 7, 15):
        assert greedy(llm, [prompts[i]]) == [batched[i]], f"prompt {i}"


def _tp_rank(rank: int, port: int, path: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    llm = load(path)
    tokens = greedy(llm, PROMPTS[:3])
    queue.put((rank, tokens, llm.engine.model.model.layers[0].mlp.experts.w13.shape))
    import torch.distributed as dist

    dist.destroy_process_group()


def test_two_tensor_parallel_ranks_match_one(tmp_path):
    build_moe(tmp_path, "qwen2_moe", seed=2)
    one = greedy(load(tmp_path), PROMPTS[:3])
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_tp_rank, args=(free_port(), str(tmp_path), queue), nprocs=2, join=True)
    results = sorted(queue.get() for _ in range(2))
    for rank, tokens, w13_shape in results:
        assert w13_shape == (8, 2 * 32 // 2, 64), rank  # each expert's intermediate split over 2 ranks
        assert tokens == one, f"rank {rank}"
