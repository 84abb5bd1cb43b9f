"""AsyncLLM: concurrent streams equal the offline results; a consumer that leaves aborts its request."""

import asyncio

import pytest

from builders import build_chat_model
from chitu_core import LLM, SamplingParams
from chitu_core.config import EngineConfig
from chitu_core.engine.async_engine import AsyncLLM
from chitu_core.errors import ChituError


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("async-llama")
    build_chat_model(path, "llama")
    return path


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), device="cpu", dtype="float32", load_progress=False)


async def collect(llm: AsyncLLM, prompt, params, **kw):
    deltas = [d async for d in llm.generate(prompt, params, **kw)]
    return deltas


def test_concurrent_streams_equal_offline_generation(model_path):
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 8, 25, 1)]
    params = [SamplingParams(max_tokens=10 + i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True) for i in range(6)]
    offline = LLM(model_path, device="cpu", dtype="float32", load_progress=False)
    want = [o.outputs[0] for o in offline.generate([{"prompt_token_ids": p} for p in prompts], params)]

    async def main():
        llm = AsyncLLM(config(model_path))
        results = await asyncio.gather(*(collect(llm, p, s) for p, s in zip(prompts, params)))
        await llm.wait_idle()
        stats = llm.stats()
        await llm.shutdown()
        return results, stats, llm

    results, stats, llm = asyncio.run(main())
    for deltas, w in zip(results, want):
        assert sum((d.outputs[0].token_ids for d in deltas), []) == w.token_ids
        assert "".join(d.outputs[0].text for d in deltas) == w.text
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
        assert not any(d.finished for d in deltas[:-1])
        m = deltas[-1].metrics
        assert m.queue_time >= 0 and m.time_to_first_token > 0 and m.time_per_output_token > 0
        assert m.num_output_tokens == len(w.token_ids)
    assert stats.num_generated_tokens == sum(len(w.token_ids) for w in want)
    assert stats.kv_usage == 0.0 and stats.num_running == 0
    bm = llm.engine.block_manager
    assert bm.num_free == bm.num_blocks


def test_leaving_a_stream_aborts_its_request(model_path):
    async def main():
        llm = AsyncLLM(config(model_path))
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        seen = 0
        async for _ in llm.generate(list(range(30)), params, request_id="leaver"):
            seen += 1
            if seen == 3:
                break
        finisher = await collect(llm, [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
        await llm.wait_idle()
        await llm.shutdown()
        return llm, finisher

    llm, finisher = asyncio.run(main())
    assert finisher[-1].outputs[0].finish_reason == "length"
    eng = llm.engine
    assert not eng.requests and not eng.scheduler.has_unfinished()
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_only_requests_still_in_the_engine_are_aborted_there(model_path):
    """A server aborts every request it ends: finished and refused ones send the engine nothing (under
    torchrun every command reaches every rank), a live one and one cancelled while admitted do."""
    async def main():
        llm = AsyncLLM(config(model_path))
        sent = []
        send = llm._send_command
        llm._send_command = lambda command: (sent.append(command[:2]), send(command))
        try:
            await collect(llm, [4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True), request_id="done")
            llm.abort("done")
            with pytest.raises(ValueError):
                await collect(llm, [1] * 500, SamplingParams(max_tokens=100), request_id="refused")
            llm.abort("refused")
            llm.abort("nobody")
            admitting = asyncio.create_task(llm.add_request([7, 8], SamplingParams(max_tokens=200, ignore_eos=True),
                                                            request_id="cancelled"))
            await asyncio.sleep(0)  # its add is sent; acceptance not yet in
            admitting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await admitting
            live = await llm.add_request([9, 10], SamplingParams(max_tokens=200, ignore_eos=True), request_id="live")
            await anext(live)
            llm.abort("live")
            await llm.wait_idle()
        finally:
            await llm.shutdown()
        return llm, [c for c in sent if c[0] == "abort"]

    llm, aborts = asyncio.run(main())
    assert aborts == [("abort", "cancelled"), ("abort", "live")]
    eng = llm.engine
    assert not eng.requests and eng.block_manager.num_free == eng.block_manager.num_blocks


def test_a_refused_request_raises_before_any_output(model_path):
    async def main():
        llm = AsyncLLM(config(model_path))
        try:
            with pytest.raises(ValueError, match="more than max_model_len=512"):
                await collect(llm, [1] * 500, SamplingParams(max_tokens=100))
            ok = await collect(llm, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
        finally:
            await llm.shutdown()
        return ok

    deltas = asyncio.run(main())  # a consumer that falls behind gets deltas merged: count tokens
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == 2 and deltas[-1].finished


def test_stop_strings_are_never_streamed(model_path):
    offline = LLM(model_path, device="cpu", dtype="float32", load_progress=False)
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = offline.tokenizer.encode("What is the capital of France?")
    text = offline.generate({"prompt_token_ids": prompt}, base)[0].outputs[0].text
    stop = text[4:7]
    params = base.model_copy(update={"stop": [stop]})

    async def main():
        llm = AsyncLLM(config(model_path))
        try:
            return await collect(llm, prompt, params)
        finally:
            await llm.shutdown()

    deltas = asyncio.run(main())
    streamed = "".join(d.outputs[0].text for d in deltas)
    assert streamed == text[: text.index(stop)]
    assert deltas[-1].outputs[0].finish_reason == "stop" and deltas[-1].outputs[0].stop_reason == stop


# ----- the engine core in a process of its own (what `python -m chitu_core.serve` runs) -----


def test_engine_process_streams_equal_offline_and_drain(model_path):
    prompts = [list(range(7, 7 + n)) for n in (4, 30, 12)]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0 if i % 2 else 0.7, seed=i, ignore_eos=True)
              for i in range(3)]
    offline = LLM(model_path, device="cpu", dtype="float32", load_progress=False)
    want = [o.outputs[0] for o in offline.generate([{"prompt_token_ids": p} for p in prompts], params)]

    async def main():
        llm = AsyncLLM(config(model_path), process=True)
        try:
            assert llm.engine is None and llm.max_model_len == offline.engine.max_model_len
            with pytest.raises(ValueError, match="outside the vocabulary"):  # refused in the child, raised here
                await collect(llm, [10**6], SamplingParams(max_tokens=2))
            results = await asyncio.gather(*(collect(llm, p, s) for p, s in zip(prompts, params)))
            await llm.wait_idle()
            return results, llm.stats(), llm
        finally:
            await llm.shutdown()

    results, stats, llm = asyncio.run(main())
    for deltas, w, prompt in zip(results, want, prompts):
        assert sum((d.outputs[0].token_ids for d in deltas), []) == w.token_ids
        assert "".join(d.outputs[0].text for d in deltas) == w.text
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        assert all(d.prompt_token_ids == prompt for d in deltas)  # restored on this side
    assert stats.num_generated_tokens == sum(len(w.token_ids) for w in want)
    assert stats.num_running == 0 and stats.kv_usage == 0.0
    assert llm._process.exitcode == 0  # it left on "stop"


def test_a_thread_core_builds_its_engine_on_its_own_thread(model_path, monkeypatch):
    # Host thread pools (OpenMP's) belong to the thread that opens a parallel region: built elsewhere,
    # the engine's steps would run on a second pool, and every parallel op would wait on wake-ups.
    import threading

    import chitu_core.engine.async_engine as async_engine

    built_on = []

    class Recorded(async_engine.LLMEngine):
        def __init__(self, *args, **kw):
            built_on.append(threading.current_thread().name)
            super().__init__(*args, **kw)

    monkeypatch.setattr(async_engine, "LLMEngine", Recorded)

    async def main():
        llm = AsyncLLM(config(model_path))
        deltas = await collect(llm, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        await llm.shutdown()
        return deltas

    deltas = asyncio.run(main())
    assert built_on == ["chitu-engine"]
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == 4


def test_a_thread_core_that_cannot_load_raises_its_error_here(tmp_path):
    import threading

    with pytest.raises(ChituError, match="config.json"):
        AsyncLLM(EngineConfig(model=str(tmp_path), device="cpu", load_progress=False))
    assert not [t for t in threading.enumerate() if t.name == "chitu-engine"]


def test_engine_process_that_cannot_load_says_why(tmp_path):
    with pytest.raises(ChituError, match="engine process could not start: .*config.json"):
        AsyncLLM(EngineConfig(model=str(tmp_path), device="cpu", load_progress=False), process=True)


def test_engine_process_death_fails_the_open_streams(model_path):
    async def main():
        llm = AsyncLLM(config(model_path), process=True)
        stream = await llm.add_request([3, 4, 5], SamplingParams(max_tokens=400, ignore_eos=True))
        first = await stream.__anext__()
        llm._process.kill()
        with pytest.raises(ChituError, match="engine process exited"):
            async for _ in stream:
                pass
        with pytest.raises(ChituError, match="engine stopped after an error"):
            await llm.add_request([1], SamplingParams(max_tokens=1))
        await llm.shutdown()
        return first

    assert asyncio.run(main()).outputs[0].token_ids


def test_merge_deltas_joins_per_sample():
    from chitu_core.engine.outputs import CompletionOutput, RequestOutput, merge_deltas

    a = RequestOutput("r", "p", [1], [CompletionOutput(0, "ab", [5, 6], logprobs=[{5: -1.0}, {6: -2.0}]),
                                      CompletionOutput(1, "x", [7])], delta=True)
    b = RequestOutput("r", "p", [1], [CompletionOutput(1, "y", [8], "length"),
                                      CompletionOutput(0, "c", [9], "stop", "c", [{9: -3.0}], -6.0)], True, True)
    m = merge_deltas(a, b)
    assert m.finished and m.delta and [c.index for c in m.outputs] == [0, 1]
    assert (m.outputs[0].text, m.outputs[0].token_ids, m.outputs[0].logprobs) == ("abc", [5, 6, 9], [{5: -1.0}, {6: -2.0}, {9: -3.0}])
    assert (m.outputs[0].finish_reason, m.outputs[0].stop_reason, m.outputs[0].cumulative_logprob) == ("stop", "c", -6.0)
    assert (m.outputs[1].text, m.outputs[1].token_ids, m.outputs[1].finish_reason) == ("xy", [7, 8], "length")
    assert a.outputs[0].token_ids == [5, 6]  # the inputs are left as they were


def test_a_slow_consumer_gets_merged_deltas(model_path):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = LLM(model_path, device="cpu", dtype="float32", load_progress=False).generate(
        {"prompt_token_ids": [9, 8, 7]}, params)[0].outputs[0]

    async def main():
        llm = AsyncLLM(config(model_path))
        deltas = []
        async for d in llm.generate([9, 8, 7], params):
            deltas.append(d)
            await asyncio.sleep(0.05)  # the engine runs ahead meanwhile
        await llm.shutdown()
        return deltas

    deltas = asyncio.run(main())
    assert len(deltas) < 40 and any(len(d.outputs[0].token_ids) > 1 for d in deltas)
    assert sum((d.outputs[0].token_ids for d in deltas), []) == want.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == want.text and deltas[-1].finished


def test_engine_process_runs_dummy_weights_from_config_json_alone(model_path, tmp_path):
    """load_format="dummy": the server's side reads the tokenizer from a directory without weights."""
    import shutil

    for f in model_path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)

    async def main():
        llm = AsyncLLM(config(tmp_path).model_copy(update={"load_format": "dummy"}), process=True)
        try:
            deltas = await collect(llm, [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
            return sum((d.outputs[0].token_ids for d in deltas), [])
        finally:
            await llm.shutdown()

    assert len(asyncio.run(main())) == 4
