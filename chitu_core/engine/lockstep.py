"""Lockstep: every rank of a torchrun world runs the same scheduler on the same commands.

The driver (world rank 0) takes requests: its ``EngineCore`` applies add / abort commands to its
engine and steps. Before each step it sends the others, over the control group (gloo), the commands
it applied since the last step; each follower (``run_follower``) applies them to its own engine and
steps too. Scheduling depends only on the commands and their order (the seeds of unseeded requests
come from ``EngineConfig.seed`` in arrival order), so every rank schedules the same batch, and the
model's collectives meet. Each message is ``(commands, step)``:

    commands: ("add", request_id, prompt_token_ids, params, None, priority, accepted) | ("abort", id) | ("stop",)
    step:     True: step after applying them; False: a heartbeat (HEARTBEAT_S while idle), or the stop

``accepted`` is the driver's verdict on an add: a follower applies rejected adds too (a rejection
may have drawn seeds) and checks that it reaches the same verdict. A follower leaves on "stop";
a follower that hears nothing for CONTROL_TIMEOUT (the heartbeat keeps an idle driver audible)
takes the driver for gone. A ``Watchdog`` on every rank ends the process when any rank stops.
"""

import logging
import os
import pickle
import signal
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from chitu_core.config import EngineConfig
from chitu_core.distributed.parallel import CONTROL_TIMEOUT
from chitu_core.distributed.watchdog import Watchdog
from chitu_core.engine.engine import LLMEngine
from chitu_core.errors import ChituError

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
IN_FLIGHT = 64  # the driver's messages queued on the control group before it waits for the oldest


def _done(works: list) -> bool:
    return all(work.is_completed() for work in works)


class Lockstep:
    def __init__(self, engine: LLMEngine, on_dead: Callable[[str], None]):
        """Join the others (every rank builds this right after its engine, so the group below is made
        in the same order everywhere), check that every engine will schedule alike, start the watchdog."""
        parallel = engine.parallel
        self.rank, self.world_size, self.control = parallel.world.rank, parallel.world.world_size, parallel.control
        watch_group = dist.new_group(backend="gloo")
        mine = {"peer": f"pid {os.getpid()} on {socket.gethostname()}", "engine": scheduling_inputs(engine)}
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=watch_group)
        for rank, theirs in enumerate(everyone):
            for key, value in theirs["engine"].items():
                if value != everyone[0]["engine"][key]:
                    raise ChituError(
                        f"rank {rank}'s engine would schedule differently from the driver's: {key} is {value} there "
                        f"and {everyone[0]['engine'][key]} on rank 0; give every rank the same options (and, for the "
                        "KV cache, the same kv_cache_memory)")
        self.watchdog = Watchdog(watch_group, self.rank, [e["peer"] for e in everyone], on_dead).start()
        self._pending: list[tuple] = []
        self._in_flight: list[tuple[list, list]] = []  # the driver's queued sends: (works, tensors)

    # --- the driver's side ------------------------------------------------------------------------

    def record(self, command: tuple) -> None:
        """A command the driver applied, for the next ``flush``."""
        self._pending.append(command)

    def flush(self, step: bool) -> None:
        """Send what was applied since the last flush; ``step``: the driver steps next.

        The driver does not wait for the followers to take it: a step's message is a fixed header
        (the commands' pickled size, the step flag) and, only when there are commands, their bytes,
        both queued on the control group, whose operations keep their order. The driver thus spends
        tens of microseconds a step here, not a round trip (``broadcast_object_list`` took 470 us a
        step on a 2-core CPU, on the driver's path of every decode step)."""
        commands, self._pending = self._pending, []
        payload = pickle.dumps(commands) if commands else b""
        sent = [torch.tensor([len(payload), int(step)], dtype=torch.int64)]
        if payload:
            sent.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        works = [dist.broadcast(t, src=0, group=self.control, async_op=True) for t in sent]
        self._in_flight.append((works, sent))  # the tensors live until their sends are done
        self._reap(IN_FLIGHT)

    def _reap(self, keep: int) -> None:
        """Forget the sends that are done; wait for the oldest until at most ``keep`` are queued.
        A failed send raises here (the control group broke: a rank is gone)."""
        while len(self._in_flight) > keep or (self._in_flight and _done(self._in_flight[0][0])):
            for work in self._in_flight.pop(0)[0]:
                work.wait()

    def stop(self) -> None:
        """Tell the followers to leave, and leave with them."""
        self.record(("stop",))
        self.flush(step=False)
        self._reap(0)
        self.leave()

    # --- a follower's side ------------------------------------------------------------------------

    def receive(self) -> tuple[list[tuple], bool]:
        """The driver's next message (blocks until it comes)."""
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        size, step = header.tolist()
        if not size:
            return [], bool(step)
        payload = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control)
        return pickle.loads(payload.numpy().tobytes()), bool(step)

    def leave(self) -> None:
        """The run ends cleanly: stop watching, then meet once more so that no rank exits (which its
        peers' watchdogs would report) before every rank has stopped watching."""
        self.watchdog.stop()
        dist.barrier(group=self.control)


def scheduling_inputs(engine: LLMEngine) -> dict:
    """What a rank's scheduling depends on besides the commands: every rank must have the same."""
    config = engine.config
    return {"num_blocks": engine.block_manager.num_blocks, "block_size": engine.block_manager.block_size,
            "max_model_len": engine.max_model_len, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens, "seed": config.seed,
            "enable_prefix_caching": config.enable_prefix_caching, "async_scheduling": engine.async_scheduling,
            "eos_token_ids": sorted(engine.eos_token_ids), "vocab_size": engine.vocab_size}


def driver_lockstep(engine: LLMEngine, on_dead: Callable[[str], None]) -> Lockstep | None:
    """The driver's Lockstep, or None in a world of one. Raises on a follower rank: it must run
    ``run_follower`` instead of taking requests."""
    if engine.parallel.world.world_size == 1:
        return None
    if not engine.parallel.is_driver:
        raise ChituError(f"rank {engine.parallel.world.rank} is not the driver: under torchrun only rank 0 takes "
                         "requests; the other ranks run chitu_core.engine.lockstep.run_follower")
    return Lockstep(engine, on_dead)


def ignore_stop_signals() -> None:
    """SIGTERM and SIGINT reach every rank at once when torchrun stops (it signals each worker's
    process group): the driver's server stops the engine, which stops the followers, so that a clean
    stop is not mistaken for a dead rank. A rank that is really gone is the watchdog's business."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def apply(engine: LLMEngine, command: tuple) -> None:
    """Apply one of the driver's commands to a follower's engine."""
    if command[0] == "add":
        _, request_id, ids, params, prompt, priority, accepted = command
        try:
            engine.add_request(request_id, ids, params, prompt, priority)
            here = True
        except (ValueError, ChituError):
            here = False
        if here != accepted:
            raise ChituError(f"request {request_id!r} was {'accepted' if accepted else 'rejected'} by the driver "
                             f"but not on rank {engine.parallel.world.rank}: the ranks' engines differ")
    elif command[0] == "abort":
        engine.abort_request(command[1])


def run_follower(config: EngineConfig) -> int:
    """A follower rank's whole life: build the engine, then apply the driver's commands and step with
    it until "stop" (0) or until the driver is gone (1; the watchdog usually ends the process first)."""
    from chitu_core.engine.core import freeze_heap  # core imports this module

    engine = LLMEngine(config)
    lockstep = Lockstep(engine, on_dead=lambda reason: log.error("exiting: %s", reason))
    ignore_stop_signals()
    freeze_heap()
    log.info("rank %d of %d follows the driver (rank 0, which serves requests): it runs the driver's steps",
             lockstep.rank, lockstep.world_size)
    while True:
        try:
            commands, step = lockstep.receive()
        except RuntimeError as exc:  # gloo: the control group's timeout, or a lost connection
            lockstep.watchdog.settle()  # a stopped rank explains it best: the watchdog says so and exits
            log.error("exiting: the driver (rank 0) sent nothing for %.0f s (CHITU_CONTROL_TIMEOUT_S): %s",
                      CONTROL_TIMEOUT.total_seconds(), str(exc).splitlines()[0])
            return 1
        try:
            for command in commands:
                if command[0] == "stop":
                    lockstep.leave()
                    return 0
                apply(engine, command)
            if step:
                engine.step()
        except Exception:
            lockstep.watchdog.settle()
            log.exception("exiting: this rank's engine failed")
            return 1
