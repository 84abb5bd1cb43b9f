"""/tokenize and /detokenize in vLLM's shapes: text or chat messages to token ids, and back.

    POST /tokenize    {"model", "prompt", "add_special_tokens": true}
                   or {"model", "messages", "add_generation_prompt": true, "add_special_tokens": false}
                   -> {"tokens": [...], "count": N, "max_model_len": M}
    POST /detokenize  {"model", "tokens": [...]} -> {"prompt": "..."}

Messages go through the chat template exactly as /v1/chat/completions renders them, so `count`
is the prompt_tokens a chat completion of them reports. `model` may be left out (this server's
model); an API key is needed as for /v1; errors are in OpenAI's shape.
"""

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from chitu_core.sampling.params import TokenId
from chitu_core.server.errors import bad_request
from chitu_core.server.openapi import errors
from chitu_core.server.schemas import ChatMessage, NonEmptyStr, integral


class TokenizeRequest(BaseModel):
    """A prompt, or chat messages (one of the two)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = None
    prompt: NonEmptyStr = Field(None, description="text to tokenize (or give messages)")
    messages: list[ChatMessage] = Field(None, min_length=1, description="a conversation, rendered by the chat template")
    add_generation_prompt: bool = Field(True, description="with messages: end with the assistant's turn opening")
    add_special_tokens: bool = Field(None, description="add the tokenizer's special tokens such as BOS "
                                     "(default: true with a prompt, false with messages, whose template adds them)")


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[TokenId]

    @field_validator("tokens", mode="before")
    @classmethod
    def _ints(cls, v):
        return integral(v)


class DetokenizeResponse(BaseModel):
    prompt: str


def add_tokenize_routes(app: FastAPI, state) -> None:
    """POST /tokenize and /detokenize on ``app``, for the model and tokenizer of ``state`` (ServerState)."""

    async def authorized(request: Request) -> int:  # a plain def would run in FastAPI's thread pool: a hop a request
        return state.priority(request)

    def tokenizer_of(model: str | None):
        if model is not None:
            state.check_model(model)
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer, so it cannot tokenize text")
        return state.tokenizer

    @app.post("/tokenize", responses=errors(400, 401, 404))
    async def tokenize(body: TokenizeRequest, _: int = Depends(authorized)) -> TokenizeResponse:
        tok = tokenizer_of(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either prompt (text) or messages (a conversation), not both nor neither", "prompt")
        if body.messages is not None:
            text = state.chat_text(body.messages, body.add_generation_prompt)
            ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.max_model_len)

    @app.post("/detokenize", responses=errors(400, 401, 404))
    async def detokenize(body: DetokenizeRequest, _: int = Depends(authorized)) -> DetokenizeResponse:
        tok = tokenizer_of(body.model)
        bad = [t for t in body.tokens if t >= len(tok)]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the tokenizer's vocabulary [0, {len(tok)})", "tokens")
        return DetokenizeResponse(prompt=tok.decode(body.tokens))
