"""Request and response bodies of the OpenAI API subset we serve, as pydantic models.

Unknown fields are ignored (as OpenAI's own server does), wrong types are 400s, and so are
NaN and Infinity (which Python's JSON parser accepts). Types are JSON Schema's, as the OpenAPI
document states them: "16" is no integer and 0 no boolean (pydantic's strict mode), but 16.0 is
an integer. SamplingParams checks again what keeps an engine step from raising (int64 seeds and token ids, top_k >= -1); the bounds are declared here
too, so that the OpenAPI document states every constraint the server enforces.
Our extensions to OpenAI's sampling fields: top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, priority is not one (it comes from the API key).
"""

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chitu_core.sampling.params import INT64_MAX, INT64_MIN, TokenId

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def integral(v):
    """JSON Schema's integers include 16.0, which pydantic's strict mode refuses: make it 16 (in lists too).
    A list of ints (a prompt of token ids) is returned as it is, its types checked in one C-level pass."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return v if _all_ints(v) else [integral(x) for x in v]
    return v


def _all_ints(v: list) -> bool:
    return set(map(type, v)) <= {int}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,18}$")], Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (a string, as OpenAI) -> bias in [-100, 100]",
        json_schema_extra={"propertyNames": {"pattern": r"^[0-9]{1,18}$"}})  # every key, not only those patternProperties names
    response_format: "ResponseFormat | None" = None
    # Extensions (vLLM's names).
    top_k: int = Field(0, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    guided_regex: str | None = Field(None, description="the output fullmatches this regex")
    guided_grammar: str | None = Field(None, description="the output follows this EBNF grammar (GBNF; start rule root)")

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v):  # before the type's own checks, for one message that says what stop takes
        stops = [v] if isinstance(v, str) else v
        if isinstance(stops, list) and (len(stops) > 16 or any(s == "" for s in stops)):
            raise ValueError("stop takes at most 16 non-empty strings")
        return stops

    @field_validator("max_tokens", "n", "seed", "top_k", "min_tokens", "stop_token_ids", mode="before")
    @classmethod
    def _request_ints(cls, v):
        return integral(v)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True)  # JSON Schema's types, as _Request's

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="the output always follows the schema strictly, whatever this says")


class ResponseFormat(BaseModel):
    """OpenAI's response_format (structured output): text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(strict=True, json_schema_extra={  # as structured.py requires
        "if": {"properties": {"type": {"const": "json_schema"}}}, "then": {"required": ["json_schema"], "properties": {
            "json_schema": {"type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of the arguments (an object)")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True)

    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments (an object)")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: NonEmptyStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message's: the call it answers")
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list) and any(p.get("type") == "text" and not isinstance(p.get("text", ""), str) for p in v):
            raise ValueError("a text content part's text must be a string")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Request):
    # What the server refuses with a 400: "required" or a named function (enforced by a constraint of
    # their own) without tools, or with another output constraint.
    model_config = ConfigDict(json_schema_extra={
        "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}}},
        "then": {"required": ["tools"], "properties": {
            "tools": {"type": "array", "minItems": 1},
            "response_format": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]},
            "guided_regex": {"type": "null"}, "guided_grammar": {"type": "null"}}}})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='default "auto" with tools, "none" without; "required" and a named function need tools')
    parallel_tool_calls: bool = Field(True, description="false: at most one call")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the model's chat template, e.g. {\"enable_thinking\": false}")

    @field_validator("max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _chat_ints(cls, v):
        return integral(v)


class CompletionRequest(_Request):
    model_config = ConfigDict(json_schema_extra={  # what the server refuses with a 400
        "not": {"required": ["echo", "logprobs"], "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}}}})

    prompt: NonEmptyStr | TokenIds | Annotated[list[NonEmptyStr], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="prepend the prompt to each choice's text (not with logprobs)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _not_empty(cls, v):  # before the union's checks, whose messages would name each of its types
        if v == "" or v == [] or (isinstance(v, list) and not _all_ints(v) and any(p == "" or p == [] for p in v)):
            raise ValueError("the prompt is empty; give a non-empty string, list of token ids, or list of either")
        return integral(v)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _completion_ints(cls, v):
        return integral(v)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "chitu"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "failed"]
    reason: str | None = Field(None, description="why the engine failed (with status failed)")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


_Request.model_rebuild()


# --- responses ---------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, description="the model's reasoning (with --reasoning-parser)")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a call: the first of each has id, type and name; later ones arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
