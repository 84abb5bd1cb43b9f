"""Pipeline parallelism on CPU with gloo: two stages, and two stages of two tensor-parallel ranks,
give the same fp32 greedy tokens (and logprobs) as one process, on dense, tied and MoE configs, with
chunked prefill, several sequences and uneven stages; requests arriving while others decode; decode
steps split into micro-batches; decode graphs (a replaying graph runner) with each stage's input in
a static buffer; the KV cache sized from a profiled step on every stage. Also the layer split."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from chitu_cpu.backend import CpuBackend

from chitu_core import LLM, SamplingParams
from chitu_core.backend import MemoryInfo
from chitu_core.bench.floor import aggregate_floor
from chitu_core.distributed.pipeline import micro_batches
from chitu_core.errors import ChituError
from chitu_core.layers.stage import stage_layers
from builders import build_model
from test_graphs import ReplayingRunner
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


def test_micro_batches_only_for_decode_steps_of_eight_sequences_a_stage():
    assert micro_batches(15, 2, decode=True) == [range(15)]
    assert micro_batches(17, 2, decode=True) == [range(0, 9), range(9, 17)]
    assert micro_batches(26, 3, decode=True) == [range(0, 9), range(9, 18), range(18, 26)]
    assert micro_batches(40, 2, decode=False) == [range(40)]
    assert micro_batches(40, 1, decode=True) == [range(40)]


def test_floor_of_a_pipeline_with_groups_in_flight_is_its_slowest_stage():
    # Two stages of one rank, 10 GB/s each; stage 1 reads more weights. GB over GB/s: seconds.
    floors = [{"pp_rank": 0, "weight_bytes": 2e9, "kv_bytes_mean": 1e9, "copy_gbps": 10.0, "step_ms": 300.0},
              {"pp_rank": 1, "weight_bytes": 3e9, "kv_bytes_mean": 1e9, "copy_gbps": 10.0, "step_ms": 400.0}]
    one_group = aggregate_floor(floors, 64)
    assert one_group["step_ms"] == 700.0 and one_group["decode_tok_per_s"] == round(64 / 0.7, 3)
    two_groups = aggregate_floor(floors, 64, groups=2)  # stage 1: (2 x 3 + 1) GB at 10 GB/s
    assert two_groups["step_ms"] == 700.0 and two_groups["weight_bytes"] == 5e9 and two_groups["groups"] == 2
    assert "groups" not in one_group
    floors[1]["weight_bytes"] = 1e9  # now stage 0 is the slower: (2 x 2 + 1) GB
    assert aggregate_floor(floors, 64, groups=2)["step_ms"] == 500.0


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


def arrivals() -> list[tuple[int, list[int], SamplingParams]]:
    """(step it arrives at, prompt, params): 18 requests, so that decode steps hold 16 sequences and
    more (micro-batches under two stages) and then fewer; six arrive while the others decode, their
    prefills sharing steps with decodes; one asks for logprobs, one samples with a seed."""
    reqs = []
    for i in range(18):
        prompt = [(37 * i + 11 * j) % 500 + 1 for j in range(3 + i % 6)]
        params = SamplingParams(max_tokens=4 + i % 5, temperature=0.0, ignore_eos=True)
        reqs.append((0 if i < 12 else 2, prompt, params))
    reqs[3] = (0, reqs[3][1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2))
    reqs[5] = (0, reqs[5][1], SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=3, ignore_eos=True))
    return reqs


def drive(llm) -> tuple[list, int]:
    """Run ``arrivals()`` step by step: each request's tokens (and logprobs), and the most steps the
    engine held in flight (launched, not yet processed) after a step."""
    engine, outs, step, most = llm.engine, [], 0, 0
    pending = arrivals()
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            outs.append(engine.add_request(f"r{len(outs)}", prompt, params))
        engine.step()
        most = max(most, len(engine._in_flight))
        step += 1
    return [(o.seqs[0].output_token_ids, o.seqs[0].output_logprobs) for o in outs], most


def graphed(path, **kwargs):
    """An LLM whose decode steps replay graphs (the replaying runner, with the reference attention as
    tests/test_graphs.py), its KV cache sized from a profiled largest step."""

    def measure(self, fn, index=0):  # the peak that leaves 1 MiB for the cache of a 1 GiB device at 0.5
        fn()
        return (512 << 20) - (32 * 512 * 8 + (256 << 20)) - (1 << 20)  # less the graphs' reserve

    patches = {"graph_runner": lambda self: ReplayingRunner(), "attention_backends": lambda self: {},
               "measure_peak_memory": measure, "memory_info": lambda self, index=0: MemoryInfo(1 << 30, 1 << 30)}
    saved = {name: getattr(CpuBackend, name) for name in patches}
    for name, value in patches.items():
        setattr(CpuBackend, name, value)
    try:
        return LLM(str(path), device="cpu", dtype="float32", load_progress=False, num_threads=1, block_size=8,
                   max_num_seqs=32, max_graph_batch_size=32, max_num_batched_tokens=48, gpu_memory_utilization=0.5,
                   **kwargs)
    finally:
        for name, value in saved.items():
            setattr(CpuBackend, name, value)


def extras(path, **kwargs) -> dict:
    """On one model: late arrivals and micro-batches, eagerly and through decode graphs."""
    eager = LLM(str(path), device="cpu", dtype="float32", load_progress=False, num_threads=1, max_num_seqs=32,
                max_num_batched_tokens=48, **kwargs)
    llm = graphed(path, **kwargs)
    return {"eager": drive(eager), "graphs": drive(llm), "graph_replays": llm.engine.runner.graphs.runner.replays,
            "kv_blocks": llm.engine.block_manager.num_blocks}


def _rank(rank: int, world: int, pp: int, port: int, root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        got = {name: run(os.path.join(root, name), pipeline_parallel_size=pp) for name in MODELS}
        got["extras"] = extras(os.path.join(root, "llama"), pipeline_parallel_size=pp)
        queue.put((rank, got))
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


def same_logprobs(ours, ref) -> None:
    """The same top tokens, values within fp32."""
    for a, b in zip(ours, ref):
        if a is None or b is None:
            assert a is b
            continue
        assert sorted(a) == sorted(b)
        torch.testing.assert_close([a[t] for t in sorted(a)], [b[t] for t in sorted(b)], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def one(models) -> dict:
    got = {name: run(models / name) for name in MODELS}
    got["extras"] = extras(models / "llama")
    return got


@pytest.mark.parametrize("world,pp", [(2, 2), (4, 2)], ids=["pp2", "tp2xpp2"])
def test_stages_match_one_process(models, one, world, pp):
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

    ref = one["extras"]
    assert ref["eager"][1] == ref["graphs"][1] == 1  # one process keeps one step in flight
    for rank, got in ranks.items():
        got = got["extras"]
        for mode in ("eager", "graphs"):
            outputs, most_parts = got[mode]
            assert most_parts == pp, f"rank {rank} {mode}: decode batches of 16 sequences and more run as groups in flight"
            for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(outputs, ref[mode][0]):
                assert tokens == ref_tokens, f"rank {rank} {mode}"
                same_logprobs(logprobs, ref_logprobs)
        assert got["graph_replays"] > 0
        # A rank caches 1/pp of the layers and 1/tp of the KV heads: the same memory holds `world` times
        # the blocks; every rank agrees.
        assert got["kv_blocks"] == world * ref["kv_blocks"] == ranks[0]["extras"]["kv_blocks"]
