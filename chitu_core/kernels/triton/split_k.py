"""Split-K matmuls: float32 partial sums added in a fixed order (deterministic), the bias added once,
the result cast to the output's dtype. Two ways:

* ``finish_split`` (in the matmul kernel itself, no second launch): each slice of K stores its tile of
  partial sums, then bumps its output tile's counter (acquire-release); the slice that arrives last adds
  every slice in a fixed order, stores the tile and resets the counter. The counters are one zeroed buffer per
  device (``split_counters``) that every launch leaves zeroed again, so launches queued on one stream
  (and graph replays of them) share it; the side queue (contract 1.8) has buffers of its own (``QUEUE``).
* ``sum_splits``: a second kernel over the partials [S, M, N].
"""

from functools import cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.backend import QUEUE

MAX_SPLIT_TILES = 1 << 16


def split_counters(device: torch.device) -> torch.Tensor:
    """One zeroed int32 counter per output tile, shared by the split-K launches queued on ``device``'s
    current work queue (``QUEUE``)."""
    return _counters(device, QUEUE.get())


@cache
def _counters(device: torch.device, queue: int) -> torch.Tensor:
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


class RowSplit(NamedTuple):
    """A one-row matrix-vector launch split along K: ``k_per_split`` features a slice, ``split`` slices,
    ``blocks`` column blocks (the grid is (blocks, split)), float32 ``partials`` [split, N] (``out`` itself
    without a split) and the current queue's ``counters``."""

    k_per_split: int
    split: int
    blocks: int
    partials: torch.Tensor
    counters: torch.Tensor


def row_split(k: int, n: int, block_k: int, block_n: int, split_k: int, out: torch.Tensor, what: str) -> RowSplit:
    """Slices of whole BLOCK_K steps, at most ``split_k`` of them, for an [N] output ``out``."""
    steps = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(steps, max(1, min(split_k, steps))) * block_k
    split = triton.cdiv(k, k_per_split)
    blocks = triton.cdiv(n, block_n)
    if split > 1:
        check_split_tiles(blocks, what)
    partials = torch.empty((split, n), dtype=torch.float32, device=out.device) if split > 1 else out
    return RowSplit(k_per_split, split, blocks, partials, split_counters(out.device))


def check_split_tiles(tiles: int, what: str) -> None:
    if tiles > MAX_SPLIT_TILES:
        raise ValueError(f"{what}: {tiles} output tiles split along K exceed the {MAX_SPLIT_TILES} counters; "
                         "use larger tiles or no split")


@triton.jit
def row_slice(N, K, k_per_split, BLOCK_N: tl.constexpr):
    """A one-row split-K program's output columns rn, which of them exist, and its slice [k_lo, k_hi)
    of K (grid: column blocks, slices)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * k_per_split
    return rn, rn < N, k_lo, tl.minimum(k_lo + k_per_split, K)


@triton.jit
def k_mask(k, k_hi, EVEN_K: tl.constexpr):
    """Which features k lie below k_hi. EVEN_K (K a whole number of tiles, and so every slice): all of them,
    as a constant the compiler sees, so that loads along K are not split element by element."""
    if EVEN_K:
        return tl.full(k.shape, True, tl.int1)
    return k < k_hi


@triton.jit
def finish_split(acc, out, partials, counters, bias, rm, rn, mask, M, N, stride_om, stride_b, tile, pid_s, split,
                 SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, THREADS: tl.constexpr = 32):
    """Store acc [BM, BN] (float32 sums over this program's slice of K; rows rm, columns rn) into out
    [M, N] (row stride stride_om, column stride 1) + bias: directly without SPLIT_K, else through
    partials [split, M, N] (contiguous) and ``tile``'s counter, the last slice adding them in a fixed
    order: one after another, or for one row (the matrix-vector kernels, split many ways) a chunk of
    slices a load (about 64 float32 a thread of the program's THREADS, 2 to 16 slices), each chunk summed
    as a tree."""
    offs = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if not SPLIT_K:
        if HAS_BIAS:
            acc += tl.load(bias + rn * stride_b, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)
    else:
        part = rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(partials + pid_s * M * N + part, acc, mask=mask)
        tl.debug_barrier()  # every thread's partials written before the counter moves
        done = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
        if done == split - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            if acc.shape[0] == 1:  # one row: CHUNK slices a load, so the reads overlap instead of queueing
                CHUNK: tl.constexpr = min(16, max(2, 64 * THREADS // acc.shape[1]))
                rs = tl.arange(0, CHUNK)
                for s0 in range(0, split, CHUNK):
                    got = tl.load(partials + (s0 + rs).to(tl.int64)[:, None] * M * N + part,
                                  mask=(s0 + rs < split)[:, None] & mask, other=0.0, cache_modifier=".cg")
                    total += tl.sum(got, axis=0)[None, :]
            else:
                for s in range(split):
                    total += tl.load(partials + s * M * N + part, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias + rn * stride_b, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out + offs, total.to(out.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counters + tile, 0)


@triton.jit(do_not_specialize=["total"])
def _sum_splits_kernel(out, parts, bias, total, N, splits, stride_b, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(parts + s * total + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + (i % N) * stride_b, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + i, acc.to(out.dtype.element_ty), mask=ok)


def sum_splits(parts: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out [M, N] (contiguous) = sum over s, in order, of parts [S, M, N] (float32, contiguous), + bias [N]."""
    total, n = out.numel(), out.shape[-1]
    block = 1024
    _sum_splits_kernel[(triton.cdiv(total, block),)](
        out, parts, bias if bias is not None else out, total, n, parts.shape[0],
        bias.stride(0) if bias is not None else 0, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
