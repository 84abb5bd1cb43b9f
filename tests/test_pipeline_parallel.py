"""Pipeline parallelism on CPU with gloo: two stages, and two stages of two tensor-parallel ranks,
give the same fp32 greedy tokens (and logprobs) as one process, on dense, tied and MoE configs, with
chunked prefill, several sequences and uneven stages; the layer split and the skipped weights."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chitu_core import LLM, SamplingParams
from chitu_core.errors import ChituError
from chitu_core.layers.stage import stage_layers
from builders import build_model
from test_moe_models import build_moe

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 53)), [300, 200, 100], [7] * 17]  # 43 tokens: two prefill chunks of 32
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
MODELS = ("llama", "tied", "moe")


def test_stage_layers_split_evenly_earlier_stages_take_the_remainder():
    assert [list(stage_layers(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(4, 4, r)) for r in range(4)] == [[0], [1], [2], [3]]
    assert [len(stage_layers(61, 8, r)) for r in range(8)] == [8, 8, 8, 8, 8, 7, 7, 7]
    with pytest.raises(ChituError, match="more than the model's 2 layers"):
        stage_layers(2, 3, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    build_model(root / "llama", "llama", num_hidden_layers=4)
    build_model(root / "tied", "llama-tied", num_hidden_layers=3)  # stages of 2 and 1 layers, the head tied
    build_moe(root / "moe", "qwen3_moe")
    return root


def run(path, **kwargs) -> list:
    llm = LLM(str(path), device="cpu", dtype="float32", load_progress=False, num_threads=1,
              max_num_batched_tokens=32, **kwargs)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    scored = llm.generate(prompts[:2], WITH_LOGPROBS)
    logprobs = [[(lp and sorted(lp.items())) for lp in o.outputs[0].logprobs] for o in scored]
    return [greedy, [o.outputs[0].token_ids for o in scored], logprobs, _held(llm)]


def _held(llm) -> dict:
    """What this rank holds: its layers' indices, and whether it has the embedding and the head."""
    model = llm.engine.model.model
    return {"layers": list(model.local), "params": sum(p.numel() for p in llm.engine.model.parameters())}


def _rank(rank: int, world: int, pp: int, port: int, root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        queue.put((rank, {name: run(os.path.join(root, name), pipeline_parallel_size=pp) for name in MODELS}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, pp: int, root) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(world, pp, port, str(root), queue), nprocs=world, join=True)
    return dict(queue.get() for _ in range(world))


@pytest.mark.parametrize("world,pp", [(2, 2), (4, 2)], ids=["pp2", "tp2xpp2"])
def test_stages_match_one_process(models, world, pp):
    one = {name: run(models / name) for name in MODELS}
    ranks = spawn(world, pp, models)
    tp = world // pp
    for name in MODELS:
        num_layers = len(one[name][3]["layers"])
        for rank, got in ranks.items():
            assert got[name][:2] == one[name][:2], f"{name}: rank {rank} tokens"
            for ours, ref in zip(got[name][2], one[name][2]):  # logprobs: the same tokens, values within fp32
                for a, b in zip(ours, ref):
                    assert [t for t, _ in a] == [t for t, _ in b]
                    torch.testing.assert_close([v for _, v in a], [v for _, v in b], rtol=0, atol=1e-4)
            assert got[name][3]["layers"] == list(stage_layers(num_layers, pp, rank // tp)), f"{name}: rank {rank}"
        if tp == 1:  # the stages hold the model between them once, but for the tied head's copy of the table
            copy = 512 * 64 if name == "tied" else 0
            assert sum(got[name][3]["params"] for got in ranks.values()) == one[name][3]["params"] + copy, name
