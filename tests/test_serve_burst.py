"""What a burst of requests meets on its way to the engine, over loopback: no request waits for a
thread of FastAPI's pool, the server's heap is frozen once it serves (a full collection of it paused
the server's loop for 110-140 ms mid-burst), and bench serve's client processes each send their
share of a burst together (a fresh client's first request held the rest back)."""

import argparse
import gc
import json
import threading
import time

import fastapi.dependencies.utils as fastapi_dependencies
import fastapi.routing as fastapi_routing
import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from chitu_core.bench.serve_clients import gather_in_processes
from chitu_core.server.app import build_app
from serving import LiveServer, chat_engine

MODEL = "tiny-burst"
KEY = "sk-burst"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with chat_engine(tmp_path_factory.mktemp("burst-llama")) as engine:  # vocab 512
        yield engine


def test_no_request_goes_through_the_thread_pool(llm, monkeypatch):
    """FastAPI runs a plain ``def`` dependency or endpoint in its thread pool: a thread hop, and a
    thread start while the pool grows, for every request of a burst (the server's loop spent
    0.37-0.43 ms of CPU a request of a 64-request burst with the hop, 0.29-0.36 without; 2-core CPU).
    With API keys set, so that the key check runs too."""
    hops = []

    def counted(func, *args, **kwargs):
        hops.append(getattr(func, "__name__", repr(func)))
        return run_in_threadpool(func, *args, **kwargs)

    monkeypatch.setattr(fastapi_dependencies, "run_in_threadpool", counted)
    monkeypatch.setattr(fastapi_routing, "run_in_threadpool", counted)
    with LiveServer(build_app(llm, [MODEL], api_keys=[KEY])) as live:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(live.url + "/v1/models", headers=auth).status_code == 200
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
        assert httpx.post(live.url + "/v1/completions", json=body, headers=auth).status_code == 200
        streamed = httpx.post(live.url + "/v1/completions", json={**body, "stream": True}, headers=auth)
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(live.url + "/v1/chat/completions", json=chat, headers=auth).status_code == 200
        assert httpx.post(live.url + "/tokenize", json={"prompt": "hi"}, headers=auth).status_code == 200
        assert httpx.post(live.url + "/v1/completions", json=body).status_code == 401
    assert hops == []


def test_the_server_freezes_its_heap_when_it_starts_serving(llm):
    gc.unfreeze()
    config = uvicorn.Config(build_app(llm, [MODEL]), host="127.0.0.1", port=0, lifespan="on", log_level="warning",
                            log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        assert gc.get_freeze_count() > 0
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        gc.unfreeze()  # the rest of the test run collects as before


def recording_server(calls: list) -> FastAPI:
    """A stub OpenAI-style server that records each request's method and path, in arrival order, and
    streams two tokens for every completion."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        calls.append("GET /v1/models")
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions():
        calls.append("POST /v1/completions")
        event = "data: " + json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": "x"}]}) + "\n\n"
        return PlainTextResponse(event * 2 + "data: [DONE]\n\n", media_type="text/event-stream")

    return app


def test_client_processes_warm_up_before_they_start_together():
    """Each client process's first request is a GET before the barrier (a fresh client's first
    request imports its transport while it holds the loop); the level's requests all come after."""
    calls: list[str] = []
    with LiveServer(recording_server(calls)) as live:
        args = argparse.Namespace(base_url=live.url, model="stub", endpoint="completions", api_key=None, timeout=60.0)
        results, _, _ = gather_in_processes(args, [[1, 2, 3]] * 4, concurrency=4, output_len=2, procs=2)
    assert [r.ok for r in results] == [True] * 4
    assert calls == ["GET /v1/models"] * 2 + ["POST /v1/completions"] * 4
