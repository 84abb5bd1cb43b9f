"""The defects issue 21 found by trying the server as a new user, one test each: /tokenize and
/detokenize, `echo`, an OpenAPI document that says what the server accepts and answers, metrics
labels that cannot grow without bound and count aborted and failed requests, error `param`s that
name a field, and a `--help` that tells how to run the server."""

import asyncio
import re
import subprocess
import sys
import time

import httpx
import jsonschema_rs  # comes with schemathesis (the [test] extra)
import openai
import pytest

from builders import build_chat_model
from chitu_core.config import EngineConfig
from chitu_core.engine.async_engine import AsyncLLM
from chitu_core.serve import load_config
from chitu_core.server.app import build_app
from serving import LiveServer, cpu_engine

MODEL = "tiny-chat"
KEY = "sk-defects"
CAPACITY = 8  # requests in flight before a 503


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("defects-llama")
    build_chat_model(path)
    return path


@pytest.fixture(scope="module")
def llm(model_path):
    with cpu_engine(model_path) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(llm):
    with LiveServer(build_app(llm, [MODEL], max_pending=CAPACITY)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


# ----- /tokenize and /detokenize (vLLM's shapes) -----


def test_tokenize_a_prompt_and_detokenize_it_back(server, llm):
    text = "The quick brown fox, Zürich"
    r = post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    ids = llm.tokenizer.encode(text)
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 512}
    back = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_applies_the_chat_template(server, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = post(server, "/tokenize", {"model": MODEL, "messages": messages})
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.status_code == 200 and r.json()["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
    bare = post(server, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False}).json()
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert bare["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
    # the count is what a chat completion of these messages reports as its prompt tokens
    usage = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == r.json()["count"]


def test_tokenize_errors_are_in_openai_shape(server, llm):
    assert error_of(post(server, "/tokenize", {"model": "gpt-5", "prompt": "x"}), 404)["code"] == "model_not_found"
    assert error_of(post(server, "/tokenize", {"model": MODEL}), 400)["param"] == "prompt"
    assert error_of(post(server, "/tokenize", {"model": MODEL, "prompt": ""}), 400)["param"] == "prompt"
    err = error_of(post(server, "/detokenize", {"model": MODEL, "tokens": [5, 100000]}), 400)
    assert err["param"] == "tokens" and "100000" in err["message"]
    assert error_of(post(server, "/detokenize", {"model": MODEL, "tokens": "5"}), 400)["param"] == "tokens"


def test_tokenize_needs_the_api_key_when_keys_are_set(llm):
    with LiveServer(build_app(llm, [MODEL], api_keys=[KEY])) as live:
        for path, body in (("/tokenize", {"model": MODEL, "prompt": "x"}), ("/detokenize", {"model": MODEL, "tokens": [5]})):
            assert error_of(post(live, path, body), 401)["code"] == "invalid_api_key"
            ok = httpx.post(live.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            assert ok.status_code == 200, ok.text


# ----- echo -----


def test_echo_prepends_the_prompt_to_every_choice(client, llm):
    tokenizer = llm.tokenizer
    kw = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt="The quick brown fox", **kw).choices[0].text
    echoed = client.completions.create(prompt="The quick brown fox", echo=True, n=2, **kw)
    assert [c.text for c in echoed.choices] == ["The quick brown fox" + plain] * 2
    assert echoed.usage.completion_tokens == 10  # the echo is not generated
    ids = [40, 41, 42]  # a prompt of token ids echoes as their text
    from_ids = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    assert from_ids == tokenizer.decode(ids) + client.completions.create(prompt=ids, **kw).choices[0].text


def test_echo_streams_the_prompt_first(server, client):
    kw = dict(model=MODEL, prompt=["Chitu serves", "Paris"], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(echo=True, **kw)
    chunks = [c for c in client.completions.create(echo=True, stream=True, **kw) if c.choices]
    assert [(c.choices[0].index, c.choices[0].text) for c in chunks[:2]] == [(0, "Chitu serves"), (1, "Paris")]
    for k in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == k) == whole.choices[k].text


def test_echo_with_logprobs_is_refused_not_ignored(server):
    body = {"model": MODEL, "prompt": "Paris", "max_tokens": 2, "echo": True, "logprobs": 1}
    err = error_of(post(server, "/v1/completions", body), 400)
    assert err["param"] == "echo" and "logprobs" in err["message"]


# ----- the OpenAPI document says what the server accepts and answers -----


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    return httpx.get(server.url + "/openapi.json").json()


def validator(doc: dict, name: str):
    return jsonschema_rs.validator_for({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


def test_openapi_declares_what_the_server_rejects(openapi, server):
    completion = validator(openapi, "CompletionRequest")
    assert completion.is_valid({"model": MODEL, "prompt": "x", "seed": 2**63 - 1, "stop": ["."], "top_k": -1})
    for bad in ({"prompt": ""}, {"prompt": []}, {"prompt": [[]]}, {"prompt": [""]}, {"prompt": "x", "stop": [""]},
                {"prompt": "x", "stop": ""}, {"prompt": "x", "seed": 2**63}, {"prompt": "x", "seed": -(2**63) - 1},
                {"prompt": "x", "top_k": -5}, {"prompt": "x", "n": 0}, {"prompt": "x", "logprobs": 21},
                {"prompt": "x", "temperature": 2.5}, {"prompt": "x", "top_p": 0}, {"prompt": [-1]}):
        body = {"model": MODEL, **bad}
        assert not completion.is_valid(body), bad
        assert post(server, "/v1/completions", body).status_code == 400, bad  # and the server agrees
    chat = validator(openapi, "ChatCompletionRequest")
    assert not chat.is_valid({"model": MODEL, "messages": []})
    assert not chat.is_valid({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": 2**63})


def test_openapi_declares_every_status_and_the_stream(openapi):
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    expected = {
        ("/v1/chat/completions", "post"): {"200", "400", "401", "404", "500", "503"},
        ("/v1/completions", "post"): {"200", "400", "401", "404", "500", "503"},
        ("/v1/models", "get"): {"200", "401"},
        ("/tokenize", "post"): {"200", "400", "401", "404"},
        ("/detokenize", "post"): {"200", "400", "401", "404"},
        ("/health", "get"): {"200", "503"},
    }
    for (path, method), codes in expected.items():
        responses = openapi["paths"][path][method]["responses"]
        assert set(responses) == codes, (path, sorted(responses))
        for code in codes - {"200"} - ({"503"} if path == "/health" else set()):
            assert responses[code]["content"] == error, (path, code)
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert set(openapi["paths"][path]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "HTTPValidationError" not in openapi["components"]["schemas"]  # no 422 is ever answered


# ----- metrics -----


def metric_lines(server, name: str) -> list[str]:
    return [line for line in httpx.get(server.url + "/metrics").text.splitlines() if line.startswith(name + "{")]


def counter(server, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in metric_lines(server, name):
        if line.startswith(f"{name}{{{want}}}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_unknown_paths_share_one_metrics_label(server):
    def endpoints() -> set[str]:
        return {line.split('endpoint="')[1].split('"')[0] for line in metric_lines(server, "chitu_requests_total")}

    httpx.get(server.url + "/v1/no-such-thing")
    before = endpoints()
    for i in range(50):
        assert httpx.get(server.url + f"/v1/nothing-{i}").status_code == 404
        assert httpx.post(server.url + f"/v1/chat/x{i}", json={}).status_code == 404
    assert endpoints() == before and not any("nothing" in e or "/x" in e for e in before), before


def test_an_aborted_stream_is_counted(server):
    before = counter(server, "chitu_requests_aborted_total", endpoint="/v1/completions")
    body = {"model": MODEL, "prompt": "Chitu serves", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line:
                break  # leave after the first event: the connection closes
    deadline = time.monotonic() + 10
    while counter(server, "chitu_requests_aborted_total", endpoint="/v1/completions") != before + 1:
        assert time.monotonic() < deadline, metric_lines(server, "chitu_requests_aborted_total")
        time.sleep(0.05)


def test_a_5xx_is_counted_as_failed(server):
    before = counter(server, "chitu_requests_failed_total", endpoint="/v1/completions")
    over = {"model": MODEL, "prompt": ["x"] * (CAPACITY + 1), "max_tokens": 1}  # more prompts than the server admits
    assert error_of(post(server, "/v1/completions", over), 503)["code"] == "server_overloaded"
    assert counter(server, "chitu_requests_failed_total", endpoint="/v1/completions") == before + 1
    assert counter(server, "chitu_requests_aborted_total", endpoint="/v1/models") == 0


def test_a_stream_that_ends_in_an_error_event_is_counted_as_failed(model_path):
    llm = AsyncLLM(EngineConfig(model=str(model_path), device="cpu", dtype="float32", load_progress=False), process=True)
    with LiveServer(build_app(llm, [MODEL])) as live:
        body = {"model": MODEL, "prompt": "Chitu streams", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            llm._process.kill()
            events = [line for line in lines if line]
        assert r.status_code == 200 and '"engine_failed"' in events[-1]
        assert counter(live, "chitu_requests_failed_total", endpoint="/v1/completions") == 1
        assert counter(live, "chitu_requests_aborted_total", endpoint="/v1/completions") == 0
    asyncio.run(llm.shutdown())


# ----- error params -----


def test_a_body_that_is_not_json_names_no_byte_offset(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "tiny-chat", oops}',
                   headers={"content-type": "application/json"}, timeout=30)
    err = error_of(r, 400)
    assert err["param"] is None and "the body is not valid JSON (" in err["message"], err


def test_a_prompt_of_the_wrong_type_names_the_prompt_not_a_union_member(server):
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": 5}), 400)
    assert err["param"] == "prompt" and "one of: str, list[int], list[str], list[list[int]]" in err["message"], err
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": [7, -1]}), 400)
    assert err["param"] == "prompt.1" and "greater than or equal to 0" in err["message"], err
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": ["a", ""]}), 400)
    assert err["param"] == "prompt" and "the prompt is empty" in err["message"], err


def test_a_context_length_error_names_the_prompt_field(server):
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}
    err = error_of(post(server, "/v1/chat/completions", long_chat), 400)
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded")
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": list(range(3, 500)), "max_tokens": 100}), 400)
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": [3, 100000]}), 400)
    assert err["param"] == "prompt" and "100000" in err["message"]


# ----- --help -----


def test_help_says_how_to_run_the_server():
    out = subprocess.run([sys.executable, "-m", "chitu_core.serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m chitu_core.serve "), out.stdout[:80]
    assert "(default: null)" not in out.stdout and "default factory" not in out.stdout and "{int,null}" not in out.stdout
    assert "--config-file PATH" in out.stdout
    api_key = out.stdout[out.stdout.index("--api-key"):]
    assert "--api-key KEY1 --api-key KEY2" in " ".join(api_key.split()), api_key[:400]
    options = re.split(r"\n  (?=-)", out.stdout.split("options:", 1)[1])
    assert all(o.count("(default") <= 1 for o in options), [o for o in options if o.count("(default") > 1]


def test_api_key_repeats(tmp_path):
    config = load_config(["--api-key", "a", "--api-key", "b:1"])
    assert config.api_key == ["a", "b:1"]
    file = tmp_path / "serve.toml"
    file.write_text('port = 9001\napi-key = ["c"]\n')
    config = load_config(["--config-file", str(file), "--port", "9002"])
    assert (config.port, config.api_key) == (9002, ["c"])


def test_the_default_model_name_keeps_a_directory_name_whole():
    from chitu_core.serve import default_model_name

    assert default_model_name("/models/llama-3.1-8b") == "llama-3.1-8b"  # not "llama-3"
    assert default_model_name("/models/Qwen2.5-7B-Instruct/") == "Qwen2.5-7B-Instruct"
    assert default_model_name("/models/smollm2-135m.Q4_1.gguf") == "smollm2-135m.Q4_1"
