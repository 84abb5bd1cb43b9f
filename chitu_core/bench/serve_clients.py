"""Client processes for ``bench serve --client-procs P``.

One Python client parses a few thousand stream events a second; a server that
streams faster would be measured at the client's speed. With P processes, each
sends an even share of a level's requests with an even share of its concurrency;
they start together (a barrier) and the level lasts from the first start to the
last end, on the system-wide monotonic clock.

Each process warms its client (one ``GET /v1/models``) before the barrier: a fresh
client's first request imports its transport's modules while it holds the event
loop (17 ms on an idle core), which held back all of the process's requests: on
an H100 machine each process's 8 went out over 25-42 ms, on 2 cores over 100 ms.
"""

import argparse
import asyncio
import multiprocessing
import time

_BARRIER = None


def _init(barrier) -> None:
    global _BARRIER
    _BARRIER = barrier


def _worker(args: argparse.Namespace, prompts: list, concurrency: int, output_len: int) -> tuple[float, float, list, int]:
    from chitu_core.bench.serve import Client, gather_level

    async def level():
        client = Client(args, concurrency)
        try:
            await client.models()
            _BARRIER.wait()
            start = time.monotonic()
            results, _, peak = await gather_level(client, prompts, concurrency, output_len)
            return start, time.monotonic(), results, peak
        finally:
            await client.close()

    return asyncio.run(level())


def gather_in_processes(args: argparse.Namespace, prompts: list, concurrency: int, output_len: int,
                        procs: int) -> tuple[list, float, int]:
    """(results in prompt order, seconds, the sum of the processes' peaks in flight)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(procs)
    shares = [prompts[i::procs] for i in range(procs)]
    gates = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    with context.Pool(procs, initializer=_init, initargs=(barrier,)) as pool:
        parts = pool.starmap(_worker, [(args, share, gate, output_len) for share, gate in zip(shares, gates)])
    results: list = [None] * len(prompts)
    for i, (_, _, part, _) in enumerate(parts):
        results[i::procs] = part
    duration = max(p[1] for p in parts) - min(p[0] for p in parts)
    return results, duration, sum(p[3] for p in parts)
