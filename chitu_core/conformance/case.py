"""What a case is, what it runs against, and how a call is timed.

A ``Case`` is one row-and-column entry's worth of work: a matrix row (an op, ``attention/NAME``,
``quant/METHOD``, a collective, ``sampler``, ``model/ARCH/...``), a dtype, the parameters the
backend's ``supports()`` is asked about, and ``run``, which builds fresh random operands, calls the
backend and judges the result against the float64 reference. Cases that must run together (the
collectives, in one two-process group) share a ``batch``.
"""

import statistics
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from chitu_core.backend import Backend
from chitu_core.conformance.compare import Verdict
from chitu_core.conformance.thresholds import Threshold, ThresholdBook, dtype_name
from chitu_core.ops.checks import OpContractError, checks_paused
from chitu_core.ops.table import Ops


@dataclass
class PerfOptions:
    warmup: int = 3
    repeats: int = 20


@dataclass
class Target:
    """The backend under test, as every case sees it."""

    backend: Backend
    ops: Ops
    device: torch.device
    book: ThresholdBook
    perf: PerfOptions | None = None

    def threshold(self, case: "Case") -> Threshold:
        return self.book.get(case.row, case.family, case.dtype)[0]


@dataclass
class Perf:
    """Time per call (median of the repeats, device-synchronized) and what it moved and computed."""

    median_us: float
    gbps: float | None = None
    tflops: float | None = None


@dataclass
class Outcome:
    verdict: Verdict
    source: str = "native"  # "native", "override", "fallback" or "native+fallback": who served the call
    perf: Perf | None = None


@dataclass
class Case:
    row: str
    op: str  # the name ``Backend.supports`` is asked about
    family: str
    dtype: torch.dtype
    params: dict[str, Any]
    label: str
    runner: Callable[["Case", Target], Outcome] | None = None  # runs this case alone
    batch: Any = field(default=None)  # or, for cases run together, an object with run_all(target, cases) -> [Outcome]
    declined: str = ""  # set: reported unsupported for this reason, whatever supports() says
    skip: str = ""  # set: not run, for a reason outside the backend (a plugin the case needs is missing)

    def run(self, target: Target) -> Outcome:
        return self.runner(self, target)

    @property
    def key(self) -> str:
        return f"{self.row}[{dtype_name(self.dtype)}] {self.label}"

    def generator(self) -> torch.Generator:
        """A CPU generator seeded from the case's identity: the same operands on every run and device."""
        return torch.Generator().manual_seed(zlib.crc32(self.key.encode()))


def time_call(target: Target, fn: Callable[[], object], nbytes: int, flops: int | None = None,
              calls: int | None = None) -> Perf:
    """Time per call of ``fn``: after warm-up, each repeat runs it k times between two ``synchronize()``
    calls (k = ``calls``, or chosen so that a repeat lasts about a millisecond, so that launch and
    synchronization costs do not swamp small kernels); the median over the repeats."""
    opts = target.perf or PerfOptions()
    sync = target.backend.synchronize
    with checks_paused(target.ops):  # the calls were checked when the case ran them; time the ops alone
        for _ in range(opts.warmup):
            fn()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        k = calls or max(1, min(100, int(1e-3 / max(time.perf_counter() - start, 1e-9))))
        times = []
        for _ in range(opts.repeats):
            sync()
            start = time.perf_counter()
            for _ in range(k):
                fn()
            sync()
            times.append((time.perf_counter() - start) / k)
    seconds = statistics.median(times)
    return Perf(seconds * 1e6, nbytes / seconds / 1e9 if nbytes else None,
                flops / seconds / 1e12 if flops else None)


def nbytes(*tensors) -> int:
    """Bytes of the tensors among the arguments (nested in tuples too)."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += nbytes(*t)
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0,
          offset: float = 0.0) -> torch.Tensor:
    """Normal random values (never all zeros), rounded to ``dtype``."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + offset).to(dtype)


def raised(exc: BaseException, what: str) -> Outcome:
    if isinstance(exc, OpContractError):  # it names the op that broke its contract, whatever called it
        return Outcome(Verdict.fail(str(exc)))
    return Outcome(Verdict.fail(f"{what} raised {type(exc).__name__}: {exc}"))


def ops_source(target: Target, ops: Iterable[str]) -> str:
    """Who serves a case that runs several ops: "fallback" when every one is the reference,
    "native+fallback" when some are, else "native" (overrides count as native here)."""
    kinds = {target.ops.sources[op].kind for op in ops}
    if "fallback" not in kinds:
        return "native"
    return "fallback" if kinds == {"fallback"} else "native+fallback"
