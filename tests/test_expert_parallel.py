"""Expert parallelism on CPU with gloo: two tensor-parallel ranks that each hold half of the routed
experts whole give the same fp32 greedy tokens as one process (Qwen2-MoE with a gated shared expert,
Mixtral, DeepSeek-V3 with grouped sigmoid routing), loading from safetensors checkpoints and with
dummy weights; each rank holds exactly its experts."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chitu_core import LLM, SamplingParams
from test_communicator import free_port
from test_deepseek import build_deepseek
from test_moe_models import build_moe

PROMPTS = [[1, 2, 3, 4, 5], [7] * 17, list(range(10, 43))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MODELS = {"qwen2_moe": 8, "mixtral": 4, "v3": 8}  # name: routed experts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    build_moe(root / "qwen2_moe", "qwen2_moe", seed=3)
    build_moe(root / "mixtral", "mixtral", seed=4)
    build_deepseek(root / "v3", "v3", seed=5)
    return root


def run(path, **kwargs) -> tuple[list, list]:
    llm = LLM(str(path), device="cpu", dtype="float32", load_progress=False, num_threads=1, **kwargs)
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    moe = next(m for m in llm.engine.model.modules() if type(m).__name__ == "FusedMoE")
    return tokens, [moe.first_expert, moe.local_experts, tuple(moe.w13.shape)]


def _rank(rank: int, port: int, root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    try:
        got = {name: run(os.path.join(root, name), enable_expert_parallel=True) for name in MODELS}
        got["dummy"] = run(os.path.join(root, "qwen2_moe"), enable_expert_parallel=True, load_format="dummy")
        queue.put((rank, got))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_expert_parallel_ranks_match_one(models):
    one = {name: run(models / name) for name in MODELS}
    one["dummy"] = run(models / "qwen2_moe", load_format="dummy")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(free_port(), str(models), queue), nprocs=2, join=True)
    ranks = dict(queue.get() for _ in range(2))
    # Dummy weights are drawn per rank and shape, so they differ from one process's: the ranks agree.
    assert ranks[0]["dummy"][0] == ranks[1]["dummy"][0]
    for name in (*MODELS, "dummy"):
        tokens, (first, local, shape) = one[name]
        assert (first, local) == (0, shape[0])
        for rank, got in ranks.items():
            ep_tokens, (ep_first, ep_local, ep_shape) = got[name]
            assert name == "dummy" or ep_tokens == tokens, f"{name}: rank {rank}"
            experts = MODELS.get(name, 8)
            assert (ep_first, ep_local) == (rank * experts // 2, experts // 2), name
            assert ep_shape == (experts // 2, *shape[1:]), name  # whole experts: the full intermediate size
