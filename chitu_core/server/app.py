"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions, /v1/models, plus /health and /metrics,
/tokenize and /detokenize (tokenize.py), the chat page (page.py) and this server's OpenAPI document (openapi.py).

Every /v1 route checks the API key (when keys are configured) and the model
name, admits the request against the server's queue capacity, hands it to the
AsyncLLM and answers with one JSON body or an SSE stream ending in
``data: [DONE]``. A client that disconnects mid-stream aborts its request. Chat replies go through
tools.py: reasoning_content (--reasoning-parser) and tool_calls (--tool-call-parser, or "required"
and a named tool_choice enforced by constrained decoding).

When the engine fails, the requests it was running get a 500 (a stream that has begun gets one
``data: {"error": ...}`` event instead of ``[DONE]``), later ones a 503, and /health a 503 that
says why: the engine does not come back, so whoever runs the server should restart it.
"""

import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chitu_core.engine.async_engine import AsyncLLM, EngineDeadError
from chitu_core.engine.core import freeze_heap
from chitu_core.server import schemas as s
from chitu_core.server import tools
from chitu_core.server.errors import APIError, bad_request, engine_failed, invalid_request
from chitu_core.server.handlers import Prepared, admit, chat_logprobs, completion_logprobs, merged, sampling_params, sse
from chitu_core.server.metrics import ServerMetrics, route_label
from chitu_core.server.openapi import errors, streamed, tailor
from chitu_core.server.page import add_chat_page
from chitu_core.server.tokenize import add_tokenize_routes
from chitu_core.server.tools import template_messages

log = logging.getLogger(__name__)


def parse_api_keys(specs: list[str]) -> list[tuple[bytes, int]]:
    """"KEY" or "KEY:PRIORITY" (lower runs first; default 0) -> (key bytes, priority)."""
    keys = []
    for spec in specs:
        key, sep, prio = spec.rpartition(":") if ":" in spec else (spec, "", "0")
        if not key or not prio.lstrip("-").isdigit():
            raise ValueError(f"--api-key {spec!r}: expected KEY or KEY:PRIORITY with an integer priority")
        keys.append((key.encode(), int(prio)))
    return keys


class ServerState:
    def __init__(self, llm: AsyncLLM, served_names: list[str], api_keys: list[str], max_pending: int,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None):
        self.llm, self.tokenizer = llm, llm.tokenizer
        tools.check_parser_name("reasoning", reasoning_parser)
        tools.check_parser_name("tool-call", tool_call_parser)
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser or tools.guess_tool_parser(getattr(self.tokenizer, "chat_template", None))
        self.served_names = served_names
        self.keys = parse_api_keys(api_keys)
        self.max_pending, self.pending = max_pending, 0
        self.max_model_len = llm.max_model_len
        self.metrics = ServerMetrics(llm.stats, max_pending, lambda: self.pending)

    def check_model(self, name: str) -> None:
        if name not in self.served_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {', '.join(self.served_names)}",
                           "invalid_request_error", "model", "model_not_found")

    def priority(self, request: Request) -> int:
        """The caller's priority from its API key; 401 without a valid one (when keys are set)."""
        if not self.keys:
            return 0
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        match = None
        for key, prio in self.keys:  # compare with every key, in constant time each
            if hmac.compare_digest(given, key) and match is None:
                match = prio
        if match is None:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", None, "invalid_api_key")
        return match

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids as the prompt", "prompt")
        return self.tokenizer.encode(text)

    def chat_prompt(self, body: s.ChatCompletionRequest) -> tuple[list[int], str]:
        text = self.chat_text(body.messages, tools=tools.template_tools(body), template_kwargs=body.chat_template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False), text

    def chat_text(self, messages: list[s.ChatMessage], add_generation_prompt: bool = True,
                  tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """The messages (and tools, and the request's chat_template_kwargs) rendered by the model's
        chat template (as /v1/chat/completions and /tokenize see them)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        conv = template_messages(messages)
        kwargs = {k: v for k, v in (template_kwargs or {}).items()
                  if k not in ("conversation", "tools", "tokenize", "add_generation_prompt")}
        try:
            return self.tokenizer.apply_chat_template(conv, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # a template that rejects this conversation (e.g. role order)
            raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None


@asynccontextmanager
async def _serving(_app: FastAPI) -> AsyncIterator[None]:
    """The server's lifespan: what is alive when it starts serving (the engine, or its client, and the
    app) stays so until it stops, so the collector stops scanning it (``freeze_heap``)."""
    freeze_heap()
    yield


FAILED_MID_STREAM = "chitu.failed_mid_stream"  # set in a request's scope by a stream that ended in an error event


class RequestCounter:
    """Counts HTTP requests by route template and status, and those that failed (a 5xx, or a
    stream's error event) or were aborted (the response never completed: the client left
    mid-stream). A plain ASGI middleware:
    Starlette's ``BaseHTTPMiddleware`` would pass every streamed chunk through a task and a memory
    stream of its own (a quarter of the server's CPU time at 64 streams)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/metrics":
            return await self.app(scope, receive, send)
        status, complete = 500, False  # what the client gets if the app fails before it answers

        async def counting_send(message):
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:  # the router has put the matched route into the scope
            failed = status >= 500 or scope.get(FAILED_MID_STREAM, False)
            self.metrics.count(route_label(scope), str(status), failed=failed, aborted=not complete)


def build_app(llm: AsyncLLM, served_names: list[str], api_keys: list[str] = (), max_pending: int = 1024,
              reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """The app; ``reasoning_parser``/``tool_call_parser``: names from chitu_core.server.parsers
    (the tool-call parser is otherwise guessed from the chat template's markers, if any)."""
    state = ServerState(llm, served_names, list(api_keys), max_pending, reasoning_parser, tool_call_parser)
    app = FastAPI(title="chitu-core", description="OpenAI-compatible LLM server", lifespan=_serving)
    app.state.chitu = state
    add_chat_page(app)  # the chat page at /

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return invalid_request(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):  # 404, 405 (its Allow header kept)
        return APIError(exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, exc: EngineDeadError):  # the engine failed under a request it was running
        return engine_failed(500, str(exc)).response()

    @app.exception_handler(Exception)
    async def _bug(_, exc: Exception):  # Starlette logs the traceback after this answers
        return APIError(500, f"internal server error: {type(exc).__name__}", "server_error").response()

    app.add_middleware(RequestCounter, metrics=state.metrics)

    async def authorized(request: Request) -> int:  # a plain def would run in FastAPI's thread pool: a hop a request
        return state.priority(request)

    @app.get("/health", response_model_exclude_none=True,
             responses={503: {"model": s.Health, "description": "The engine has failed; restart the server."}})
    async def health() -> s.Health:
        if state.llm.error is not None:
            reason = f"the engine failed: {state.llm.error}"
            return JSONResponse({"status": "failed", "reason": reason}, status_code=503)
        return s.Health(status="ok")

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain; version=0.0.4": {"schema": {"type": "string"}}}}})
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=errors(401))
    async def models(_: int = Depends(authorized)) -> s.ModelList:
        return s.ModelList(data=[s.ModelCard(id=n, max_model_len=state.max_model_len) for n in state.served_names])

    generation_errors = errors(400, 401, 404, 500, 503)

    @app.post("/v1/chat/completions", responses={
        **streamed(s.ChatCompletion, s.ChatCompletionChunk, "`ChatCompletionChunk`s, then `[DONE]`"), **generation_errors})
    async def chat(body: s.ChatCompletionRequest, request: Request, priority: int = Depends(authorized)):
        state.check_model(body.model)
        constraint = tools.tool_constraint(body)
        choice = tools.choice_of(body)
        if choice == "auto" and state.tool_call_parser is None:
            raise bad_request('tool_choice "auto" needs a tool-call parser: start the server with --tool-call-parser '
                              f'(one of {", ".join(tools.TOOL_CALL_PARSERS)}), or send tool_choice "required" or a '
                              'named function', "tool_choice")
        ids, text = state.chat_prompt(body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, body.max_completion_tokens or body.max_tokens, len(ids), state.max_model_len, top,
                                 constraint, "tools")
        prep = Prepared(f"chatcmpl-{uuid.uuid4().hex}", [ids], [text], params, top, prompt_field="messages")
        tool_parser = state.tool_call_parser if choice == "auto" else None
        if state.reasoning_parser or tool_parser or constraint is not None:
            prep.choice_parser = lambda: tools.ChoiceParser(state.reasoning_parser, tool_parser, constraint is not None,
                                                            body.parallel_tool_calls)
        return await run(prep, body, priority, request.scope, chat=True)

    @app.post("/v1/completions", responses={
        **streamed(s.Completion, s.Completion, "`Completion`s (the echoed prompt first), then `[DONE]`"), **generation_errors})
    async def completions(body: s.CompletionRequest, request: Request, priority: int = Depends(authorized)):
        state.check_model(body.model)
        p = body.prompt
        if isinstance(p, str):
            prompts, texts = [state.encode(p)], [p]
        elif p and isinstance(p[0], int):
            prompts, texts = [list(p)], [None]
        elif p and isinstance(p[0], str):
            prompts, texts = [state.encode(x) for x in p], list(p)
        elif p:
            prompts, texts = [list(x) for x in p], [None] * len(p)
        else:
            raise bad_request("the prompt is empty", "prompt")
        if any(not ids for ids in prompts):
            raise bad_request("a prompt is empty", "prompt")
        echo = echoed(body, prompts, texts)
        params = sampling_params(body, body.max_tokens or 16, max(map(len, prompts)), state.max_model_len, body.logprobs)
        prep = Prepared(f"cmpl-{uuid.uuid4().hex}", prompts, texts, params, body.logprobs, echo=echo)
        return await run(prep, body, priority, request.scope, chat=False)

    def echoed(body: s.CompletionRequest, prompts: list[list[int]], texts: list[str | None]) -> list[str] | None:
        """With ``echo``, each prompt's text (token ids decoded), which its choices begin with."""
        if not body.echo:
            return None
        if body.logprobs is not None:
            raise bad_request("echo with logprobs is not supported: this server does not compute the prompt's "
                              "log-probabilities; send echo or logprobs, not both", "echo")
        if state.tokenizer is None and None in texts:
            raise bad_request("this model has no tokenizer, so token-id prompts cannot be echoed as text", "echo")
        return [t if t is not None else state.tokenizer.decode(ids) for t, ids in zip(texts, prompts)]

    async def run(prep: Prepared, body, priority: int, scope: dict, chat: bool) -> Response:
        if state.llm.error is not None:
            raise engine_failed(503, f"the engine failed, and this server must be restarted: {state.llm.error}")
        if state.pending + len(prep.prompts) > state.max_pending:
            raise APIError(503, f"the server is at capacity ({state.max_pending} requests in flight); retry later",
                           "server_error", None, "server_overloaded")
        state.pending += len(prep.prompts)
        try:
            streams = await admit(state.llm, prep, priority)
        except BaseException:
            state.pending -= len(prep.prompts)
            raise
        model = body.model
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_chat(prep, streams, model, include_usage) if chat else stream_completion(prep, streams, model, include_usage)
            return StreamingResponse(release(prep, events, scope), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await collect(prep, streams, model, chat)
        finally:
            finish(prep)

    def finish(prep: Prepared) -> None:
        state.pending -= len(prep.prompts)
        for rid in prep.engine_ids():  # no-op for finished requests; frees the rest
            state.llm.abort(rid)

    async def release(prep: Prepared, events: AsyncIterator[str], scope: dict) -> AsyncIterator[str]:
        """The stream's events; if it breaks after the 200 went out, one error event ends it (and
        RequestCounter counts the request as failed)."""
        try:
            async for event in events:
                yield event
        except EngineDeadError as exc:
            scope[FAILED_MID_STREAM] = True
            yield sse(engine_failed(500, str(exc)).body())
        except Exception as exc:
            log.exception("a stream failed")
            scope[FAILED_MID_STREAM] = True
            yield sse(APIError(500, f"internal server error: {type(exc).__name__}", "server_error").body())
        finally:
            finish(prep)

    def record(out) -> None:
        if out.finished and out.metrics is not None:
            state.metrics.observe_finished(out.metrics)

    async def collect(prep: Prepared, streams, model: str, chat: bool):
        n = prep.params.n
        texts = {}
        tokens: dict[int, list[int]] = {}
        lps: dict[int, list] = {}
        reasons: dict[int, str | None] = {}
        async for i, out in merged(streams):
            record(out)
            for c in out.outputs:
                k = i * n + c.index
                texts[k] = texts.get(k, "") + c.text
                tokens.setdefault(k, []).extend(c.token_ids)
                lps.setdefault(k, []).extend(c.logprobs or [])
                reasons[k] = c.finish_reason
        prompt_tokens = sum(map(len, prep.prompts))
        usage = s.Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(map(len, tokens.values())),
                        total_tokens=prompt_tokens + sum(map(len, tokens.values())))
        tok = state.tokenizer
        if chat:
            messages = {k: parsed_message(prep, texts[k], reasons[k]) for k in texts}
            choices = [s.ChatChoice(index=k, message=messages[k][0], finish_reason=messages[k][1],
                                    logprobs=chat_logprobs(tok, lps[k], tokens[k], prep.logprobs) if prep.logprobs is not None else None)
                       for k in sorted(texts)]
            return s.ChatCompletion(id=prep.request_id, created=prep.created, model=model, choices=choices, usage=usage)
        if prep.echo is not None:
            texts = {k: prep.echo[k // n] + text for k, text in texts.items()}
        choices = [s.CompletionChoice(index=k, text=texts[k], finish_reason=reasons[k],
                                      logprobs=completion_logprobs(tok, lps[k], tokens[k], prep.logprobs, 0) if prep.logprobs is not None else None)
                   for k in sorted(texts)]
        return s.Completion(id=prep.request_id, created=prep.created, model=model, choices=choices, usage=usage)

    def parsed_message(prep: Prepared, text: str, reason: str | None) -> tuple[s.AssistantMessage, str | None]:
        if prep.choice_parser is None:
            return s.AssistantMessage(content=text), reason
        parser = prep.choice_parser()
        a, b = parser.feed(text), parser.finish()
        content = a.content + b.content
        message = s.AssistantMessage(content=content if content or not parser.calls else None,
                                     reasoning_content=(a.reasoning + b.reasoning) or None,
                                     tool_calls=tools.message_calls(parser.calls))
        return message, "tool_calls" if parser.calls and reason == "stop" else reason

    def parsed_delta(parsers: dict, prep: Prepared, k: int, text: str, reason: str | None) -> tuple[s.DeltaMessage, str | None]:
        if prep.choice_parser is None:
            return s.DeltaMessage(content=text), reason
        parser = parsers[k] if k in parsers else parsers.setdefault(k, prep.choice_parser())
        piece = parser.feed(text)
        if reason is not None:
            end = parser.finish()
            piece = tools.Piece(piece.reasoning + end.reasoning, piece.content + end.content, piece.calls + end.calls)
            reason = "tool_calls" if parser.calls and reason == "stop" else reason
        delta = s.DeltaMessage(content=piece.content if piece.content or not (piece.reasoning or piece.calls) else None,
                               reasoning_content=piece.reasoning or None, tool_calls=tools.delta_calls(piece.calls))
        return delta, reason

    async def stream_chat(prep: Prepared, streams, model: str, include_usage: bool) -> AsyncIterator[str]:
        n, tok = prep.params.n, state.tokenizer
        head = dict(id=prep.request_id, created=prep.created, model=model)
        for k in range(len(prep.prompts) * n):
            yield sse(s.ChatCompletionChunk(**head, choices=[s.ChatChunkChoice(index=k, delta=s.DeltaMessage(role="assistant", content=""))]))
        completion, parsers = 0, {}
        async for i, out in merged(streams):
            record(out)
            for c in out.outputs:
                completion += len(c.token_ids)
                logprobs = chat_logprobs(tok, c.logprobs or [], c.token_ids, prep.logprobs) if prep.logprobs is not None else None
                delta, reason = parsed_delta(parsers, prep, i * n + c.index, c.text, c.finish_reason)
                choice = s.ChatChunkChoice(index=i * n + c.index, delta=delta, logprobs=logprobs, finish_reason=reason)
                yield sse(s.ChatCompletionChunk(**head, choices=[choice]))
        if include_usage:
            prompt = sum(map(len, prep.prompts))
            usage = s.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            yield sse(s.ChatCompletionChunk(**head, choices=[], usage=usage))
        yield "data: [DONE]\n\n"

    async def stream_completion(prep: Prepared, streams, model: str, include_usage: bool) -> AsyncIterator[str]:
        n, tok = prep.params.n, state.tokenizer
        head = dict(id=prep.request_id, created=prep.created, model=model)
        completion, offsets = 0, {}
        for k in range(len(prep.prompts) * n) if prep.echo is not None else ():
            yield sse(s.Completion(**head, choices=[s.CompletionChoice(index=k, text=prep.echo[k // n])]))
        async for i, out in merged(streams):
            record(out)
            for c in out.outputs:
                k = i * n + c.index
                completion += len(c.token_ids)
                logprobs = None
                if prep.logprobs is not None:
                    logprobs = completion_logprobs(tok, c.logprobs or [], c.token_ids, prep.logprobs, offsets.get(k, 0))
                offsets[k] = offsets.get(k, 0) + len(c.text)
                yield sse(s.Completion(**head, choices=[s.CompletionChoice(index=k, text=c.text, logprobs=logprobs,
                                                                          finish_reason=c.finish_reason)]))
        if include_usage:
            prompt = sum(map(len, prep.prompts))
            usage = s.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            yield sse(s.Completion(**head, choices=[], usage=usage))
        yield "data: [DONE]\n\n"

    add_tokenize_routes(app, state)
    tailor(app, served_names, bool(state.keys), chunks=(s.ChatCompletionChunk,), tool_auto=state.tool_call_parser is not None)
    return app
