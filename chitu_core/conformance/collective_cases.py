"""Collectives: the Communicator on two ranks of the backend's own process-group backend.

The two ranks are spawned processes that load the backend by name (as torchrun would start them)
and put rank r on device r mod device_count; ``supports()`` is asked with ``world_size`` and
``device_count`` so that a backend whose process group needs one device per rank can decline on a
one-device machine. Every value is a small integer, exact in every dtype, so results are compared
exactly; operands that a collective does not own must come back unchanged. The layer boundary
``all_reduce_add_rms_norm`` (contract 1.5) is held to the norm family's tolerance against the float64
reference: its residual (the sum) is compared exactly, its norm as ``fused_add_rms_norm``'s; it is
"native" where the backend's small-message all-reduce fuses it and the message fits. The row-parallel
linear with its all-reduce and residual add, ``linear_all_reduce_add`` (contract 1.13), is held to the
fused products' tolerance against float64, each rank's weight in the backend's layout; "native" where
the backend's ``linear_add`` took the case.
"""

import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from chitu_core.backend import Backend
from chitu_core.conformance.case import Case, Outcome, Perf, PerfOptions, Target, time_call
from chitu_core.conformance.compare import Verdict, compare, worst
from chitu_core.conformance.thresholds import DTYPES, ThresholdBook, default, dtype_name
from chitu_core.ops import reference

WORLD = 2
TIMEOUT_S = 180.0

# (row, variant label, shape): what each rank does is in _check.
VARIANTS = [
    ("all_reduce", "4x6", (4, 6)), ("all_reduce", "6x4 transposed view, in place", (6, 4)),
    ("all_reduce", "4096 (a decode step's 8 KB in bf16)", (4096,)), ("all_reduce", "65536", (1 << 16,)),
    ("all_reduce", "1048576", (1 << 20,)),
    ("all_gather", "4x6 dim 0", (4, 6)), ("all_gather", "4x6 dim -1", (4, 6)),
    ("all_gather", "6x4 transposed view, dim 0", (6, 4)),
    ("reduce_scatter", "4x6 dim 0", (4, 6)), ("reduce_scatter", "4x6 dim -1", (4, 6)),
    ("broadcast", "4x6 from rank 0", (4, 6)), ("broadcast", "4x6 from rank 1", (4, 6)),
    ("broadcast", "6x4 transposed view from rank 1", (6, 4)),
    ("send_recv", "transposed view sent, received into a column", (6, 4)),
    ("all_reduce_add_rms_norm", "1x4096 (a decode step)", (1, 4096)),
    ("all_reduce_add_rms_norm", "64x4096 (512 KB in bf16)", (64, 4096)),
    ("all_reduce_add_rms_norm", "3x5120", (3, 5120)), ("all_reduce_add_rms_norm", "130x4096", (130, 4096)),
    # (rows, one rank's inputs, outputs)
    ("linear_all_reduce_add", "1x2048 -> 4096 (a decode step's o_proj share)", (1, 2048, 4096)),
    ("linear_all_reduce_add", "1x7168 -> 4096 with bias", (1, 7168, 4096)),
    ("linear_all_reduce_add", "3x256 -> 640 with bias", (3, 256, 640)),
]
EPS = 1e-6
FUSED_ROWS = {"all_reduce_add_rms_norm": "norm", "linear_all_reduce_add": "fused_matmul"}  # row: its family


def rank_values(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Element i of rank r: (i mod 31) - 15 + 40 (r + 1); distinct within 31 elements, sums exact in 8 bits."""
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n) % 31) - 15 + 40 * (rank + 1)).reshape(shape).to(dtype)


def _check(comm, ops, row: str, label: str, shape, dtype, device) -> tuple[str, object]:
    """(problem or "", the call to time) for one variant on this rank (``linear_all_reduce_add``: ``_check_linear``)."""
    rank = comm.rank
    mine = rank_values(rank, shape, dtype).to(device)
    every = [rank_values(r, shape, dtype).to(device) for r in range(WORLD)]
    total = sum(every)
    if row == "all_reduce":
        x = mine.t().contiguous().t() if "transposed" in label else mine.clone()
        out = comm.all_reduce(x)
        if out is not x:
            return "all_reduce did not return its argument (it works in place)", None
        return ("" if torch.equal(x, total) else "all_reduce: the sum differs"), lambda: comm.all_reduce(x)
    if row == "all_gather":
        dim = -1 if "dim -1" in label else 0
        x = mine.t().contiguous().t() if "transposed" in label else mine.clone()
        out = comm.all_gather(x, dim=dim)
        if not torch.equal(x, mine):
            return "all_gather modified its operand", None
        return ("" if torch.equal(out, torch.cat(every, dim=dim)) else f"all_gather(dim={dim}): wrong result",
                lambda: comm.all_gather(x, dim=dim))
    if row == "reduce_scatter":
        dim = -1 if "dim -1" in label else 0
        x = mine.clone()
        out = comm.reduce_scatter(x, dim=dim)
        if not torch.equal(x, mine):
            return "reduce_scatter modified its operand", None
        want = total.chunk(WORLD, dim=dim)[rank]
        return ("" if torch.equal(out, want) else f"reduce_scatter(dim={dim}): wrong part",
                lambda: comm.reduce_scatter(x, dim=dim))
    if row == "broadcast":
        src = 1 if "rank 1" in label else 0
        x = mine.t().contiguous().t() if "transposed" in label else mine.clone()
        out = comm.broadcast(x, src=src)
        ok = out is x and torch.equal(x, every[src])
        return ("" if ok else f"broadcast(src={src}): wrong result"), lambda: comm.broadcast(x, src=src)
    if row == "all_reduce_add_rms_norm":
        return _check_boundary(comm, ops, mine, total, dtype, device)
    if row == "send_recv":
        if rank == 0:
            comm.send(every[0].t(), dst=1)
            return "", None
        buffer = torch.full((shape[1], shape[0] + 2), -99, dtype=dtype, device=device)
        got = comm.recv(buffer[:, 1 : 1 + shape[0]], src=0)
        ok = torch.equal(got, every[0].t()) and bool((buffer[:, 0] == -99).all() and (buffer[:, -1] == -99).all())
        return ("" if ok else "recv into a view: wrong values, or written outside the view"), None
    raise ValueError(row)


def _check_boundary(comm, ops, mine, total, dtype, device) -> tuple[str, object]:
    """all_reduce_add_rms_norm of the ranks' x and one residual, against float64."""
    h = mine.shape[-1]
    residual = (torch.arange(mine.numel()).reshape(mine.shape) % 13 - 6).to(dtype).to(device)
    weight = ((torch.arange(h) % 9 - 4) / 4).to(dtype).to(device)
    kept = residual.clone(), weight.clone()
    out, new_residual = comm.all_reduce_add_rms_norm(mine.clone(), residual, weight, EPS, ops)
    if not (torch.equal(residual, kept[0]) and torch.equal(weight, kept[1])):
        return "all_reduce_add_rms_norm modified its residual or weight operand", None
    want_out, want_residual = reference.fused_add_rms_norm(total.double().cpu(), residual.double().cpu(),
                                                           weight.double().cpu(), EPS)
    for got, want, name, family in ((new_residual, want_residual, "residual", "collective"),
                                    (out, want_out, "out", "norm")):
        verdict = compare(got, want, default(family, dtype), name)
        if not verdict.ok:
            return f"all_reduce_add_rms_norm: {verdict.detail}", None
    x = mine.clone()
    return "", lambda: comm.all_reduce_add_rms_norm(x, residual, weight, EPS, ops)


def _check_linear(comm, ops, shape, bias: bool, dtype, device, transposed: bool) -> tuple[str, object, Verdict | None]:
    """linear_all_reduce_add of the ranks' x and weights, one bias and one residual, against float64; and
    the passing verdict."""
    rows, k, n = shape
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(rows, k, generator=gen).to(dtype) for _ in range(WORLD)]
    ws = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype) for _ in range(WORLD)]
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    residual = torch.randn(rows, n, generator=gen).to(dtype)
    want = residual.double() + sum(x.double() @ w.double().T for x, w in zip(xs, ws))
    want = want if b is None else want + b.double()
    x, w = xs[comm.rank].to(device), ws[comm.rank].to(device)
    w = w.t().contiguous().t() if transposed else w
    res, b = residual.to(device), None if b is None else b.to(device)
    kept = [t.clone() for t in (x, w, res, b) if t is not None]
    out = comm.linear_all_reduce_add(x, w, b, res, ops)
    if not all(torch.equal(t, c) for t, c in zip([t for t in (x, w, res, b) if t is not None], kept)):
        return "linear_all_reduce_add modified an operand", None, None
    verdict = compare(out, want, default("fused_matmul", dtype), "out")
    if not verdict.ok:
        return f"linear_all_reduce_add: {verdict.detail}", None, None
    return "", lambda: comm.linear_all_reduce_add(x, w, b, res, ops), verdict


def _fused(comm, row: str, shape, dtype, device, transposed: bool) -> bool:
    """Whether the backend's own one-pass path takes this case (its source is "native"). For the linear,
    asked of its ``linear_add`` on zeros, the weight in the backend's layout (every rank asks alike: the
    call is a collective)."""
    if row == "linear_all_reduce_add":
        fast = getattr(comm.fast, "linear_add", None)
        rows, k, n = shape
        if fast is None or not comm._fits(torch.empty(rows, n, dtype=dtype, device="meta")):
            return False
        w = torch.zeros(k, n, dtype=dtype, device=device).t() if transposed else torch.zeros(n, k, dtype=dtype,
                                                                                               device=device)
        return fast(torch.zeros(rows, k, dtype=dtype, device=device), w, None,
                    torch.zeros(rows, n, dtype=dtype, device=device)) is not None
    if row != "all_reduce_add_rms_norm" or getattr(comm.fast, "add_rms_norm", None) is None:
        return False
    return comm._fits(torch.empty(shape, dtype=dtype, device="meta"))


@dataclass
class RankResult:
    key: str
    problem: str
    perf_us: float | None = None
    gbps: float | None = None
    fused: bool = False
    error: float | None = None  # a passing case's worst error and its bound, where it has them
    bound: float | None = None


def _rank_main(rank: int, port: int, backend_name: str, todo: list[tuple[str, str, str]], out_dir: str,
               perf: dict | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    import torch.distributed as dist

    from chitu_core.distributed.communicator import Communicator
    from chitu_core.plugins.discovery import backend_ops, get_backend

    backend = get_backend(backend_name)
    index = rank % max(backend.device_count(), 1)
    backend.set_device(index)  # as the engine does: kernels launch on the rank's own device
    device = backend.device(index)
    comm = Communicator.from_env(backend.process_group_backend())
    comm.use_fast_all_reduce(backend)  # as the engine does: small messages take the backend's own path
    ops = backend_ops(backend)
    shapes = {(row, label): shape for row, label, shape in VARIANTS}
    transposed = backend.transposed_linear_weights()
    results = []
    try:
        for row, label, dtype_str in todo:
            dtype = getattr(torch, dtype_str)
            key = f"{row}|{label}|{dtype_str}"
            try:
                shape, passed = shapes[(row, label)], None
                if row == "linear_all_reduce_add":  # the one row with an error to report beside its bound
                    problem, call, passed = _check_linear(comm, ops, shape, "with bias" in label, dtype, device,
                                                          transposed)
                else:
                    problem, call = _check(comm, ops, row, label, shape, dtype, device)
            except Exception as exc:  # the backend's own failure is the case's result
                problem, call, passed = f"raised {type(exc).__name__}: {exc}", None, None
            result = RankResult(key, problem, fused=_fused(comm, row, shapes[(row, label)], dtype, device, transposed),
                                error=passed and passed.error, bound=passed and passed.bound)
            # Time only where both ranks have a call that passed: a collective timed on one rank alone hangs.
            ready = torch.tensor([int(call is not None and not problem)], dtype=torch.int32, device=device)
            if perf is not None and int(comm.all_reduce(ready)) == WORLD:
                n = 1
                for s in shapes[(row, label)]:
                    n *= s
                target = Target(backend, backend_ops(backend), device, ThresholdBook(), PerfOptions(**perf))
                # Both ranks must make the same number of calls: one per repeat, not a calibrated count.
                p = time_call(target, call, n * torch.empty((), dtype=dtype).element_size(), calls=1)
                result.perf_us, result.gbps = p.median_us, p.gbps
            results.append(asdict(result))
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CollectiveBatch:
    """Runs every selected collective case in one group of two spawned ranks."""

    def run_all(self, target: Target, cases: list[Case]) -> list[Outcome]:
        import torch.multiprocessing as mp

        todo = [(c.row, c.label, dtype_name(c.dtype)) for c in cases]
        perf = None if target.perf is None else {"warmup": target.perf.warmup, "repeats": target.perf.repeats}
        with tempfile.TemporaryDirectory() as out_dir:
            ctx = mp.start_processes(_rank_main, args=(_free_port(), target.backend.name, todo, out_dir, perf),
                                     nprocs=WORLD, join=False, start_method="spawn")
            deadline = time.monotonic() + TIMEOUT_S
            try:
                while not ctx.join(timeout=1.0):
                    if time.monotonic() > deadline:
                        for p in ctx.processes:
                            p.kill()
                        return [Outcome(Verdict.fail(f"the two ranks did not finish within {TIMEOUT_S:.0f} s"))] * len(cases)
            except Exception as exc:  # a rank died: every case of the group fails with its error
                detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                return [Outcome(Verdict.fail(f"a rank failed: {detail}"))] * len(cases)
            ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD)]
        outcomes, source = [], collective_source(target.backend)
        for i, _ in enumerate(cases):
            problems = [f"rank {r}: {rows[i]['problem']}" for r, rows in enumerate(ranks) if rows[i]["problem"]]
            if problems:
                verdict = Verdict(False, 1.0, 0.0, "; ".join(problems))
            else:
                verdict = worst([Verdict(True, rows[i]["error"] or 0.0, rows[i]["bound"] or 0.0) for rows in ranks])
            us = ranks[0][i]["perf_us"]
            # The fused rows are "native" only where the backend fuses them, else the core composes them.
            own = "native" if ranks[0][i]["fused"] else "fallback" if cases[i].row in FUSED_ROWS else source
            outcomes.append(Outcome(verdict, own, Perf(us, ranks[0][i]["gbps"]) if us else None))
        return outcomes


def collective_source(backend: Backend) -> str:
    """"native" where the backend names its process group, "fallback" where it leaves the core's default (gloo)."""
    own = type(backend).process_group_backend is not Backend.process_group_backend
    return "native" if own else "fallback"


def collective_cases(backend, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    batch = CollectiveBatch()
    cases = []
    for dtype in dtypes:
        if dtype not in DTYPES:
            continue
        for row, label, _ in VARIANTS:
            params = {"world_size": WORLD, "device_count": backend.device_count(),
                      "process_group_backend": backend.process_group_backend()}
            family = FUSED_ROWS.get(row, "collective")
            cases.append(Case(row, row, family, dtype, params, label, batch=batch))
    return cases
