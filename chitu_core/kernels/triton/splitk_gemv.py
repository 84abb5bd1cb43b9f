"""A few rows of x (up to ``MAX_ROWS``) times a 16-bit weight, split along K: wide column tiles (512 bytes
a row of the transposed storage), tensor-core steps on the rows padded to 16, and Triton's pipeliner keeping
``num_stages`` tiles of the weight and of x in flight through shared memory. With the decode-step fusions of
contract 1.9: the RMSNorm of x in the prologue (``norm_weight``, optionally the gated activation of a
merged gate/up projection), or the residual add in the epilogue.

Why another matrix-vector kernel: ``dense_gemv`` and ``fused_gemv`` keep one tile a program in flight in
registers, narrow tiles (8 to 64 columns), one program per compute unit. On large weights this one streams
faster: the NVIDIA backend gives it Llama-3.1-8B's qkv, gate/up and down at batch 1
(``chitu_nvidia.ops.splitk_takes``; docs/benchmarks/nvidia-h200-splitk-gemv.md). On small ones the split's
finish costs more than the wide tiles save (plugins/nvidia/scripts/splitk_gemv_sweep.py).

x goes into the product as it is loaded, so the pipeliner loads it ahead with the weight; with a norm, x
times the norm's weight is rounded to x's dtype before the product (as an unfused norm's output is), the
sums of squares kept in float32 and the norm's factor applied to the sums.

A split's slices each store their float32 sums (and, with a norm, their rows' sums of squares) and bump
their column tile's counter; the slice that arrives last loads every slice at once (a few rows a load, so
the reads overlap instead of queueing), adds them as a tree of fixed shape and finishes the tile: the norm's
factor, the bias, the activation or the residual, all in float32, rounded once (``split_k``'s counters,
left zeroed). Deterministic: the same bits for any arrival order.

Programmatic dependent launch: every program waits for its predecessor before its loop (the pipeliner
issues the first tiles after the wait). The default tiles keep the grid to one program a compute unit,
so that all of it is resident beside the kernel before it.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.fused_gemv import ACTIVATIONS, _epilogue
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_launch
from chitu_core.kernels.triton.split_k import check_split_tiles, k_mask, split_counters

MAX_ROWS = 16
"""Most rows the kernel takes (one tensor-core step's 16); more go to a GEMM."""
MAX_SPLIT = 16
"""Most slices of K: the last slice loads every slice's sums of a few rows at once (16 x 256 columns: 32
float32 registers a thread)."""


@dataclass(frozen=True)
class SplitKGemvConfig:
    """block_n output columns a program (of each half where gated), block_k features a step, split_k
    slices of K at most, num_stages steps in flight, num_warps."""

    block_n: int
    block_k: int
    split_k: int
    num_stages: int = 4
    num_warps: int = 4


def splitk_gemv_config(n: int, k: int, gated: bool, units: int) -> SplitKGemvConfig:
    """256 columns a program (128 of each half where gated; 128 below 2048 outputs), 64 features a step, 4
    steps in flight, and K split into as many slices as keep the programs at most one a compute unit (a
    kernel launched dependent shares the units with the one before it: a second wave would start late),
    each slice at least two steps deep, at most ``MAX_SPLIT``."""
    block_n = (128 if gated or n < 2048 else 256)
    block_k = 64
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(k, 2 * block_k), units // tiles, MAX_SPLIT))
    return SplitKGemvConfig(block_n, block_k, split)


@triton.jit
def _w_tile(w, ks, k_ok, rn, n_ok, stride_wn, stride_wk, K_MAJOR: tl.constexpr):
    """The weight tile at features ks, columns rn, oriented [BLOCK_K, BLOCK_N] for the product."""
    if K_MAJOR:
        tile = tl.load(w + rn[:, None].to(tl.int64) * stride_wn + ks[None, :] * stride_wk,
                       mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        return tl.trans(tile)
    return tl.load(w + ks[:, None].to(tl.int64) * stride_wk + rn[None, :] * stride_wn,
                   mask=k_ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def _splitk_gemv_kernel(out, partials, squares, counters, x, w, bias, nw, res, M, N, K, k_per_split, split, eps,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_b, stride_nw, stride_rm, stride_rn,
                        stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        K_MAJOR: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_P: tl.constexpr,
                        FINISH_ROWS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                        STAGES: tl.constexpr, PDL: tl.constexpr):
    tile_id, pid_s = tl.program_id(0), tl.program_id(1)
    rn = tile_id * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N  # N: output columns (of each half where gated)
    n_load = n_ok
    if EVEN_N:  # a constant the compiler sees: loads along N stay whole vectors
        n_load = tl.full((BLOCK_N,), True, tl.int1)
    ru = rn + N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    kk = tl.arange(0, BLOCK_K)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    gdc_enter(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = acc
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        ks = k0 + kk
        k_ok = k_mask(ks, k_hi, EVEN_K)
        tile = _w_tile(w, ks, k_ok, rn, n_load, stride_wn, stride_wk, K_MAJOR)
        a = tl.load(x + rm[:, None] * stride_xm + ks[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # straight into the product: the pipeliner then loads it ahead, as the weight
        if NORM:
            xk = a.to(tl.float32)
            ss += tl.sum(xk * xk, axis=1)
            a = (xk * tl.load(nw + ks * stride_nw, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(tile.dtype)
        acc = tl.dot(a, tile, acc)
        if ACT != "none":
            acc_u = tl.dot(a, _w_tile(w, ks, k_ok, ru, n_load, stride_wn, stride_wk, K_MAJOR), acc_u)
    if not SPLIT_K:
        _epilogue(acc, acc_u, ss, out, bias, res, rm, m_ok, rn, ru, n_ok, K, eps, stride_b, stride_rm, stride_rn,
                  stride_om, NORM, ACT, RESIDUAL, HAS_BIAS)
    else:
        width = 2 * N if ACT != "none" else N
        ok = m_ok[:, None] & n_ok[None, :]
        part = rm.to(tl.int64)[:, None] * width + rn[None, :]
        tl.store(partials + pid_s * BLOCK_M * width + part, acc, mask=ok)
        if ACT != "none":
            tl.store(partials + pid_s * BLOCK_M * width + part + N, acc_u, mask=ok)
        if NORM:  # this tile's own copy of the slice's sums of squares: no other tile's slices are awaited
            tl.store(squares + (tile_id * split + pid_s) * BLOCK_M + rm, ss)
        tl.debug_barrier()  # every thread's stores made before the counter moves
        done = tl.atomic_add(counters + tile_id, 1, sem="acq_rel", scope="gpu")
        if done == split - 1:  # the last slice: all slices of FINISH_ROWS rows a load, summed as a tree
            sp = tl.arange(0, SPLIT_P)
            s_ok = sp < split
            for r0 in range(0, M, FINISH_ROWS):
                rr = r0 + tl.arange(0, FINISH_ROWS)
                r_ok = rr < M
                offs = (sp.to(tl.int64)[:, None, None] * BLOCK_M * width + rr[None, :, None] * width
                        + rn[None, None, :])
                m3 = s_ok[:, None, None] & r_ok[None, :, None] & n_ok[None, None, :]
                y = tl.sum(tl.load(partials + offs, mask=m3, other=0.0, cache_modifier=".cg"), axis=0)
                up = y
                if ACT != "none":
                    up = tl.sum(tl.load(partials + offs + N, mask=m3, other=0.0, cache_modifier=".cg"), axis=0)
                total_ss = tl.zeros((FINISH_ROWS,), dtype=tl.float32)
                if NORM:
                    sq = squares + (tile_id * split + sp[:, None]) * BLOCK_M + rr[None, :]
                    total_ss = tl.sum(tl.load(sq, mask=s_ok[:, None] & r_ok[None, :], other=0.0,
                                              cache_modifier=".cg"), axis=0)
                _epilogue(y, up, total_ss, out, bias, res, rr, r_ok, rn, ru, n_ok, K, eps, stride_b, stride_rm,
                          stride_rn, stride_om, NORM, ACT, RESIDUAL, HAS_BIAS)
            tl.atomic_xchg(counters + tile_id, 0)


def splitk_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0, activation: str | None = None,
                residual: torch.Tensor | None = None, config: SplitKGemvConfig | None = None,
                pdl: bool | None = None) -> torch.Tensor:
    """x [..., K] of at most ``MAX_ROWS`` rows; weight [N, K] (16-bit, x's dtype) with either dimension
    contiguous; bias [N] or None. Plain: x @ weight.T (+ bias). With ``norm_weight`` [K]: rms_norm(x) @
    weight.T (+ bias); with ``activation`` too, its gated activation ([..., N/2]); with ``residual`` [..., N]
    (and no norm): residual + x @ weight.T (+ bias). Output in x.dtype, float32 accumulation, rounded once.
    ``pdl``: launch dependent on the previous kernel (default: ``pdl.pdl_launch``)."""
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // max(1, k)
    if rows > MAX_ROWS or rows == 0:
        raise ValueError(f"splitk_gemv takes 1 to {MAX_ROWS} rows, got {rows}")
    if weight.dtype not in (torch.bfloat16, torch.float16) or x.dtype != weight.dtype:
        raise ValueError(f"splitk_gemv: a 16-bit weight and x of its dtype, got {weight.dtype} and {x.dtype}")
    if activation not in ACTIVATIONS or (activation is not None and n % 2):
        raise ValueError(f"splitk_gemv: activation {activation!r} with {n} outputs (one of {list(ACTIVATIONS)}, "
                         "an even width where gated)")
    n_out = n // 2 if activation is not None else n
    x2 = x.reshape(rows, k)
    cfg = config or splitk_gemv_config(n_out, k, activation is not None, num_compute_units(x.device))
    steps = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(steps, max(1, min(cfg.split_k, steps, MAX_SPLIT))) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n_out, cfg.block_n)
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    if split > 1:
        check_split_tiles(tiles, "splitk_gemv")
        partials = torch.empty(split * 16 * n, dtype=torch.float32, device=x.device)
        squares = torch.empty(tiles * split * 16 if norm_weight is not None else 1, dtype=torch.float32,
                              device=x.device)
    else:
        partials = squares = out
    r2 = residual.reshape(rows, n) if residual is not None else out
    b = bias if bias is not None else out
    use_pdl = pdl_launch(x.device) if pdl is None else pdl
    split_p = triton.next_power_of_2(split)
    halves = 2 if activation is not None else 1
    finish_rows = min(16, max(1, 4096 // (split_p * cfg.block_n * halves)))
    _splitk_gemv_kernel[(tiles, split)](
        out, partials, squares, split_counters(x.device), x2, weight, b,
        norm_weight if norm_weight is not None else x2, r2, rows, n_out, k, k_per_split, split, eps,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), b.stride(0) if bias is not None else 0,
        norm_weight.stride(0) if norm_weight is not None else 0, r2.stride(0), r2.stride(1), out.stride(0),
        BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_MAJOR=weight.stride(1) == 1,
        NORM=norm_weight is not None, ACT=ACTIVATIONS[activation], RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, SPLIT_K=split > 1, SPLIT_P=split_p, FINISH_ROWS=finish_rows,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n_out % cfg.block_n == 0, STAGES=cfg.num_stages, PDL=use_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if use_pdl else {}))
    return out.reshape(*x.shape[:-1], n_out)
