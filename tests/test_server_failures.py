"""A bad request fails alone with a 400 naming its field. A failed engine fails the requests it
was running with a 500 (a begun stream with an error event), later ones and /health with a 503,
and makes `python -m chitu_core.serve` exit non-zero."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import ValidationError

from builders import build_chat_model
from chitu_core import SamplingParams
from chitu_core.config import EngineConfig
from chitu_core.engine.async_engine import AsyncLLM, EngineDeadError
from chitu_core.server.app import build_app
from serving import LiveServer, free_port, wait_healthy

MODEL = "tiny-chat"
INT64_MAX = 2**63 - 1
ABOVE_INT64 = "less than or equal to 9223372036854775807"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("failures-llama")
    build_chat_model(path)
    return path


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), device="cpu", dtype="float32", load_progress=False)


@pytest.fixture(scope="module")
def server(model_path):
    llm = AsyncLLM(config(model_path))
    with LiveServer(build_app(llm, [MODEL])) as live:
        yield live
    asyncio.run(llm.shutdown())


def post(server, path: str, body: dict) -> httpx.Response:
    """json.dumps writes NaN and Infinity as Python's parser reads them (not strict JSON)."""
    return httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=30)


def complete(server, **fields) -> httpx.Response:
    return post(server, "/v1/completions", {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4,
                                            "ignore_eos": True, **fields})


def assert_400(r: httpx.Response, param: str, fragment: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and fragment in err["message"], err


# ----- validation: what would raise inside an engine step never reaches it -----


def test_a_seed_past_int64_fails_alone(server):
    assert_400(complete(server, seed=2**63), "seed", ABOVE_INT64)
    assert_400(complete(server, seed=-(2**63) - 1), "seed", "greater than or equal to -9223372036854775808")
    for seed in (INT64_MAX, -1, -(2**63)):  # sampled (temperature 1), so the seed goes to the device
        r = complete(server, seed=seed, temperature=1.0)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_top_k_is_minus_one_zero_or_positive(server):
    assert_400(complete(server, top_k=-5), "top_k", "greater than or equal to -1")
    assert_400(complete(server, top_k=2**63), "top_k", ABOVE_INT64)
    off = [complete(server, top_k=k, seed=5, temperature=1.0, max_tokens=8) for k in (-1, 0)]
    assert [r.status_code for r in off] == [200, 200]
    assert off[0].json()["choices"][0]["text"] == off[1].json()["choices"][0]["text"]  # both mean "no top-k"


BAD = [
    ("NaN temperature", {"temperature": float("nan")}, "temperature", "finite number"),
    ("Infinity temperature", {"temperature": float("inf")}, "temperature", "finite number"),
    ("Infinity repetition_penalty", {"repetition_penalty": float("inf")}, "repetition_penalty", "finite number"),
    ("-Infinity presence_penalty", {"presence_penalty": float("-inf")}, "presence_penalty", "finite number"),
    ("huge stop token", {"stop_token_ids": [5, 2**64]}, "stop_token_ids.1", ABOVE_INT64),
    ("negative stop token", {"stop_token_ids": [-1]}, "stop_token_ids.0", "greater than or equal to 0"),
]


@pytest.mark.parametrize("name,fields,param,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_sampling_field_is_a_400_naming_it(server, name, fields, param, fragment):
    assert_400(complete(server, **fields), param, fragment)


def test_chat_text_part_must_be_a_string(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert_400(post(server, "/v1/chat/completions", body), "messages.0.content", "text must be a string")


@pytest.mark.parametrize("fields,loc", [
    ({"seed": 2**63}, ("seed",)), ({"seed": -(2**63) - 1}, ("seed",)), ({"top_k": -2}, ("top_k",)),
    ({"stop_token_ids": [3, -4]}, ("stop_token_ids", 1)), ({"temperature": float("inf")}, ("temperature",)),
    ({"repetition_penalty": float("inf")}, ("repetition_penalty",)),
])
def test_sampling_params_refuse_what_a_step_cannot_batch(fields, loc):
    with pytest.raises(ValidationError) as exc:
        SamplingParams(**fields)
    assert [e["loc"] for e in exc.value.errors()] == [loc]
    edge = SamplingParams(seed=-(2**63), top_k=-1, stop_token_ids=[0, INT64_MAX])  # the bounds themselves pass
    assert (edge.seed, edge.top_k, edge.stop_token_ids) == (-(2**63), -1, [0, INT64_MAX])


# ----- a failed engine: everything in flight fails, the engine says why, later requests fail fast -----


def test_a_step_that_raises_fails_every_request_and_the_engine(model_path):
    """A request that skipped validation (model_construct) makes a real step raise."""
    bad = SamplingParams.model_construct(seed=2**63, temperature=1.0, max_tokens=4)

    async def main():
        llm = AsyncLLM(config(model_path))
        reasons: list[str] = []
        llm.on_failure(reasons.append)
        good = await llm.add_request([3, 4, 5], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        await good.__anext__()
        doomed = await llm.add_request([6, 7], bad)
        for stream in (good, doomed):
            with pytest.raises(EngineDeadError, match=r"^the engine failed: \w+Error: Overflow when unpacking long"):
                async for _ in stream:
                    pass
        late: list[str] = []
        llm.on_failure(late.append)  # already failed: called at once
        with pytest.raises(EngineDeadError, match=r"^the engine stopped after an error: \w+Error: Overflow"):
            await llm.add_request([1], SamplingParams(max_tokens=1))
        with pytest.raises(EngineDeadError):
            await llm.wait_idle()
        await llm.shutdown()
        return llm.error, reasons, late

    error, reasons, late = asyncio.run(main())
    assert "Overflow when unpacking long" in error and reasons == [error] and late == [error]


def test_a_dead_engine_fails_its_requests_then_health_and_new_requests_are_503(model_path):
    llm = AsyncLLM(config(model_path), process=True)
    with LiveServer(build_app(llm, [MODEL])) as live:
        async def main():
            client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
            whole = asyncio.create_task(client.completions.create(
                model=MODEL, prompt="Chitu serves", max_tokens=480, extra_body={"ignore_eos": True}))
            body = {"model": MODEL, "prompt": "Chitu streams", "max_tokens": 480, "stream": True, "ignore_eos": True}
            async with (httpx.AsyncClient(timeout=30) as http,
                        http.stream("POST", live.url + "/v1/completions", json=body) as r):
                assert r.status_code == 200
                lines = r.aiter_lines()
                events = [await anext(lines) for _ in range(4)]  # blank lines between events included
                deadline = time.monotonic() + 10
                while llm.stats().num_running < 2:  # both requests are running in the engine
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
                llm._process.kill()
                events += [line async for line in lines]
            with pytest.raises(openai.InternalServerError) as dead:
                await whole
            await client.close()
            return [e for e in events if e], dead.value

        events, dead = asyncio.run(main())
        reason = "the engine process exited (killed by SIGKILL)"
        assert dead.status_code == 500 and dead.body == {
            "message": f"the engine failed: {reason}", "type": "server_error", "param": None, "code": "engine_failed"}
        assert all(e.startswith("data: {") for e in events) and "data: [DONE]" not in events
        assert json.loads(events[-1][6:]) == {"error": dead.body}
        assert all("error" not in json.loads(e[6:]) for e in events[:-1])

        health = httpx.get(live.url + "/health")
        assert health.status_code == 503
        assert health.json() == {"status": "failed", "reason": f"the engine failed: {reason}"}
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as later:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert later.value.status_code == 503 and later.value.body == {
            "message": f"the engine failed, and this server must be restarted: {reason}", "type": "server_error",
            "param": None, "code": "engine_failed"}
    asyncio.run(llm.shutdown())


def engine_children(pid: int) -> list[int]:
    """The multiprocessing spawn children of ``pid`` (not its resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                children.append(int(child))
    return children


def test_serve_exits_non_zero_when_its_engine_dies(model_path, tmp_path):
    port, log_path = free_port(), tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "chitu_core.serve", "--model", str(model_path), "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--log-level", "warning", "--engine-process"]
    env = {**os.environ, "CHITU_LOAD_PROGRESS": "false"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(port, [(proc, log_path)])
        [engine] = engine_children(proc.pid)
        os.kill(engine, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    errors = [line for line in log_path.read_text().splitlines() if line.startswith("ERROR")]
    reason = "the engine process exited (killed by SIGKILL)"
    assert errors == [f"ERROR chitu_core.serve: exiting: the engine failed: {reason}"]
