"""The engine core's message loop: the whole interface between an ``LLMEngine`` and a server.

Commands in (tuples): ("add", request_id, prompt_token_ids, params, prompt, priority),
("abort", request_id), ("idle", key), ("stop",).
Messages out: ("accepted", request_id), ("rejected", request_id, exception),
("outputs", [RequestOutput deltas of one step], EngineStats), ("idle", [keys]),
("failed", reason) after which the core stops: whatever raises out of the loop (a step, or a
bug) leaves the engine's state unknown, so it is never survived. In a process of its own the
core first sends ("ready", {"max_model_len": ...}), or ("failed", reason) if the model did not load.

The same loop runs on a thread (``receive`` and ``send`` pass objects) or in a child
process (``run_core_process``: they pickle through pipes, and deltas travel without their
request's prompt, which the client already holds).

Under torchrun the core runs on the driver (rank 0) with a ``Lockstep`` (``lockstep.py``): it
sends the other ranks the add / abort commands it applied before each step, a heartbeat while idle,
and the stop, so that every rank's engine steps with it.
"""

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection

from chitu_core.config import EngineConfig
from chitu_core.engine.engine import EngineStats, LLMEngine
from chitu_core.engine.lockstep import HEARTBEAT_S, Lockstep, driver_lockstep, ignore_stop_signals
from chitu_core.errors import ChituError

log = logging.getLogger(__name__)


BURST_GAP_S = 0.001  # an idle engine keeps taking in requests while they come closer than this
BURST_MAX_S = 0.02  # and for no longer than this


def freeze_heap() -> None:
    """Move every object alive now into the collector's permanent generation, which its full
    collections skip. A process that serves calls this once it is built (model, modules, app): its
    full collections then scan only what serving made since. Unfrozen, one such collection in the
    server's process took 110-140 ms (2-core CPU, in the middle of a burst of 64 requests), during
    which no request reached the engine; a rank that pauses so stalls every rank's collectives."""
    gc.collect()
    gc.freeze()


class EngineCore:
    def __init__(self, engine: LLMEngine, receive: Callable[[float | None], tuple | None],
                 send: Callable[[tuple], None], lockstep: Lockstep | None = None):
        """``receive(timeout)`` returns the next command, or None if none came within ``timeout``
        seconds (0: do not wait; None: wait for one). ``lockstep``: the driver's, under torchrun."""
        self.engine, self.receive, self.send, self.lockstep = engine, receive, send, lockstep

    def run(self) -> None:
        """Serve commands until "stop"; if anything raises, send ("failed", reason) and return."""
        try:
            self._loop()
        except ConnectionError:
            raise  # the transport is gone: there is nobody to tell
        except Exception as exc:
            if self.lockstep is not None:
                self.lockstep.watchdog.settle()  # a stopped rank explains this best: the watchdog reports it
            log.exception("the engine core failed")
            self.send(("failed", f"{type(exc).__name__}: {exc}"))

    def _loop(self) -> None:
        """Apply every waiting command, step, report; block for commands only while there is no work.

        A burst of requests reaching an idle engine is gathered before the first step: while
        commands keep coming less than BURST_GAP_S apart (for at most BURST_MAX_S), the core
        takes them in, so that one prefill step serves them all instead of a cascade of small
        steps that each read every weight. A lone request waits BURST_GAP_S at most."""
        engine = self.engine
        idle_waiters: list = []
        while True:
            fresh = not engine.has_unfinished()
            idle = fresh and not idle_waiters
            command = self.receive((HEARTBEAT_S if self.lockstep else None) if idle else 0)
            if command is None and idle and self.lockstep is not None:
                self.lockstep.flush(step=False)  # a heartbeat: the followers know the driver is there
                continue
            while command is not None:
                if self._handle(command, idle_waiters):
                    return
                command = self.receive(0)
            if fresh and engine.has_unfinished():
                deadline = time.monotonic() + BURST_MAX_S
                while time.monotonic() < deadline and (command := self.receive(BURST_GAP_S)) is not None:
                    if self._handle(command, idle_waiters):
                        return
            if engine.has_unfinished():
                if self.lockstep is not None:
                    self.lockstep.flush(step=True)
                outputs = engine.step()
                self.send(("outputs", outputs, EngineStats(**vars(engine.stats))))
            elif idle_waiters:
                self.send(("idle", idle_waiters))
                idle_waiters = []

    def _handle(self, command: tuple, idle_waiters: list) -> bool:
        """Apply one command; True for "stop"."""
        if command[0] == "stop":
            if self.lockstep is not None:
                self.lockstep.stop()
            return True
        if command[0] == "idle":
            idle_waiters.append(command[1])
        else:
            self._apply(command)
        return False

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, ids, params, prompt, priority = command
            try:
                self.engine.add_request(request_id, ids, params, prompt, priority)
            except (ValueError, ChituError) as exc:
                self._mirror(("add", request_id, ids, params, None, priority, False))
                self.send(("rejected", request_id, exc))
                return
            self._mirror(("add", request_id, ids, params, None, priority, True))
            self.send(("accepted", request_id))
        elif command[0] == "abort":
            self.engine.abort_request(command[1])
            self._mirror(command)

    def _mirror(self, command: tuple) -> None:
        if self.lockstep is not None:
            self.lockstep.record(command)


def run_core_process(config: EngineConfig, commands: Connection, outputs: Connection) -> None:
    """The child process's entry point: load the engine, then serve the message loop until "stop"
    or until the parent's end of the command pipe closes. Under torchrun this process, not the
    server's, is rank 0 of the run: the one that joins torch.distributed."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s[engine]: %(message)s")
    send_lock = threading.Lock()  # the core's thread and the watchdog's both send

    def send_failed(reason: str) -> None:  # the watchdog's finding: the server logs it and exits
        if send_lock.acquire(timeout=5):
            try:
                outputs.send(("failed", reason))
            except OSError:
                pass  # the parent is gone too

    try:
        engine = LLMEngine(config)
        lockstep = driver_lockstep(engine, on_dead=send_failed)
        if lockstep is not None:
            ignore_stop_signals()  # the server tells this process when to stop
    except Exception as exc:
        log.exception("the engine could not start")
        outputs.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    freeze_heap()
    outputs.send(("ready", {"max_model_len": engine.max_model_len}))

    def receive(timeout: float | None) -> tuple | None:
        if timeout is not None and not commands.poll(timeout):
            return None
        try:
            return commands.recv()
        except EOFError:  # the parent went away
            return ("stop",)

    def send(message: tuple) -> None:
        if message[0] == "outputs":  # the client has each request's prompt: leave it out of every delta
            message = ("outputs", [replace(o, prompt=None, prompt_token_ids=None) for o in message[1]], message[2])
        with send_lock:
            outputs.send(message)

    try:
        EngineCore(engine, receive, send, lockstep).run()
    except (BrokenPipeError, OSError):
        pass  # the parent closed its end: nobody is listening any more
