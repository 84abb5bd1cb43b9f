"""All-reduce latency on the GPUs of one host, through NCCL and through the backend's small-message
path (contract 1.4), as the engine calls them (``Communicator.all_reduce``, inside a CUDA graph):

    torchrun --nproc-per-node 2 plugins/nvidia/scripts/allreduce_bench.py [--out FILE.json]

Each size is first checked (the sum of known values, exact in bf16), then timed as the median over
5 replays of a graph of 50 calls. Then the layer boundary (contract 1.5: all-reduce + residual add +
RMSNorm) at a decode step's shapes, composed (the fast all-reduce, then fused_add_rms_norm) and in one
kernel (the backend's ``add_rms_norm``): the two must agree bit for bit (two ranks: the sum of two bf16
values is rounded once either way), and are timed alike. Rank 0 prints the tables and writes the JSON.
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
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "world_size": world, "rows": rows,
                           "boundary": boundary}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
