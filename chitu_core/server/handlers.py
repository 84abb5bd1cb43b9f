"""Turning OpenAI requests into engine requests, and engine outputs into OpenAI responses."""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from chitu_core.engine.async_engine import AsyncLLM, EngineDeadError
from chitu_core.engine.outputs import RequestOutput
from chitu_core.errors import ChituError
from chitu_core.sampling.params import SamplingParams, StructuredOutput
from chitu_core.server import schemas as s
from chitu_core.server import structured
from chitu_core.server.errors import bad_request, engine_failed


@dataclass
class Prepared:
    """One request's prompts (token ids), sampling params and bookkeeping."""

    request_id: str
    prompts: list[list[int]]
    texts: list[str | None]
    params: SamplingParams
    logprobs: int | None  # top logprobs per token, or None
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_field: str = "prompt"  # the request field a prompt the engine refuses is reported under
    echo: list[str] | None = None  # completions' echo: each prompt's text, to prepend to its choices
    choice_parser: Callable | None = None  # chat: makes a tools.ChoiceParser for each choice (None: text as is)

    def engine_ids(self) -> list[str]:
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]


def sampling_params(req: s._Request, max_tokens: int | None, prompt_len: int, max_model_len: int, logprobs: int | None,
                    constraint: StructuredOutput | None = None, constraint_param: str | None = None) -> SamplingParams:
    """The request's SamplingParams; 400 naming the field at fault. ``constraint``: one that server
    code attaches, from the request field ``constraint_param`` (else the request's response_format /
    guided_* field gives it, if any)."""
    param = constraint_param
    if constraint is None:
        constraint, param = structured.requested_constraint(req)
    if constraint is not None:
        structured.check_constraint(constraint, param)
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
        if max_tokens < 1:
            raise bad_request(f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
                              f"the model's context of {max_model_len} tokens", "messages", "context_length_exceeded")
    try:
        return SamplingParams(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
            frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty, seed=req.seed,
            stop=req.stop or [], stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            logit_bias=structured.logit_bias(req), structured_output=constraint,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(map(str, first["loc"])) or None
        raise bad_request(f"invalid request: {field or 'sampling parameters'}: {first['msg']}", field) from None


async def admit(llm: AsyncLLM, prep: Prepared, priority: int) -> list[AsyncIterator[RequestOutput]]:
    """Queue every prompt of a request; all or none. A prompt the engine refuses is a 400;
    an engine that failed is a 503."""
    streams = []
    try:
        for i, rid in enumerate(prep.engine_ids()):
            streams.append(await llm.add_request(prep.prompts[i], prep.params, rid, prep.texts[i], priority))
    except (ValueError, ChituError) as exc:
        for rid in prep.engine_ids()[: len(streams)]:
            llm.abort(rid)
        if isinstance(exc, EngineDeadError):
            raise engine_failed(503, str(exc)) from None
        code = "context_length_exceeded" if "max_model_len" in str(exc) else None
        param = "logit_bias" if str(exc).startswith("logit_bias") else prep.prompt_field
        raise bad_request(str(exc), param, code) from None
    return streams


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Deltas of every prompt of a request, as (prompt index, delta), in arrival order."""
    if len(streams) == 1:  # the common case: no tasks, no queue
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in streams[i]:
                await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def chat_logprobs(tokenizer, lps: list[dict[int, float]], tokens: list[int], top: int) -> s.ChatLogprobs:
    content = []
    for lp, tok in zip(lps, tokens):
        text = token_text(tokenizer, tok)
        tops = sorted(((t, v) for t, v in lp.items()), key=lambda kv: -kv[1])[:top] if top else []
        content.append(s.ChatTokenLogprob(
            token=text, logprob=lp[tok], bytes=list(text.encode()),
            top_logprobs=[s.TopLogprob(token=(x := token_text(tokenizer, t)), logprob=v, bytes=list(x.encode())) for t, v in tops],
        ))
    return s.ChatLogprobs(content=content)


def completion_logprobs(tokenizer, lps: list[dict[int, float]], tokens: list[int], top: int, offset: int) -> s.CompletionLogprobs:
    out = s.CompletionLogprobs()
    for lp, tok in zip(lps, tokens):
        text = token_text(tokenizer, tok)
        out.tokens.append(text)
        out.token_logprobs.append(lp[tok])
        out.top_logprobs.append({token_text(tokenizer, t): v for t, v in sorted(lp.items(), key=lambda kv: -kv[1])[:top]})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def sse(payload) -> str:
    body = payload.model_dump_json(exclude_unset=False) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"
