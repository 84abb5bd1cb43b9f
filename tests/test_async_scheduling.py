"""Async scheduling: a decode step launched before the host has the previous step's tokens gives
exactly what one step at a time gives (tokens, logprobs, finish reasons, stops that end a sequence
while its next row is already running), eagerly and through decode graphs, with aborts, and the
KV pool drains."""

import pytest
from chitu_cpu.backend import CpuBackend

from builders import build_chat_model
from chitu_core import LLM, SamplingParams
from test_graphs import ReplayingRunner


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("async-llama")
    build_chat_model(path)
    return path


@pytest.fixture(autouse=True)
def reference_attention(monkeypatch):
    monkeypatch.setattr(CpuBackend, "attention_backends", lambda self: {})  # see test_graphs


def make_engine(path, monkeypatch, graphs: bool, async_scheduling: bool):
    if graphs:
        monkeypatch.setattr(CpuBackend, "graph_runner", lambda self: ReplayingRunner())
    engine = LLM(path, device="cpu", dtype="float32", load_progress=False, block_size=8, max_graph_batch_size=8,
                 max_model_len=60, async_scheduling=async_scheduling).engine
    continued = []
    original = engine._continuation

    def counting(current):
        launched = original(current)
        continued.append(launched is not None)
        return launched

    engine._continuation = counting
    return engine, continued


def prompts():
    return [[(5 * i + 11 * j) % 300 + 3 for j in range(4 + 7 * i)] for i in range(8)]


def params_for(stops: dict[str, int | str]) -> list[SamplingParams]:
    """Every feature whose host bookkeeping lags a step behind the device under async scheduling."""
    return [
        SamplingParams(max_tokens=18, temperature=0.0, stop=[stops["text"]]),
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
        # Greedy decoding here repeats a token: penalties that miss one occurrence pick another.
        SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.7, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=0.0, stop_token_ids=[stops["token"]]),
        # Its favourite token stops it, banned for 3 tokens (it is the 4th): a ban too long shows.
        SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, stop_token_ids=[stops["favourite"]]),
        SamplingParams(max_tokens=9, temperature=1.0, min_tokens=6, seed=9),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # fills max_model_len exactly
    ]


def drive(engine, requests, abort_at: dict[int, str] | None = None, join_at: int = 3):
    """The first half of the requests at once, the rest after ``join_at`` steps; aborts by step."""
    handles = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(requests[:4])]
    step = 0
    while engine.has_unfinished() or len(handles) < len(requests):
        if step == join_at:
            handles += [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(requests[4:], 4)]
        engine.step()
        step += 1
        if abort_at and step in abort_at:
            assert engine.abort_request(abort_at[step])
    return [(s.output_token_ids, s.output_logprobs, s.finish_reason) for h in handles for s in h.seqs]


def reference_stops(path, monkeypatch) -> dict[str, int | str]:
    """From greedy decoding, one step at a time: the text of prompt 0's fourth token, the second
    token of prompt 4 and the first of prompt 5."""
    engine, _ = make_engine(path, monkeypatch, graphs=False, async_scheduling=False)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = {i: engine.add_request(f"g{i}", prompts()[i], greedy).seqs[0] for i in (0, 4, 5)}
    while engine.has_unfinished():
        engine.step()
    text = engine.tokenizer.decode([out[0].output_token_ids[3]])
    assert text.isprintable() and text.strip(), "pick another token: this one decodes to no plain text"
    return {"text": text, "token": out[4].output_token_ids[1],
            "favourite": out[5].output_token_ids[0]}


def assert_same(got, want):
    for (tokens, logprobs, reason), (want_tokens, want_logprobs, want_reason) in zip(got, want, strict=True):
        assert tokens == want_tokens and reason == want_reason
        assert len(logprobs) == len(want_logprobs)
        for a, b in zip(logprobs, want_logprobs):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-5 for k in a)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_async_equals_one_step_at_a_time(model_path, monkeypatch, graphs):
    requests = list(zip(prompts(), params_for(reference_stops(model_path, monkeypatch))))
    sync_engine, sync_continued = make_engine(model_path, monkeypatch, graphs, async_scheduling=False)
    want = drive(sync_engine, requests)
    assert not sync_continued
    engine, continued = make_engine(model_path, monkeypatch, graphs, async_scheduling=True)
    got = drive(engine, requests)
    assert_same(got, want)
    reasons = [r for _, _, r in got]
    assert reasons.count("stop") == 3 and reasons.count("length") == 5  # the stops did end sequences
    assert len(prompts()[7]) + len(got[7][0]) == 60 and len(got[5][0]) == 4
    assert sum(continued) > 10  # most decode steps were continuations
    assert engine.stats.num_generated_tokens == sync_engine.stats.num_generated_tokens
    bm = engine.block_manager
    assert not engine._in_flight and not engine.requests and bm.num_free == bm.num_blocks


def test_abort_while_the_next_step_runs(model_path, monkeypatch):
    requests = list(zip(prompts(), params_for(reference_stops(model_path, monkeypatch))))
    want = drive(make_engine(model_path, monkeypatch, True, async_scheduling=False)[0], requests, {6: "r1", 9: "r2"})
    engine, continued = make_engine(model_path, monkeypatch, True, async_scheduling=True)
    got = drive(engine, requests, {6: "r1", 9: "r2"})
    assert got[1][2] == got[2][2] == "abort" and len(got[1][0]) == len(want[1][0])
    assert_same(got, want)
    bm = engine.block_manager
    assert any(continued) and not engine.requests and bm.num_free == bm.num_blocks
