"""All-reduce latency on the GPUs of one host, through NCCL and through the backend's small-message
path (contract 1.4), as the engine calls them (``Communicator.all_reduce``, inside a CUDA graph):

    torchrun --nproc-per-node 2 plugins/nvidia/scripts/allreduce_bench.py [--out FILE.json]

Each size is first checked (the sum of known values, exact in bf16), then timed as the median over
5 replays of a graph of 50 calls. Then the layer boundary (contract 1.5: all-reduce + residual add +
RMSNorm) at a decode step's shapes, composed (the fast all-reduce, then fused_add_rms_norm) and in one
kernel (the backend's ``add_rms_norm``): the two must agree bit for bit (two ranks: the sum of two bf16
values is rounded once either way), and are timed alike. Then the row-parallel linear at batch 1 with its
all-reduce and residual add (contract 1.13) at Llama-3.1-8B's o_proj and down_proj shares under two ranks,
composed (``linear``, the fast all-reduce, the add) and in one kernel (the backend's ``linear_add``): both
against float64 (NMSE), against each other (largest difference), and timed alike (the weight stays in L2
across the graph's calls for the smaller shape, alike for both). Rank 0 prints the tables and writes the JSON.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from chitu_core.distributed import Communicator
from chitu_core.plugins.discovery import get_backend

SIZES = [8 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20]
BOUNDARY_ROWS, HIDDEN = (1, 8, 32, 64), 4096
CALLS = 50


def timed(comm: Communicator, x: torch.Tensor, call=None) -> float:
    """Microseconds per call (default: an all-reduce of x): graph replays of CALLS calls."""
    call = call or (lambda: comm.all_reduce(x))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(times)


def boundary_rows(comm: Communicator, backend, rank: int, world: int) -> list[dict]:
    """The layer boundary composed and in one kernel, checked against each other and timed."""
    from chitu_core.plugins.discovery import backend_ops

    ops, out = backend_ops(backend), []
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.rand(HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    for rows in BOUNDARY_ROWS:
        partial = torch.randn(world, rows, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)[rank]
        residual = torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        composed = ops.fused_add_rms_norm(comm.all_reduce(partial.clone()), residual, weight, 1e-5)
        fused = comm.fast.add_rms_norm(partial.clone(), residual, weight, 1e-5) if comm.fast else None
        row = {"rows": rows, "fused": fused is not None,
               "equal": fused is not None and all(torch.equal(a, b) for a, b in zip(fused, composed))}
        x = partial.clone()
        row["composed_us"] = round(timed(comm, x, lambda: ops.fused_add_rms_norm(comm.all_reduce(x), residual, weight, 1e-5)), 2)
        row["fused_us"] = round(timed(comm, x, lambda: comm.fast.add_rms_norm(x, residual, weight, 1e-5)), 2) if fused else None
        out.append(row)
    return out


LINEAR_SHAPES = ((4096, 2048, "o_proj"), (4096, 7168, "down_proj"))  # (outputs, one rank's inputs, name)


def linear_rows(comm: Communicator, backend, rank: int, world: int) -> list[dict]:
    """The row-parallel linear composed and in one kernel, checked and timed."""
    from chitu_core.plugins.discovery import backend_ops

    ops, out = backend_ops(backend), []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for n, k, name in LINEAR_SHAPES:
        xs = [torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(world)]
        ws = [(torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16) for _ in range(world)]
        residual = torch.randn(1, n, device="cuda", generator=gen).to(torch.bfloat16)
        x, w = xs[rank], ws[rank].t()  # [N, K] over [K, N] storage: the backend's layout (transposed_linear_weights)
        want = residual.double() + sum(a.double() @ b.double() for a, b in zip(xs, ws))
        composed = residual + comm.all_reduce(ops.linear(x, w, None))
        fast = getattr(comm.fast, "linear_add", None)
        fused = fast(x, w, None, residual) if fast else None
        nmse = lambda got: float(((got.double() - want) ** 2).sum() / (want ** 2).sum())  # noqa: E731
        row = {"name": name, "n": n, "k": k, "fused": fused is not None, "composed_nmse": nmse(composed),
               "fused_nmse": nmse(fused) if fused is not None else None,
               "max_diff": float((fused.float() - composed.float()).abs().max()) if fused is not None else None}
        row["composed_us"] = round(timed(comm, x, lambda: residual + comm.all_reduce(ops.linear(x, w, None))), 2)
        row["fused_us"] = round(timed(comm, x, lambda: fast(x, w, None, residual)), 2) if fused is not None else None
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = get_backend("nvidia")
    backend.set_device(rank)
    nccl = Communicator.from_env(backend.process_group_backend())
    fast = Communicator(nccl.group, world, rank)
    fast.use_fast_all_reduce(backend)
    rows = []
    for size in SIZES:
        n = size // 2
        values = (torch.arange(n, device="cuda") % 31 - 15).to(torch.bfloat16)
        row = {"bytes": size, "fast_path": fast.fast is not None and size <= fast.fast.max_bytes}
        for name, comm in (("nccl", nccl), ("fast", fast)):
            x = values * (rank + 1)
            comm.all_reduce(x)
            row[f"{name}_correct"] = bool(torch.equal(x, values * sum(range(1, world + 1))))
            row[f"{name}_us"] = round(timed(comm, values.clone()), 2)
        rows.append(row)
    boundary = boundary_rows(fast, backend, rank, world)
    linear = linear_rows(fast, backend, rank, world)
    if rank == 0:
        print(f"all-reduce, {world} ranks, bf16, {torch.cuda.get_device_name()}: microseconds per call (graph replay)")
        print("| bytes | NCCL us | fast path us | fast path taken | both correct |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['bytes']} | {r['nccl_us']} | {r['fast_us']} | {r['fast_path']} | {r['nccl_correct'] and r['fast_correct']} |")
        print(f"\nlayer boundary (all-reduce + add + RMSNorm), bf16 [T, {HIDDEN}]: microseconds per call (graph replay)")
        print("| rows | composed us | one kernel us | one kernel taken | bitwise equal |")
        print("|---|---|---|---|---|")
        for r in boundary:
            print(f"| {r['rows']} | {r['composed_us']} | {r['fused_us']} | {r['fused']} | {r['equal']} |")
        print("\nrow-parallel linear + all-reduce + add, bf16, one row: microseconds per call (graph replay)")
        print("| shape | composed us | one kernel us | one kernel taken | NMSE composed / one kernel | largest diff |")
        print("|---|---|---|---|---|---|")
        for r in linear:
            print(f"| {r['name']} {r['n']}x{r['k']} | {r['composed_us']} | {r['fused_us']} | {r['fused']} | "
                  f"{r['composed_nmse']:.2e} / {r['fused_nmse'] or 0:.2e} | {r['max_diff']} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "world_size": world, "rows": rows,
                           "boundary": boundary, "linear": linear}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
