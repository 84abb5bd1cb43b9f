"""Tool-call parsers: a model family's tool-call syntax in the output -> OpenAI's tool_calls.

Each family's parser names the marker that opens its tool calls and how to read complete calls
from the text after it. Text before the marker is content (streamed as it comes, holding back
what may be the marker's start); after it, each call is released once complete, as two deltas:
its index, id and name, then its arguments (one JSON fragment). Text after the marker that is no
call (cut off, or not JSON) is content again at ``finish``, so nothing the model wrote is lost.

Formats (from each family's chat template and documentation):
- hermes (Qwen2.5/Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated.
- llama3_json (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}``, the whole output, maybe after
  ``<|python_tag|>``; several joined by ``;``.
- mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the marker may have been
  decoded away as a special token: an output that starts ``[{"name"`` counts too).
- deepseek_v3 (V3, R1): ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
  newline, a json code fence of the arguments, ``<｜tool▁call▁end｜>``; then ``<｜tool▁calls▁end｜>``.
"""

import json
import re
import uuid
from dataclasses import dataclass

from chitu_core.server.parsers.text import partial_tag


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""


@dataclass
class ToolCallDelta:
    """One streamed piece of a call: the first has id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def arguments_text(value) -> str | None:
    """A call's arguments as JSON text (models write an object, or a string of one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def call_from(obj, key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = arguments_text(obj.get(key, obj.get("arguments", {})))
    return ToolCall(obj["name"], args) if args is not None else None


class ToolCallParser:
    """Fed the output delta by delta: ``feed`` and ``finish`` return (content, [ToolCallDelta]);
    ``calls`` holds every complete call. Subclasses give ``markers`` and ``take``."""

    markers: tuple[str, ...] = ()
    at_start_only = False  # a marker counts only at the output's start (leading whitespace aside)

    def __init__(self):
        self.held, self.section = "", None  # section: the text from the marker on, once seen
        self.calls: list[ToolCall] = []
        self.looking = True  # a marker may still come

    def take(self, section: str, final: bool) -> tuple[list[ToolCall], str]:
        """Complete calls at the start of ``section`` (which starts with a marker, or is what
        follows a call) and what is left of it; ``final``: no more text comes."""
        raise NotImplementedError

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self.section is not None:
            self.section += delta
            return "", self.released(final=False)
        self.held += delta
        if not self.looking:
            return self.flush(), []
        if self.at_start_only:
            text = self.held.lstrip()
            if any(text.startswith(m) for m in self.markers):
                self.section, self.held = text, ""
                return "", self.released(final=False)
            if text and not any(m.startswith(text) for m in self.markers):
                self.looking = False
                return self.flush(), []
            return "", []
        found = [(self.held.find(m), m) for m in self.markers if m in self.held]
        if found:
            i = min(found)[0]
            content, self.section, self.held = self.held[:i], self.held[i:], ""
            return content, self.released(final=False)
        keep = max(partial_tag(self.held, m) for m in self.markers)
        content, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return content, []

    def flush(self) -> str:
        content, self.held = self.held, ""
        return content

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest, at the end of the output: text that is no complete call is content."""
        if self.section is None:
            return self.flush(), []
        deltas = self.released(final=True)
        rest, self.section = self.section, ""
        return (rest if rest.strip() else ""), deltas

    def released(self, final: bool) -> list[ToolCallDelta]:
        calls, self.section = self.take(self.section, final)
        deltas = []
        for call in calls:
            call.id = call_id()
            index = len(self.calls)
            self.calls.append(call)
            deltas += [ToolCallDelta(index, call.id, call.name, ""), ToolCallDelta(index, arguments=call.arguments)]
        return deltas

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole output at once (a fresh parser): (content, calls)."""
        c1, _ = self.feed(text)
        c2, _ = self.finish()
        return c1 + c2, self.calls


def load(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class HermesToolCallParser(ToolCallParser):
    markers = ("<tool_call>",)
    CALL = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.S)

    def take(self, section, final):
        calls = []
        while (m := self.CALL.match(section)) is not None and (call := call_from(load(m.group(1)))) is not None:
            calls.append(call)
            section = section[m.end():]
        return calls, section


class Llama3JsonToolCallParser(ToolCallParser):
    markers = ("<|python_tag|>", "{")
    at_start_only = True

    def take(self, section, final):
        if not final:  # one JSON value, or several joined by ";": read at the end
            return [], section
        body = section.removeprefix("<|python_tag|>")
        calls = [call_from(load(part), "parameters") for part in body.split(";")] if body.strip() else [None]
        return (calls, "") if None not in calls else ([], section)


class MistralToolCallParser(ToolCallParser):
    markers = ("[TOOL_CALLS]", "[{")
    at_start_only = True

    def take(self, section, final):
        if not final:
            return [], section
        value = load(section.removeprefix("[TOOL_CALLS]").strip())
        calls = [call_from(v) for v in value] if isinstance(value, list) and value else [None]
        return (calls, "") if None not in calls else ([], section)


class DeepSeekV3ToolCallParser(ToolCallParser):
    markers = ("<｜tool▁calls▁begin｜>",)
    CALL = re.compile(r"\s*(?:<｜tool▁calls▁begin｜>)?\s*<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(.*?)\n"
                      r"\s*```(?:json)?\s*(.*?)\s*```\s*<｜tool▁call▁end｜>", re.S)
    END = re.compile(r"\s*<｜tool▁calls▁end｜>(?:<｜end▁of▁sentence｜>)?\s*$")

    def take(self, section, final):
        calls = []
        while (m := self.CALL.match(section)) is not None:
            args = arguments_text(load(m.group(2)))
            if args is None:
                break
            calls.append(ToolCall(m.group(1).strip(), args))
            section = section[m.end():]
        if calls or self.calls:  # the closing marker (and end of sentence) is no content
            section = self.END.sub("", section)
        return calls, section


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolCallParser,
    "llama3_json": Llama3JsonToolCallParser,
    "mistral": MistralToolCallParser,
    "deepseek_v3": DeepSeekV3ToolCallParser,
}
