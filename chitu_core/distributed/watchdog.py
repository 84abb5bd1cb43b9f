"""A thread in every rank of a torchrun world that ends the process when another rank stops.

A rank that dies (killed, crashed) closes its connections, and a host-side exchange with it fails at
once; but a rank stuck in a device collective with a dead peer (a collective library's all-reduce) never returns
to notice. So every PERIOD_S each rank's watchdog takes part in a round on a gloo group of its own:
rank 0 receives a word from every other rank, then answers each. A closed connection fails a
receive at once; a rank silent for CONTROL_TIMEOUT (hung, or its host gone) fails it by time.
Rank 0 learns which rank stopped; the others learn that rank 0 did, and since rank 0 exits on what
it finds, every rank hears of any death within a round or two.

On a finding the watchdog calls ``on_dead(reason)`` once (a sentence naming the rank, its pid and
host) and ends the process with status 1 by ``os._exit``: a thread stuck in a collective cannot be
joined, so nothing less would end it.
"""

import logging
import os
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from chitu_core.distributed.parallel import CONTROL_TIMEOUT

log = logging.getLogger(__name__)

PERIOD_S = 1.0


class RankStopped(Exception):
    """Rank ``rank`` failed a watchdog round; ``reason`` says how."""

    def __init__(self, rank: int, reason: str):
        super().__init__(reason)
        self.rank, self.reason = rank, reason


class Watchdog:
    def __init__(self, group: dist.ProcessGroup, rank: int, peers: list[str], on_dead: Callable[[str], None],
                 timeout: timedelta = CONTROL_TIMEOUT):
        """``group``: a gloo group of every rank, used by nothing else. ``peers[r]``: how rank r is
        named in a reason ("pid 123 on host-a"). ``rank``: this rank's place in the group."""
        self.group, self.rank, self.peers, self.on_dead, self.timeout = group, rank, peers, on_dead, timeout
        self._stopped = threading.Event()
        self._found = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="chitu-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """A clean leave: whatever fails after this (the others exiting too) is not reported."""
        self._stopped.set()

    def settle(self, timeout: float = 3 * PERIOD_S) -> None:
        """Give the watchdog ``timeout`` seconds to find a stopped rank, the likely cause of an error
        this process just met; if it finds one it ends the process, so this returns only if not."""
        if self._found.wait(timeout):
            threading.Event().wait(30)  # on_dead runs, then os._exit; should on_dead hang, go on

    def name(self, rank: int) -> str:
        return f"rank {rank}{' (the driver)' if rank == 0 else ''}, {self.peers[rank]},"

    def _watch(self) -> None:
        while not self._stopped.wait(PERIOD_S):
            try:
                self._round()
            except RankStopped as stopped:
                if not self._stopped.is_set():
                    self._die(stopped.reason)
                return

    def _round(self) -> None:
        word, timeout = torch.zeros(1, dtype=torch.int32), self.timeout
        rank = 0  # the rank being waited for: each loop below sets it, for the report should a wait fail
        try:
            if self.rank == 0:
                works = []
                for rank in range(1, len(self.peers)):
                    works.append((rank, dist.irecv(torch.zeros_like(word), src=rank, group=self.group)))
                for rank, work in works:
                    work.wait(timeout)
                for rank, work in [(r, dist.isend(word, dst=r, group=self.group)) for r in range(1, len(self.peers))]:
                    work.wait(timeout)
            else:
                dist.isend(word, dst=0, group=self.group).wait(timeout)
                # Rank 0 answers once it heard from everyone: a slow third rank must not look like rank 0's fault.
                timeout = 2 * timeout
                dist.irecv(word, src=0, group=self.group).wait(timeout)
        except Exception as exc:
            text = str(exc).lower()
            if "timeout" in text or "timed out" in text:
                how = f"did not answer for {timeout.total_seconds():.0f} s (CHITU_CONTROL_TIMEOUT_S): hung, or its host is gone"
            else:
                how = "stopped: its connection closed"
            raise RankStopped(rank, f"{self.name(rank)} {how}") from exc

    def _die(self, reason: str) -> None:
        self._found.set()
        try:
            self.on_dead(reason)
        except Exception:
            log.exception("the watchdog's on_dead raised")
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(1)
