"""Tool calls and reasoning in chat: what the template is given, what constrains the output,
and how each choice's output text becomes content, reasoning_content and tool_calls.

``tool_choice``: "none" (no calls; the template still sees the tools), "auto" (the model may
call: the family's parser, ``--tool-call-parser`` or guessed from the chat template, finds the
calls in its text), "required" or a named function (constrained decoding: the output is JSON
``{"name": ..., "arguments": {...}}`` whose arguments follow the function's parameters schema,
turned into one call directly, with no family parser).
"""

import json
from dataclasses import dataclass

from chitu_core.sampling.params import StructuredOutput
from chitu_core.server import schemas as s
from chitu_core.server.errors import bad_request
from chitu_core.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ToolCallDelta
from chitu_core.server.parsers.tools import ToolCall, arguments_text, call_id

# A marker in a chat template -> the tool-call parser of its family.
TEMPLATE_MARKERS = [("<tool_call>", "hermes"), ("tool▁calls▁begin", "deepseek_v3"),
                    ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json")]


def guess_tool_parser(chat_template: str | None) -> str | None:
    """The tool-call parser a chat template's own markers name, or None."""
    for marker, name in TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return None


def check_parser_name(kind: str, name: str | None) -> None:
    known = REASONING_PARSERS if kind == "reasoning" else TOOL_CALL_PARSERS
    if name is not None and name not in known:
        raise ValueError(f"--{kind}-parser {name!r}: unknown; choose one of {', '.join(known)}")


def template_messages(messages: list[s.ChatMessage]) -> list[dict]:
    """Messages as chat templates take them: a call's arguments as an object (as HF templates
    expect), tool results with their tool_call_id."""
    conv = []
    for m in messages:
        msg = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(arguments_text(c.function.arguments) or "{}")}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        conv.append(msg)
    return conv


def template_tools(body: s.ChatCompletionRequest) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def choice_of(body: s.ChatCompletionRequest) -> str | s.NamedToolChoice:
    choice = body.tool_choice or "auto"
    if choice == "auto" and not body.tools:
        return "none"
    if choice != "none" and not body.tools:
        raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} needs tools",
                          "tool_choice")
    return choice


def call_schema(function: s.FunctionDef) -> dict:
    """JSON Schema of one call of ``function``: its name, and arguments of its parameters schema."""
    params = function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_constraint(body: s.ChatCompletionRequest) -> StructuredOutput | None:
    """The constraint that enforces "required" or a named function; None otherwise."""
    choice = choice_of(body)
    if choice in ("none", "auto"):
        return None
    other = [f for f in ("response_format", "guided_regex", "guided_grammar") if getattr(body, f) is not None
             and (f != "response_format" or body.response_format.type != "text")]
    if other:
        raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} constrains the output "
                          f"to a tool call, so it cannot be combined with {other[0]}; send one of them", "tool_choice")
    if isinstance(choice, s.NamedToolChoice):
        named = [t.function for t in body.tools if t.function.name == choice.function.name]
        if not named:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                              f"tools ({', '.join(t.function.name for t in body.tools)})", "tool_choice.function.name")
        return StructuredOutput(json_schema=call_schema(named[0]))
    if choice == "required":
        schemas = [call_schema(t.function) for t in body.tools]
        return StructuredOutput(json_schema=schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    return None


@dataclass
class Piece:
    """What one delta of a choice's text adds to each field."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


class ChoiceParser:
    """One choice's output text -> reasoning, content and tool-call deltas. ``forced``: the output
    is a constrained call's JSON, read whole at the end."""

    def __init__(self, reasoning: str | None, tool_parser: str | None, forced: bool, parallel: bool):
        self.forced, self.parallel = forced, parallel
        self.reasoning = REASONING_PARSERS[reasoning]() if reasoning and not forced else None
        self.tools = TOOL_CALL_PARSERS[tool_parser]() if tool_parser and not forced else None
        self.text, self.calls = "", []

    def feed(self, delta: str) -> Piece:
        if self.forced:
            self.text += delta
            return Piece()
        reasoning, content = self.reasoning.feed(delta) if self.reasoning else ("", delta)
        return self.after_reasoning(reasoning, content, final=False)

    def finish(self) -> Piece:
        if self.forced:
            return self.forced_call()
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self.after_reasoning(reasoning, content, final=True)

    def after_reasoning(self, reasoning: str, content: str, final: bool) -> Piece:
        if self.tools is None:
            return Piece(reasoning, content)
        content, deltas = self.tools.feed(content) if content else ("", [])
        if final:
            rest, more = self.tools.finish()
            content, deltas = content + rest, deltas + more
        if not self.parallel:
            deltas = [d for d in deltas if d.index == 0]
        self.calls = self.tools.calls[:1] if not self.parallel else self.tools.calls
        return Piece(reasoning, content, tuple(deltas))

    def forced_call(self) -> Piece:
        try:
            value = json.loads(self.text)
            call = ToolCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False), call_id())
        except (json.JSONDecodeError, KeyError, TypeError):  # cut off by max_tokens: the text as it is
            return Piece(content=self.text)
        self.calls = [call]
        return Piece(calls=(ToolCallDelta(0, call.id, call.name, ""), ToolCallDelta(0, arguments=call.arguments)))


def delta_calls(deltas: tuple[ToolCallDelta, ...]) -> list[s.DeltaToolCall] | None:
    if not deltas:
        return None
    return [s.DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                            function=s.DeltaFunctionCall(name=d.name, arguments=d.arguments)) for d in deltas]


def message_calls(calls: list[ToolCall]) -> list[s.ToolCall] | None:
    return [s.ToolCall(id=c.id, function=s.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None
