"""Resident memory of a server on this machine while ``bench serve`` loads it (``--server-pid PID``).

The server is the process PID and every process below it (an engine core of its own, torchrun's
ranks). Two figures, both from Linux's /proc:

* ``peak_mb``: each process's own peak resident set (``VmHWM``, the kernel's count since the process
  started: loading included, never missed between samples), summed. Processes that peaked at different
  moments make the sum an upper bound of the tree's peak; for one process it is exact.
* ``sampled_peak_mb``: the largest sum of the processes' current resident sets (``VmRSS``), sampled
  every ``interval_s`` while the benchmark ran.

``rss_mb`` holds each process's ``VmRSS`` at the end, with its kinds (anonymous, file-backed, shared:
the CPU backend's KV cache is shared anonymous pages).
"""

import threading
from pathlib import Path


class ServerMemoryError(Exception):
    """The process to watch is not there (or this is not Linux)."""


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first (threads' children included)."""
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").glob("*"):
            try:
                tree += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # the task or the process has gone meanwhile
                pass
        i += 1
    return list(dict.fromkeys(tree))


def status_mb(pid: int) -> dict[str, float] | None:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile``, ``RssShmem`` of ``pid`` in MB; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: int(v.split()[0]) / 1024 for k, v in fields if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")}


class ServerMemory:
    """Samples a process tree's resident memory on a thread until ``stop()``, which returns the report."""

    def __init__(self, pid: int, interval_s: float = 0.1):
        if status_mb(pid) is None:
            raise ServerMemoryError(f"--server-pid {pid}: no such process here (/proc/{pid}/status cannot be read); "
                                    "give the pid of the server on this machine")
        self.pid, self.interval_s = pid, interval_s
        self.sampled_peak = 0.0
        self.seen: dict[int, dict[str, float]] = {}  # the last status of every process seen
        self.alive: dict[int, dict[str, float]] = {}  # the processes of the last sample
        self._done = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="server-memory", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        statuses = {pid: status_mb(pid) for pid in process_tree(self.pid)}
        self.alive = {pid: s for pid, s in statuses.items() if s and "VmRSS" in s}  # a zombie has no memory lines
        self.seen.update(self.alive)
        self.sampled_peak = max(self.sampled_peak, sum(s["VmRSS"] for s in self.alive.values()))

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            self._sample()

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        self._sample()
        return {
            "pid": self.pid,
            "processes": len(self.seen),
            "peak_mb": round(sum(s["VmHWM"] for s in self.seen.values()), 1),
            "sampled_peak_mb": round(self.sampled_peak, 1),
            "interval_s": self.interval_s,
            "rss_mb": {str(pid): {k: round(v, 1) for k, v in s.items()} for pid, s in self.alive.items()},
        }


def render(memory: dict) -> str:
    """One line for ``bench serve``'s text report."""
    end = sum(s["VmRSS"] for s in memory["rss_mb"].values())
    many = memory["processes"] > 1
    whose = "the sum of each one's" if many else "its"
    return (f"server memory (pid {memory['pid']}{' and the processes below it' if many else ''}): peak RSS "
            f"{memory['peak_mb']:.0f} MB ({whose} VmHWM, loading included), "
            f"{memory['sampled_peak_mb']:.0f} MB sampled every {memory['interval_s']} s during the run, {end:.0f} MB at the end")
