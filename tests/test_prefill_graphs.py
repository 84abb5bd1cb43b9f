"""Prefill graphs (contract 1.16) on the CPU, through the decode tests' replaying graph runner and the
reference attention marked as ``captures_prefill``: steps of prompts, chunked prompts and prompts beside
decodes replay padded buckets from static buffers and give exactly the tokens of eager steps; padding
never reaches the cache; steps past the largest bucket run eagerly; the KV budget reserves the graphs'
measured activations."""

import pytest
from chitu_cpu.backend import CpuBackend

from builders import build_model
from chitu_core import LLM, SamplingParams
from chitu_core.attention.reference import ReferenceAttention
from chitu_core.backend import MemoryInfo
from chitu_core.engine.prefill_graphs import PrefillGraphs, prefill_buckets
from chitu_core.errors import ChituError
from test_graphs import ReplayingRunner, assert_same, changed_slots, generate, requests


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill-graphs-llama")
    build_model(path, "llama")
    return path


@pytest.fixture(autouse=True)
def reference_attention(monkeypatch):
    """The reference attention, declared capturable for these tests (it reads the metadata's tensors and
    takes the bounds; its cache write asks the host whether any row is padding, which a replaying runner
    allows)."""
    monkeypatch.setattr(CpuBackend, "attention_backends", lambda self: {})
    monkeypatch.setattr(ReferenceAttention, "captures_prefill", True)


def test_prefill_buckets():
    assert prefill_buckets(0) == prefill_buckets(15) == []
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(1024) == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024]
    assert prefill_buckets(600) == [16, 32, 64, 128, 192, 256, 384, 512, 600]


@pytest.mark.parametrize("budget", [None, 24])  # whole prompts (115 tokens in one step); chunks beside decodes
def test_prefill_graphs_equal_eager(model_path, monkeypatch, budget):
    eager, _ = generate(model_path, monkeypatch, None, max_num_batched_tokens=budget)
    runner = ReplayingRunner()
    graphed, engine = generate(model_path, monkeypatch, runner, max_num_batched_tokens=budget, max_graph_batch_size=4,
                               max_prefill_graph_tokens=128)
    prefill = engine.runner.prefill_graphs
    assert prefill.sizes == ([16, 32, 64, 128] if budget is None else [16, 24])
    assert runner.captured == list(reversed(prefill.sizes)) + [4, 2, 1]  # prefill first, each largest first
    assert_same(graphed, eager)
    bm = engine.block_manager
    assert bm.num_free == bm.num_blocks


def test_prefill_steps_replay_and_larger_ones_run_eagerly(model_path, monkeypatch):
    """Prompts of 5 + 14 + 23 + 32 + 41 tokens: one step of 115, past the largest bucket of 64 here, runs
    eagerly; a later step of two prompts (5 + 14 tokens) beside the five decodes replays the bucket of 32."""
    runs = []
    run = PrefillGraphs.run
    monkeypatch.setattr(PrefillGraphs, "run", lambda self, batch, size: runs.append(
        (sum(batch.num_new_tokens), size)) or run(self, batch, size))
    monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: ReplayingRunner())
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False, block_size=8, max_graph_batch_size=4,
              max_prefill_graph_tokens=64, async_scheduling=False, enable_prefix_caching=False)
    engine = llm.engine
    prompts, params = requests()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    engine.step()
    assert runs == []
    for i, (p, sp) in enumerate(zip(prompts[:2], params[:2])):
        engine.add_request(f"s{i}", p, sp)
    engine.step()  # the two new prompts beside five decodes: 24 tokens, the bucket of 32
    assert runs == [(24, 32)]
    while engine.has_unfinished():
        engine.step()


def test_prefill_graph_padding_never_writes_the_cache(model_path, monkeypatch):
    """Prompts of 3, 4 and 5 tokens in the bucket of 16: exactly their 12 slots change."""
    runner = ReplayingRunner()
    monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: runner)
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False, block_size=8, max_graph_batch_size=4,
              max_prefill_graph_tokens=32, enable_prefix_caching=False, async_scheduling=False)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"p{i}", [11 + i] * (3 + i), SamplingParams(max_tokens=2, ignore_eos=True))
    before = [c.clone() for c in engine.runner.kv_caches]
    engine.step()
    assert runner.replays == 1
    bs = engine.attention.block_size
    want = {s.block_table[p // bs] * bs + p % bs for s in engine.scheduler.running for p in range(len(s.prompt_token_ids))}
    assert len(want) == 12
    for old, new in zip(before, engine.runner.kv_caches):
        assert changed_slots(old, new) == want
    while engine.has_unfinished():
        engine.step()


def test_off_where_asked_or_not_declared(model_path, monkeypatch):
    runner = ReplayingRunner()
    monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: runner)
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False, max_prefill_graph_tokens=0)
    assert llm.engine.runner.prefill_graphs is None
    monkeypatch.setattr(ReferenceAttention, "captures_prefill", False)
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False)
    assert llm.engine.runner.prefill_graphs is None and llm.engine.runner.graphs is not None


def test_a_failed_capture_says_how_to_turn_them_off(model_path, monkeypatch):
    class Refuses(ReplayingRunner):
        def capture(self, fn):
            out = fn()
            if out.dim() == 2 and out.shape[0] >= 16:  # the prefill graphs' hidden states
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().capture(fn)

    monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: Refuses())
    with pytest.raises(ChituError, match=r"capturing the prefill graphs failed \(RuntimeError: operation not "
                                         r"permitted.*--max-prefill-graph-tokens 0"):
        LLM(model_path, device="cpu", dtype="float32", load_progress=False)


def test_kv_budget_reserves_the_prefill_graphs_activations(model_path, monkeypatch):
    """With gpu_memory_utilization the budget is utilization x total, less the largest step's peak, the decode
    graphs' reserve and what a step of the largest prefill graph adds to memory held at rest."""
    calls = []

    def measure(self, fn, index=0):
        fn()
        calls.append(fn)
        return {1: 50 << 20, 2: 10 << 20, 3: 13 << 20}[len(calls)]  # largest step, at rest, prefill graph step

    monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: ReplayingRunner())
    monkeypatch.setattr(CpuBackend, "measure_peak_memory", measure)
    monkeypatch.setattr(CpuBackend, "memory_info", lambda self, index=0: MemoryInfo(560 << 20, 560 << 20))
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False, gpu_memory_utilization=0.6,
              max_num_batched_tokens=300, max_model_len=256, block_size=8, max_prefill_graph_tokens=64)
    engine = llm.engine
    per_block = engine.attention.bytes_per_block() * len(engine.runner.kv_caches)
    assert len(calls) == 3
    decode_reserve = engine.max_graph_batch * engine.vocab_size * 8 + (256 << 20)
    budget = int((560 << 20) * 0.6) - (50 << 20) - decode_reserve - (3 << 20)
    assert engine.block_manager.num_blocks == budget // per_block < (budget + (3 << 20)) // per_block < 256 * 32


def test_the_backends_own_budget_leaves_the_prefill_graphs_room(model_path, monkeypatch):
    """Without gpu_memory_utilization the cache gets the backend's budget less the prefill graphs' measured
    activations."""
    sizes = iter([10 << 20, 12 << 20])  # at rest, a step of the largest prefill graph

    def measure(self, fn, index=0):
        fn()
        return next(sizes)

    monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: ReplayingRunner())
    monkeypatch.setattr(CpuBackend, "measure_peak_memory", measure)
    monkeypatch.setattr(CpuBackend, "kv_cache_budget", lambda self, index=0: 5 << 20)
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False, max_model_len=256, block_size=8,
              max_prefill_graph_tokens=64)
    per_block = llm.engine.attention.bytes_per_block() * len(llm.engine.runner.kv_caches)
    assert llm.engine.block_manager.num_blocks == (3 << 20) // per_block
