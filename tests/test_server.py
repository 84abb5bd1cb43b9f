"""The OpenAI-compatible server, driven over loopback by the official openai client and raw HTTP."""

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest

from builders import build_chat_model
from chitu_core.engine.async_engine import AsyncLLM
from chitu_core.server.app import build_app
from serving import LiveServer, cpu_engine

MODEL = "tiny-chat"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-llama")
    build_chat_model(path)
    with cpu_engine(path) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(llm):
    with LiveServer(build_app(llm, [MODEL], max_pending=64)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def pool_is_full(llm: AsyncLLM, timeout: float = 10.0) -> bool:
    """The KV pool drains (all blocks free) within ``timeout``."""
    bm = llm.engine.block_manager
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if bm.num_free == bm.num_blocks and not llm.engine.requests:
            return True
        time.sleep(0.02)
    return False


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_completion_with_usage(client, llm):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    tok = llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 8 and r.usage.total_tokens == len(prompt_ids) + 8
    assert pool_is_full(llm)


def test_completion_text_and_token_prompts_agree(client):
    a = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert a.object == "text_completion" and a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 6


def test_n_logprobs_and_seed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=1.0, seed=7,
              n=2, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    r1, r2 = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in r1.choices] == [0, 1]
    assert [c.message.content for c in r1.choices] == [c.message.content for c in r2.choices]
    for c in r1.choices:
        content = c.logprobs.content
        assert len(content) == 5
        for entry in content:
            assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
            assert entry.bytes == list(entry.token.encode())
    comp = client.completions.create(model=MODEL, prompt="Paris", max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == comp.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_stop_string(client):
    base = dict(model=MODEL, prompt="The quick brown fox", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    stop = full[3:6]
    cut = client.completions.create(**base, stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_streaming_chat_with_usage(client, llm):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=9,
              temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert pool_is_full(llm)


def test_async_streaming_completions(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        async def one(i):
            stream = await client.completions.create(model=MODEL, prompt=f"Chitu {i}", max_tokens=5 + i, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return [c async for c in stream]
        results = await asyncio.gather(*(one(i) for i in range(4)))
        await client.close()
        return results

    for i, chunks in enumerate(asyncio.run(main())):
        assert chunks[-1].choices[0].finish_reason == "length"
        assert len([c for c in chunks if c.choices and c.choices[0].text]) <= 5 + i


def test_raw_sse_ends_with_done(server):
    body = {"model": MODEL, "prompt": "Zürich", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


BAD = [
    ("not json", b"{oops", "invalid request"),
    ("wrong type", {"model": MODEL, "messages": "hi"}, "messages"),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("negative max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    ("temperature type", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ("too long", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, "max_model_len"),
    ("empty messages", {"model": MODEL, "messages": []}, "messages"),
    ("top_p", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
]


@pytest.mark.parametrize("name,body,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_in_openai_shape(server, name, body, fragment):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, **kwargs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert fragment in err["message"] or fragment == err["param"]


def test_long_prompt_with_max_tokens_over_context_is_400(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": list(range(3, 500)), "max_tokens": 100}, timeout=30)
    assert r.status_code == 400 and "max_model_len=512" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
    assert exc.value.body["code"] == "model_not_found" and MODEL in exc.value.body["message"]


def test_mid_stream_disconnect_aborts_and_frees_blocks(server, llm):
    body = {"model": MODEL, "prompt": "Chitu serves", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            seen += bool(line)
            if seen == 3:
                break  # leave mid-stream: the connection closes
    assert pool_is_full(llm)


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=2, extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    for name in ("chitu_requests_total", "chitu_generation_tokens_total", "chitu_time_to_first_token_seconds_bucket",
                 "chitu_time_per_output_token_seconds_bucket", "chitu_kv_cache_usage_ratio", "chitu_queue_length"):
        assert name in text, name
    assert 'chitu_requests_total{endpoint="/v1/completions",status="200"}' in text


def test_api_keys(llm):
    with LiveServer(build_app(llm, [MODEL], api_keys=[KEY + ":2", "other"])) as live:
        r = httpx.get(live.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        good = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY)
        assert [m.id for m in good.models.list().data] == [MODEL]
        r = good.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="nope").models.list()
        assert httpx.get(live.url + "/health").status_code == 200  # not under /v1


def test_queue_full_is_503(llm):
    with LiveServer(build_app(llm, [MODEL], max_pending=1)) as live:
        async def main():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                body = {"model": MODEL, "prompt": "busy", "max_tokens": 500, "ignore_eos": True}
                first = asyncio.create_task(http.post("/v1/completions", json=body))
                while llm.stats().num_running == 0:  # the first is in the engine: 500 steps to go
                    await asyncio.sleep(0.001)
                second = await http.post("/v1/completions", json={**body, "max_tokens": 2})
                return (await first), second
        first, second = asyncio.run(main())
    assert first.status_code == 200
    assert second.status_code == 503 and second.json()["error"]["code"] == "server_overloaded"


def test_64_concurrent_streams_a_quarter_cancelled(server, llm, caplog):
    caplog.set_level(logging.WARNING)

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(i: int):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Tell me about {i}"}], max_tokens=24 + i % 7,
                temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True})
            chunks, reason = 0, "no finish"
            async for chunk in stream:
                chunks += 1
                if i % 4 == 0 and chunks == 4:
                    break  # this client goes away mid-stream
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
            await stream.close()
            return None if i % 4 == 0 else (reason, chunks)

        results = await asyncio.gather(*(one(i) for i in range(64)))
        await client.close()
        return results

    results = asyncio.run(main())
    finished = [r for r in results if r is not None]
    assert len(finished) == 48 and all(reason == "length" for reason, _ in finished)
    assert pool_is_full(llm)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_config_precedence_flags_env_file(tmp_path, monkeypatch):
    from chitu_core.serve import load_config

    file = tmp_path / "chitu.toml"
    file.write_text('port = 9001\nmax_num_seqs = 3\nhost = "0.0.0.0"\napi_key = ["k1:2"]\n')
    monkeypatch.setenv("CHITU_MAX_NUM_SEQS", "5")
    config = load_config(["--config-file", str(file), "--host", "127.0.0.2"])
    assert (config.port, config.max_num_seqs, config.host, config.api_key) == (9001, 5, "127.0.0.2", ["k1:2"])
    assert load_config([]).port == 8000
    with pytest.raises(SystemExit):
        load_config(["--config-file", str(tmp_path / "absent.toml")])
