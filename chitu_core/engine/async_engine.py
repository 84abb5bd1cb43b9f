"""AsyncLLM: the engine for asyncio servers. The step loop runs in a thread of its own, off the event loop.

The event loop and the engine thread talk only through messages: the loop puts
("add", ...) and ("abort", ...) commands on a queue; the engine thread applies
them between steps, runs a step, and hands each request's delta outputs back
to the loop with ``call_soon_threadsafe``. The engine is never touched from
the loop, so its state needs no locks; the same interface could put the engine
in a process of its own.

    llm = AsyncLLM(EngineConfig(model=PATH, device="cpu"))
    async for delta in llm.generate(prompt_token_ids, SamplingParams(max_tokens=32)):
        print(delta.outputs[0].text, end="")
    await llm.shutdown()

A consumer that stops iterating (a client that went away) aborts its request,
which frees its KV blocks at the next step boundary.
"""

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from chitu_core.config import EngineConfig
from chitu_core.engine.engine import EngineStats, LLMEngine
from chitu_core.engine.outputs import RequestOutput
from chitu_core.errors import ChituError
from chitu_core.sampling.params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Where a request's outputs go: an asyncio queue on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._stats = EngineStats()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="chitu-engine", daemon=True)
        self._thread.start()

    # --- the event-loop side ----------------------------------------------------------------------

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                          prompt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue a request; once the engine accepted it, return the iterator of its delta outputs.
        Raises ValueError (or ChituError) if the engine refuses it. Closing the iterator before
        the end aborts the request; a caller that never iterates must ``abort`` it."""
        if self._error is not None:
            raise ChituError(f"the engine stopped after an error: {self._error!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        accepted = asyncio.get_running_loop().create_future()
        self._commands.put(("add", request_id, prompt_token_ids, params, prompt, priority, stream, accepted))
        await accepted
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       prompt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate: yields delta outputs until the request finishes."""
        outputs = await self.add_request(prompt_token_ids, params, request_id, prompt, priority)
        async for out in outputs:
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Its blocks are freed before the next step."""
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters, as of the last step."""
        return self._stats

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is queued or running (for tests and graceful shutdown)."""
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("idle", done))
        await asyncio.wait_for(done, timeout)

    async def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join)

    # --- the engine thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        idle_waiters: list[asyncio.Future] = []
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished()
            try:
                command = self._commands.get(block=not busy and not idle_waiters, timeout=None)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    return
                if command[0] == "idle":
                    idle_waiters.append(command[1])
                else:
                    self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except BaseException as exc:  # a broken engine: fail every stream rather than hang them
                    log.exception("engine step failed")
                    self._error = exc
                    for rid in list(self._streams):
                        self._send(rid, ChituError(f"the engine failed: {exc!r}"))
                    return
                for out in outputs:
                    self._send(out.request_id, out)
                self._stats = EngineStats(**vars(self.engine.stats))
            elif idle_waiters:
                for fut in idle_waiters:
                    fut.get_loop().call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
                idle_waiters = []

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, ids, params, prompt, priority, stream, accepted = command
            try:
                self.engine.add_request(request_id, ids, params, prompt, priority)
            except (ValueError, ChituError) as exc:
                stream.loop.call_soon_threadsafe(lambda e=exc: accepted.done() or accepted.set_exception(e))
                return
            self._streams[request_id] = stream
            stream.loop.call_soon_threadsafe(lambda: accepted.done() or accepted.set_result(None))
        elif command[0] == "abort":
            request_id = command[1]
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _send(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
