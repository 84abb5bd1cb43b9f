"""Decode graphs on the CPU, through a graph runner that replays by re-running the captured function
into the captured output (what a real graph does to its static tensors): padded buckets, static
input buffers and the eager fallback give exactly the tokens of eager decoding. Also the KV cache
sized from a profiled largest step (gpu_memory_utilization)."""

import pytest
from chitu_cpu.backend import CpuBackend

from builders import build_model
from chitu_core import LLM, SamplingParams
from chitu_core.backend import GraphRunner, MemoryInfo
from chitu_core.engine.graphs import bucket_sizes
from chitu_core.errors import ChituError


class ReplayingRunner(GraphRunner):
    """Replays by calling the function again and copying its result into the first result's storage."""

    def __init__(self):
        self.captured: list[int] = []
        self.replays = 0

    def capture(self, fn):
        out = fn()
        self.captured.append(out.shape[0])

        def replay():
            self.replays += 1
            out.copy_(fn())
            return out

        return replay


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs-llama")
    build_model(path, "llama")
    return path


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def requests():
    """Five prompts of different lengths; their max_tokens make the decode batch shrink 5 -> 1, and a
    sampled row and a logprobs row ride along with the greedy ones."""
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(5)]
    params = [SamplingParams(max_tokens=4 + 6 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    params[1] = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    params[3] = SamplingParams(max_tokens=22, temperature=0.0, logprobs=2, ignore_eos=True)
    return prompts, params


@pytest.fixture(autouse=True)
def reference_attention(monkeypatch):
    """The CPU backend's attention plans each step from the metadata's values in ``prepare``, which a
    graph would replay stale (backends with graph runners plan from host ints, as the contract says);
    the reference attention derives everything inside its forward."""
    monkeypatch.setattr(CpuBackend, "attention_backends", lambda self: {})


def generate(path, monkeypatch, runner, **kw):
    if runner is not None:
        monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: runner)
    llm = LLM(path, device="cpu", dtype="float32", load_progress=False, block_size=8, **kw)
    prompts, params = requests()
    outs = [llm.engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while llm.engine.has_unfinished():
        llm.engine.step()
    return [(o.seqs[0].output_token_ids, o.seqs[0].output_logprobs) for o in outs], llm.engine


def assert_same(graphed, eager):
    """The same tokens, and logprobs within 1e-4."""
    assert [t for t, _ in graphed] == [t for t, _ in eager]
    for (_, lp_graph), (_, lp_eager) in zip(graphed, eager):
        for a, b in zip(lp_graph, lp_eager):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_graph_decode_equals_eager(model_path, monkeypatch):
    eager, eager_engine = generate(model_path, monkeypatch, None)
    assert eager_engine.runner.graphs is None
    runner = ReplayingRunner()
    graphed, engine = generate(model_path, monkeypatch, runner, max_graph_batch_size=4)
    assert runner.captured == [4, 2, 1]  # largest first
    # Decode steps with 5 sequences run eagerly (more than the largest bucket); 4, 3, 2, 1 replay.
    assert runner.replays > 0
    assert_same(graphed, eager)
    bm = engine.block_manager
    assert bm.num_free == bm.num_blocks


def test_graph_padding_never_writes_the_cache(model_path, monkeypatch):
    """Three sequences in the bucket of four: the padding row's slot is -1 and leaves the cache alone."""
    runner = ReplayingRunner()
    monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: runner)
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False, block_size=8, max_graph_batch_size=4,
              enable_prefix_caching=False, async_scheduling=False)  # one step at a time, to look between them
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"p{i}", [11 + i] * (3 + i), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the prefills
    before = [c.clone() for c in engine.runner.kv_caches]
    bs = engine.attention.block_size
    want = {s.block_table[s.num_computed_tokens // bs] * bs + s.num_computed_tokens % bs for s in engine.scheduler.running}
    engine.step()  # one decode step of 3 in the graph of 4
    assert runner.replays == 1
    for old, new in zip(before, engine.runner.kv_caches):
        assert changed_slots(old, new) == want
    while engine.has_unfinished():
        engine.step()


def changed_slots(old, new) -> set[int]:
    """The slots of one layer's cache [2, blocks, block_size, Hk, D] whose key or value differs between two copies."""
    rows = lambda c: c.reshape(2, -1, c.shape[3] * c.shape[4])  # noqa: E731  [k|v, slot, Hk * D]
    return {int(x) for x in (rows(old) != rows(new)).any(-1).any(0).nonzero()[:, 0]}


def test_enforce_eager_captures_nothing(model_path, monkeypatch):
    runner = ReplayingRunner()
    monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: runner)
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False, enforce_eager=True)
    assert llm.engine.runner.graphs is None and runner.captured == []


def test_memory_utilization_needs_a_measuring_backend(model_path):
    with pytest.raises(ChituError, match="cannot measure device memory.*kv_cache_memory"):
        LLM(model_path, device="cpu", dtype="float32", load_progress=False, gpu_memory_utilization=0.5)


def test_kv_cache_sized_from_the_profiled_step(model_path, monkeypatch):
    """The cache gets utilization x total less the measured peak; the profiled step really runs
    the largest step (max_num_batched_tokens tokens through the model)."""
    calls = []

    def measure(self, fn, index=0):
        fn()
        calls.append(fn)
        return 50 << 20

    monkeypatch.setattr(CpuBackend, "measure_peak_memory", measure)
    monkeypatch.setattr(CpuBackend, "memory_info", lambda self, index=0: MemoryInfo(100 << 20, 90 << 20))
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False, gpu_memory_utilization=0.6,
              max_num_batched_tokens=300, max_model_len=256, block_size=8)
    engine = llm.engine
    per_block = engine.attention.bytes_per_block() * len(engine.runner.kv_caches)
    assert len(calls) == 1
    assert engine.block_manager.num_blocks == (int((100 << 20) * 0.6) - (50 << 20)) // per_block

    with pytest.raises(ChituError, match="leaves nothing for the KV cache"):
        LLM(model_path, device="cpu", dtype="float32", load_progress=False, gpu_memory_utilization=0.4)
