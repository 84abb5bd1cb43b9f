"""AsyncLLM: the engine for asyncio servers. The engine core (scheduler, model runner, detokenizer)
runs off the event loop: in a thread of its own, or with ``process=True`` in a process of its own,
so that its step loop shares no GIL with HTTP handling (what ``python -m chitu_core.serve`` does).

The event loop and the engine core talk only through messages (``core.py``): the loop sends
add / abort / idle / stop commands; the core applies them between steps, runs a step, and sends
back each step's delta outputs in one message. A thread passes the messages as objects; a process
pickles them through two pipes, written on this side by a thread (``CommandPipe``: the loop never
waits on a full pipe) and read by another that hands them to the loop.

    llm = AsyncLLM(EngineConfig(model=PATH, device="cpu"))
    async for delta in llm.generate(prompt_token_ids, SamplingParams(max_tokens=32)):
        print(delta.outputs[0].text, end="")
    await llm.shutdown()

A consumer that stops iterating (a client that went away) aborts its request,
which frees its KV blocks at the next step boundary.

If the engine core fails (a step raised, or its process died) the engine is dead for good: every
request in flight and every later one raises ``EngineDeadError``, ``error`` says why, and the
callbacks given to ``on_failure`` run, so that a server can answer 503 and exit to be restarted.
"""

import asyncio
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from chitu_core.config import EngineConfig
from chitu_core.engine.core import EngineCore, run_core_process
from chitu_core.engine.engine import EngineStats, LLMEngine
from chitu_core.engine.lockstep import driver_lockstep
from chitu_core.engine.outputs import RequestOutput, merge_deltas
from chitu_core.errors import ChituError
from chitu_core.sampling.params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(ChituError):
    """The engine core failed (a step raised, or its process died); no request can run any more."""


@dataclass
class _Stream:
    """Where a request's outputs go: an asyncio queue on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt_token_ids: list[int]
    prompt: str | None


class CommandPipe:
    """The command side of a pipe to an engine process, written by a thread of its own. The core
    reads its commands only between steps; a pipe holds 64 KiB, about 15 prompts of 2,000 tokens,
    and a writer blocks once it is full. Written from the event loop, a burst of long prompts
    that arrives during a step would stop all HTTP handling until the step ended (measured: /health
    stalled 112-118 ms, on 2 CPU cores, as 32 prompts of 4,000 tokens came during an 8-prompt step).
    ``send`` only queues, in order; ``on_broken(exc)`` runs on the writer if the pipe breaks."""

    def __init__(self, conn, on_broken: Callable[[OSError], None]):
        self._conn, self._on_broken = conn, on_broken
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="chitu-engine-writer", daemon=True)
        self._thread.start()

    def send(self, command: tuple) -> None:
        self._queue.put(command)

    def close(self, timeout: float = 5.0) -> None:
        """After a ("stop",) was sent: wait until it is written, then close the pipe."""
        self._thread.join(timeout)
        self._conn.close()

    def _write(self) -> None:
        while True:
            command = self._queue.get()
            try:
                self._conn.send(command)
            except OSError as exc:  # BrokenPipeError included: the process is gone
                self._on_broken(exc)
                return
            if command[0] == "stop":
                return


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class AsyncLLM:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None, process: bool = False):
        """Start the engine core: in a thread, which builds the engine, or with ``process`` in a child
        process; either way this call waits until the model is loaded. ``engine``: one already built (by
        this thread: on a backend computing on the host's cores, its steps on the core's thread are then
        slower, see ``_start_thread``)."""
        self._streams: dict[str, _Stream] = {}
        self._waiting: dict[object, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # adds, idle waits
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._lock = threading.Lock()  # orders registering a waiter against the failure that fails them all
        self._error: str | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._stopping = False
        self.engine: LLMEngine | None = None
        if process:
            self._start_process(config)
        else:
            self._start_thread(config, engine)

    def _start_thread(self, config: EngineConfig, engine: LLMEngine | None) -> None:
        """The core in a thread, which also builds the engine (unless given one) and waits until it has.

        Built there, the engine's host work (loading, packing, every step) runs on one thread. Host
        thread pools such as OpenMP's belong to the thread that opens a parallel region: a second
        thread using them adds a second pool, and with more pooled threads than cores the runtime
        stops spinning between regions, so each parallel op waits for its workers to wake (measured
        on 2 cores: the embedded default decoded 55 tok/s in a thread after loading elsewhere, 95
        on the loading thread)."""
        commands: queue.Queue = queue.Queue()
        self._send_command = commands.put
        built = threading.Event()
        failure: list[BaseException] = []

        def receive(timeout: float | None):
            try:
                return commands.get(block=timeout != 0, timeout=timeout)
            except queue.Empty:
                return None

        def run() -> None:
            try:
                self.engine = engine or LLMEngine(config)
                # Under torchrun this process is rank 0 and drives the others; if one stops, the
                # watchdog says so and ends the process (the core may be stuck in a collective).
                lockstep = driver_lockstep(self.engine, lambda reason: log.error("exiting: the engine failed: %s", reason))
                core = EngineCore(self.engine, receive, self._dispatch, lockstep)
            except BaseException as exc:  # raised again by the thread that started this one
                failure.append(exc)
                return
            finally:
                built.set()
            core.run()

        self._thread = threading.Thread(target=run, name="chitu-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            raise failure[0]
        self.tokenizer, self.max_model_len = self.engine.tokenizer, self.engine.max_model_len

    def _start_process(self, config: EngineConfig) -> None:
        from chitu_core.loader.gguf import resolve_model
        from chitu_core.loader.hf import open_model_dir

        context = multiprocessing.get_context("spawn")  # a forked child would inherit device state
        commands_out, commands_in = context.Pipe(duplex=False)
        outputs_out, outputs_in = context.Pipe(duplex=False)
        self._process = context.Process(target=run_core_process, args=(config, commands_out, outputs_in),
                                        name="chitu-engine-core", daemon=True)
        self._process.start()
        commands_out.close()
        outputs_in.close()
        self._outputs_conn = outputs_out
        try:
            kind, info = outputs_out.recv()
        except EOFError:
            self._process.join(5)
            raise ChituError(f"the engine process exited (code {self._process.exitcode}) before the model was loaded; "
                             "its log above says why") from None
        if kind == "failed":
            self._process.join(5)
            raise ChituError(f"the engine process could not start: {info}")
        self.max_model_len = info["max_model_len"]
        self._commands = CommandPipe(commands_in, self._pipe_broke)
        self._send_command = self._commands.send  # as a thread's queue: the loop only queues
        from chitu_core.plugins.discovery import get_backend

        keep_gguf = "gguf" in get_backend(config.device).quant_methods()  # the directory the engine process made
        model_dir = open_model_dir(resolve_model(config.model, keep_quantized=keep_gguf), require_weights=config.load_format == "auto")
        self.tokenizer = model_dir.tokenizer()  # for the server's side
        self._thread = threading.Thread(target=self._read_outputs, name="chitu-engine-reader", daemon=True)
        self._thread.start()

    def _pipe_broke(self, exc: OSError) -> None:
        if not self._stopping:
            self._fail(f"the engine process is gone ({exc})")

    def _read_outputs(self) -> None:
        """Hand the engine's messages to the loop. When several wait in the pipe (this side fell
        behind), their deltas go out merged per request: fewer, larger chunks, never a backlog."""
        conn = self._outputs_conn
        while True:
            try:
                messages = [conn.recv()]
                while len(messages) < 256 and conn.poll():
                    messages.append(conn.recv())
            except (EOFError, OSError):
                if not self._stopping:
                    self._process.join(1)
                    self._fail(f"the engine process exited ({_exit_status(self._process.exitcode)})")
                return
            deltas: dict[str, RequestOutput] = {}
            for message in messages:
                if message[0] != "outputs":
                    self._dispatch(message)
                    continue
                self._stats = message[2]
                for out in message[1]:
                    earlier = deltas.get(out.request_id)
                    deltas[out.request_id] = out if earlier is None else merge_deltas(earlier, out)
            if deltas:
                self._dispatch(("outputs", list(deltas.values()), self._stats))

    # --- the event-loop side ----------------------------------------------------------------------

    @property
    def error(self) -> str | None:
        """Why the engine core failed, or None while it runs. Once set it stays set."""
        return self._error

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once when the engine core fails, or now if it already has.
        It runs on whichever thread learned of the failure (usually not the event loop's):
        keep it short and thread-safe, e.g. set a flag or ``loop.call_soon_threadsafe``."""
        with self._lock:
            if self._error is None:
                self._failure_callbacks.append(callback)
                return
        callback(self._error)

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                          prompt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue a request; once the engine accepted it, return the iterator of its delta outputs.
        Raises ValueError (or ChituError) if the engine refuses it, EngineDeadError if the engine
        failed. Closing the iterator before the end aborts the request; a caller that never
        iterates must ``abort`` it."""
        request_id = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), prompt_token_ids, prompt)
        accepted = loop.create_future()
        with self._lock:
            self._check_alive()
            self._streams[request_id] = stream
            self._waiting[("add", request_id)] = (loop, accepted)
        self._send_command(("add", request_id, prompt_token_ids, params, prompt, priority))
        try:
            await accepted
        except BaseException:
            self.abort(request_id)  # the engine may have taken it (the caller was cancelled): free it there
            raise
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # A consumer that fell behind gets what piled up as one delta: one chunk to send, not many.
                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    later = stream.queue.get_nowait()
                    item = later if isinstance(later, BaseException) else merge_deltas(item, later)
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
        """Abort a request (no-op if it already finished). Its blocks are freed before the next step.
        Only a request whose stream is still open reaches the engine: a finished one (its last delta
        closed the stream), a refused one and any after a failure cost nothing, so a server may abort
        every request it ends (under torchrun each abort is a command every rank applies)."""
        if self._streams.pop(request_id, None) is not None:
            self._send_command(("abort", request_id))

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters, as of the last step."""
        return self._stats

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is queued or running (for tests and graceful shutdown)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        key = ("idle", next(self._ids))
        with self._lock:
            self._check_alive()
            self._waiting[key] = (loop, done)
        self._send_command(("idle", key))
        await asyncio.wait_for(done, timeout)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error}")

    async def shutdown(self) -> None:
        self._stopping = True
        self._send_command(("stop",))
        await asyncio.to_thread(self._thread.join)
        if self.engine is None:
            await asyncio.to_thread(self._process.join, 30)
            await asyncio.to_thread(self._commands.close)

    # --- messages from the engine core (on its thread, or on the reader thread) -------------------

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outputs, self._stats = message
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    self._streams.pop(out.request_id, None)
                if out.prompt_token_ids is None:  # from a process: the prompt stayed here
                    out.prompt_token_ids, out.prompt = stream.prompt_token_ids, stream.prompt
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
            for loop, items in by_loop.items():  # one wake-up of each loop per step, not one per request
                loop.call_soon_threadsafe(_put_all, items)
        elif kind in ("accepted", "rejected"):
            if kind == "rejected":
                self._streams.pop(message[1], None)  # never in the engine: nothing to abort
            self._resolve(("add", message[1]), message[2] if kind == "rejected" else None)
        elif kind == "idle":
            for key in message[1]:
                self._resolve(key, None)
        elif kind == "failed":
            self._fail(message[1])

    def _fail(self, reason: str) -> None:
        """The engine core is dead: fail every stream and waiter, then tell the callbacks. The
        first reason wins (a process whose step failed also reports its exit after)."""
        with self._lock:
            if self._error is not None:
                return
            self._error = reason
            streams, waiters = list(self._streams), list(self._waiting)
            callbacks, self._failure_callbacks = self._failure_callbacks, []
        for rid in streams:
            self._send(rid, EngineDeadError(f"the engine failed: {reason}"))
        for key in waiters:
            self._resolve(key, EngineDeadError(f"the engine failed: {reason}"))
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("an engine failure callback raised")

    def _resolve(self, key, error: BaseException | None) -> None:
        waiter = self._waiting.pop(key, None)
        if waiter is None:
            return
        loop, future = waiter
        if error is None:
            _call_soon(loop, lambda: future.done() or future.set_result(None))
        else:
            _call_soon(loop, lambda: future.done() or future.set_exception(error))

    def _send(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        _call_soon(stream.loop, stream.queue.put_nowait, item)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that loop is closed: nobody waits there any more
        pass
