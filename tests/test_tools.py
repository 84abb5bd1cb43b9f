"""Tool calls and reasoning output through the real server and the real openai client.

On the tiny random chat model, a ``guided_regex`` that admits one text makes the model write
exactly a family's recorded output, so the server's parsing is checked end to end, whole and
streamed; "required" and a named tool_choice are enforced by constrained decoding, which random
weights could not satisfy by chance. Last, the issue's acceptance on the embedded SmolLM2.
"""

import asyncio
import json
import re

import openai
import pytest

from builders import build_chat_model
from chitu_core.config import EngineConfig
from chitu_core.engine.async_engine import AsyncLLM
from chitu_core.server.app import build_app
from serving import LiveServer, cpu_engine

MODEL = "tiny-chat"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hours"], "additionalProperties": False}}}


def weather_args_valid(args: dict) -> bool:
    return (set(args) == {"city", "unit"} and isinstance(args["city"], str)
            and re.fullmatch("[A-Z][a-z]{1,10}", args["city"]) is not None and args["unit"] in ("celsius", "fahrenheit"))


def time_args_valid(args: dict) -> bool:
    return set(args) == {"hours"} and type(args["hours"]) is int and 0 <= args["hours"] <= 23


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools-llama")
    build_chat_model(path)
    with cpu_engine(path) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(llm):
    with LiveServer(build_app(llm, [MODEL], reasoning_parser="qwen3", tool_call_parser="hermes")) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def forced(text: str) -> dict:
    """extra_body that makes the model write exactly ``text``."""
    pattern = "".join("\\n" if ch == "\n" else "\\" + ch if ch in "\\.^$*+?{}[]|()/-" else ch for ch in text)
    return {"guided_regex": pattern}


def streamed(client, **kw) -> tuple[str, str, dict, str]:
    """(reasoning, content, {index: [name, arguments, id]}, finish_reason) from a stream, checking
    that each call's first delta names it and later ones carry only arguments."""
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id.startswith("call_") and call.function.name and call.type == "function"
                calls[call.index] = [call.function.name, call.function.arguments or "", call.id]
            else:
                assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return reasoning, content, calls, reason


QWEN3 = "<think>\nThe user wants a sum.\n</think>\n\nIt is 4."


def test_reasoning_content_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=chat("2+2?"), max_tokens=60, extra_body=forced(QWEN3))
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.content) == ("The user wants a sum.\n", "It is 4.")
    assert streamed(client, **kw)[:2] == ("The user wants a sum.\n", "It is 4.")


HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def test_auto_tool_call_in_hermes_format_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=chat("Weather in Paris?"), tools=[WEATHER, TIME], max_tokens=200,
              extra_body=forced(HERMES))
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    reasoning, content, calls, reason = streamed(client, **kw)
    assert (reasoning, content, reason) == ("", "", "tool_calls")
    assert [(name, json.loads(args)) for name, args, _ in calls.values()] == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_reasoning_then_calls_and_parallel_tool_calls_false_keeps_the_first(client):
    two = "<think>\nNeed both.\n</think>\n\n" + HERMES + '\n<tool_call>\n{"name": "get_time", "arguments": {"hours": 3}}\n</tool_call>'
    for parallel, names in [(True, ["get_weather", "get_time"]), (False, ["get_weather"])]:
        kw = dict(model=MODEL, messages=chat("Weather and time?"), tools=[WEATHER, TIME], max_tokens=300,
                  parallel_tool_calls=parallel, extra_body=forced(two))
        message = client.chat.completions.create(**kw).choices[0].message
        assert message.reasoning_content == "Need both.\n" and [c.function.name for c in message.tool_calls] == names
        reasoning, content, calls, reason = streamed(client, **kw)
        assert (reasoning, content, reason, [c[0] for c in calls.values()]) == ("Need both.\n", "", "tool_calls", names)


def test_tool_choice_none_leaves_the_text_alone(client):
    kw = dict(model=MODEL, messages=chat("Weather?"), tools=[WEATHER], tool_choice="none", max_tokens=200,
              extra_body=forced(HERMES))
    choice = client.chat.completions.create(**kw).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (HERMES, None, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choice_are_enforced(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, check in [(named, {"get_time": time_args_valid}), ("required", {"get_weather": weather_args_valid,
                                                                                "get_time": time_args_valid})]:
        for seed in range(3):
            kw = dict(model=MODEL, messages=chat("What time is it?"), tools=[WEATHER, TIME], tool_choice=choice,
                      max_tokens=150, temperature=1.0, seed=seed)
            if stream:
                _, content, calls, reason = streamed(client, **kw)
                [(name, args, _)] = calls.values()
            else:
                reply = client.chat.completions.create(**kw).choices[0]
                content, reason = reply.message.content, reply.finish_reason
                assert reply.message.tool_calls, (reason, content)
                [call] = reply.message.tool_calls
                name, args = call.function.name, call.function.arguments
            assert reason == "tool_calls" and not content and name in check and check[name](json.loads(args)), args


def test_a_follow_up_with_the_tools_result_is_accepted(client):
    messages = chat("Weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4)
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], "tool_choice": "required"},
     "tools", 'Unsupported type "strin"'),
])
def test_bad_tool_requests_are_400s(server, body, param, words):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": chat("hi"), **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text


def test_auto_without_a_parser_is_a_400_that_names_the_flag(llm):
    import httpx

    with LiveServer(build_app(llm, [MODEL])) as live:
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": chat("hi"), "tools": [WEATHER]})
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"], r.text


TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
            "<call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}"
            "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}"
            "{% for t in tools or [] %}<tool {{ t.function.name }}>{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")


def test_tools_tool_messages_and_template_kwargs_reach_the_chat_template(server, llm):
    from chitu_core.server.schemas import ChatCompletionRequest

    state, tokenizer = server.server.config.app.state.chitu, llm.tokenizer
    body = ChatCompletionRequest.model_validate({
        "model": MODEL, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False},
        "messages": chat("Paris?") + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21"}]})
    saved, tokenizer.chat_template = tokenizer.chat_template, TEMPLATE
    try:
        _, text = state.chat_prompt(body)
    finally:
        tokenizer.chat_template = saved
    assert text == "[user]Paris?[assistant]<call call_1 get_weather Paris>[tool]21(call_1)<tool get_weather><think></think>"


# ----- the acceptance, on the embedded default -----


def test_the_embedded_default_calls_a_named_or_required_tool_with_valid_arguments(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CHITU_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    engine = AsyncLLM(EngineConfig(device="cpu", dtype="float32", max_model_len=512, load_progress=False))
    name = "SmolLM2-135M-Instruct"
    question = chat("What is the weather in Paris, in celsius?")
    named = {"type": "function", "function": {"name": "get_weather"}}
    try:
        with LiveServer(build_app(engine, [name])) as live:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused")
            kw = dict(model=name, messages=question, tools=[WEATHER, TIME], max_tokens=64, temperature=0.7)
            for choice, check in [(named, {"get_weather": weather_args_valid}),
                                  ("required", {"get_weather": weather_args_valid, "get_time": time_args_valid})]:
                reply = client.chat.completions.create(**kw, tool_choice=choice).choices[0]
                [call] = reply.message.tool_calls
                assert reply.finish_reason == "tool_calls" and call.function.name in check
                assert check[call.function.name](json.loads(call.function.arguments)), call.function.arguments
                _, content, calls, reason = streamed(client, **kw, tool_choice=choice)
                [(fn, args, _)] = calls.values()
                assert reason == "tool_calls" and not content and fn in check and check[fn](json.loads(args)), args
            follow_up = question + [
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
            answer = client.chat.completions.with_raw_response.create(model=name, messages=follow_up, tools=[WEATHER, TIME],
                                                                      tool_choice="none", max_tokens=16)
            assert answer.status_code == 200 and answer.parse().choices[0].message.content
    finally:
        asyncio.run(engine.shutdown())
