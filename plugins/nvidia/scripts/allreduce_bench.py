"""All-reduce latency on the GPUs of one host, through NCCL and through the backend's small-message
path (contract 1.4), as the engine calls them (``Communicator.all_reduce``, inside a CUDA graph):

    torchrun --nproc-per-node 2 plugins/nvidia/scripts/allreduce_bench.py [--out FILE.json]

Each size is first checked (the sum of known values, exact in bf16), then timed as the median over
5 replays of a graph of 50 calls. Rank 0 prints a table and writes the JSON.
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

SIZES = [8 << 10, 64 << 10, 512 << 10, 2 << 20]
CALLS = 50


def timed(comm: Communicator, x: torch.Tensor) -> float:
    """Microseconds per all-reduce: graph replays of CALLS calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            comm.all_reduce(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            comm.all_reduce(x)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(times)


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
    if rank == 0:
        print(f"all-reduce, {world} ranks, bf16, {torch.cuda.get_device_name()}: microseconds per call (graph replay)")
        print("| bytes | NCCL us | fast path us | fast path taken | both correct |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['bytes']} | {r['nccl_us']} | {r['fast_us']} | {r['fast_path']} | {r['nccl_correct'] and r['fast_correct']} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "world_size": world, "rows": rows}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
