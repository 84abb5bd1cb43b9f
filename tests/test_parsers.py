"""Reasoning and tool-call parsers on hand-written outputs in each family's published format,
whole and streamed: split at every point into two deltas and at every pair of points into three,
so every tag is split across deltas somewhere, and the result must not depend on the split."""

import json
from itertools import combinations

import pytest

from chitu_core.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS


def splits(text: str):
    """``text`` whole, in two deltas at every point, and in three at every pair of points."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i, j in combinations(range(1, len(text)), 2):
        yield [text[:i], text[i:j], text[j:]]


def stream_reasoning(name: str, deltas: list[str]) -> tuple[str, str]:
    parser = REASONING_PARSERS[name]()
    pieces = [parser.feed(d) for d in deltas] + [parser.finish()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


REASONING = [
    # DeepSeek-R1: the template opened <think> in the prompt.
    ("deepseek_r1", "Okay, 2+2.\nIt is 4.\n</think>\n\nThe answer is 4.", ("Okay, 2+2.\nIt is 4.\n", "The answer is 4.")),
    # R1 writing <think> itself (older templates).
    ("deepseek_r1", "<think>\nhmm <b>\n</think>\n\n**4**", ("hmm <b>\n", "**4**")),
    # R1 cut off by max_tokens inside its reasoning.
    ("deepseek_r1", "Let me think about </thi", ("Let me think about </thi", "")),
    # Qwen3 with thinking.
    ("qwen3", "<think>\nThe user greets.\n</think>\n\nHello! <3", ("The user greets.\n", "Hello! <3")),
    # Qwen3 with enable_thinking false: no tags at all.
    ("qwen3", "Hello! a<b and </think> stays", ("", "Hello! a<b and </think> stays")),
    # Qwen3 output that is only a tag's start.
    ("qwen3", "<th", ("", "<th")),
]


@pytest.mark.parametrize("name,text,expected", REASONING)
def test_reasoning_whole_and_streamed(name, text, expected):
    assert REASONING_PARSERS[name]().parse(text) == expected
    for deltas in splits(text):
        assert stream_reasoning(name, deltas) == expected, deltas


def test_reasoning_is_released_before_the_end():
    parser = REASONING_PARSERS["qwen3"]()
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>\nstep one </th") == ("step one ", "")
    assert parser.feed("ink>\n\nDone") == ("", "Done")
    assert parser.finish() == ("", "")


WEATHER = {"city": "Paris", "unit": "celsius"}
TOOLS = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     "", [("get_weather", WEATHER)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; {"name": "f", "parameters": {}}',
     "", [("get_weather", WEATHER), ("f", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     "", [("get_weather", WEATHER)]),
    ("mistral", '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}]',
     "", [("get_weather", WEATHER)]),
    ("deepseek_v3", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                    '```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Sure.", [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    # No call: all content, whatever looks like a tag's start.
    ("hermes", "a <tool b", "a <tool b", []),
    ("llama3_json", "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    # A cut-off call is content, as written.
    ("hermes", 'ok <tool_call>{"name": "f", "argu', 'ok <tool_call>{"name": "f", "argu', []),
    ("mistral", '[TOOL_CALLS][{"name": "f"', '[TOOL_CALLS][{"name": "f"', []),
]


def stream_tools(name: str, deltas: list[str]):
    parser = TOOL_CALL_PARSERS[name]()
    pieces = [parser.feed(d) for d in deltas] + [parser.finish()]
    content = "".join(c for c, _ in pieces)
    calls: dict[int, dict] = {}
    for _, tool_deltas in pieces:
        for d in tool_deltas:
            if d.index not in calls:  # the first delta of a call names it
                assert d.id.startswith("call_") and d.name and d.arguments == ""
                calls[d.index] = {"name": d.name, "arguments": ""}
            else:
                assert d.id is None and d.name is None
            calls[d.index]["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("name,text,content,calls", TOOLS)
def test_tool_calls_whole_and_streamed(name, text, content, calls):
    got_content, got_calls = TOOL_CALL_PARSERS[name]().parse(text)
    assert (got_content, [(c.name, json.loads(c.arguments)) for c in got_calls]) == (content, calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    step = max(1, len(text) // 40)  # three deltas at every pair of points is n^2: thin the long texts
    for deltas in splits(text) if len(text) < 90 else (d for k, d in enumerate(splits(text)) if k % step == 0 or len(d) < 3):
        assert stream_tools(name, deltas) == (content, calls), deltas


def test_hermes_call_is_released_when_it_closes():
    parser = TOOL_CALL_PARSERS["hermes"]()
    assert parser.feed("Hi <tool_") == ("Hi ", [])
    assert parser.feed('call>{"name": "f", "arguments": {"x": 1}}</tool_') == ("", [])
    content, deltas = parser.feed("call>")
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", ""), (0, None, '{"x": 1}')]
