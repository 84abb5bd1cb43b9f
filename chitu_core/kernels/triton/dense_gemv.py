"""linear for one row of x (batch-1 decode) with a 16-bit or float32 weight: a matrix-vector product of
our own, for the skinny shapes where a BLAS picks tiles that leave most of the device idle.

A program owns BLOCK_N output columns and one of ``split`` slices of K. Each step it loads a
[BLOCK_K, BLOCK_N] tile of the weight, along whichever of its dimensions is contiguous (K_MAJOR: the
weight's rows [N, K] are contiguous; else the transposed storage [K, N], ``Backend.transposed_linear_weights``),
and multiplies it elementwise into a float32 tile of partial sums, reduced once after the loop. The
next tile's load is issued before this one is used. Split-K as ``gemv.int4_gemv`` does it
(``split_k.finish_split``: the last slice to finish adds the slices in order, deterministic).

Programmatic dependent launch (``pdl``): the first weight tile is loaded before ``gdc_enter`` waits, so the
load overlaps the previous kernel's tail; nothing is read from x or written before the wait.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_launch
from chitu_core.kernels.triton.split_k import finish_split, row_slice, row_split


@dataclass(frozen=True)
class DenseGemvConfig:
    """block_n output columns a program, block_k features a step, split_k slices of K, num_warps."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4


def dense_gemv_config(n: int, k: int, k_major: bool, compute_units: int) -> DenseGemvConfig:
    """Tiles from the sweeps on an H100 (plugins/nvidia/scripts/dense_gemv_sweep.py).

    Rows of the weight contiguous (routers): 8 columns a program reading 1024 features a step with 8 warps,
    K split until there are about two programs per compute unit, each slice at least two tiles deep (a
    64 x 2048 float32 router 4.4 -> 2.1 us against cuBLAS).

    The transposed storage: no split, and narrow, deep tiles, so that every program has its whole share of
    the weight in flight at once: about one program per compute unit (block_n the power of two of
    N / units, 8 to 64 columns), up to 1024 features a step, 2048 elements a warp. There (SmolLM2-135M,
    Qwen3-1.7B shapes): 960 x 576 2.0 us, 576 x 1536 2.4 us, 4096 x 2048 8.1 us, against cuBLAS's 3.6, 5.0
    and 9.2 us."""
    if k_major:
        block_n, block_k, warps = 8, min(1024, triton.next_power_of_2(k)), 8
        programs, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        split = max(1, min(steps // 2, triton.cdiv(2 * compute_units, programs)))
        return DenseGemvConfig(block_n, block_k, split, num_warps=warps)
    block_n = min(64, max(8, triton.next_power_of_2(triton.cdiv(n, compute_units))))
    block_k = min(1024, 16384 // block_n, triton.next_power_of_2(k))
    return DenseGemvConfig(block_n, block_k, 1, num_warps=min(8, max(2, block_n * block_k // 2048)))


@triton.jit
def _tile(w, rk, rn, k_hi, n_ok, stride_wn, stride_wk, K_MAJOR: tl.constexpr):
    """The weight tile at features rk (oriented [BLOCK_N, BLOCK_K] if K_MAJOR else [BLOCK_K, BLOCK_N])."""
    k_ok = rk < k_hi
    if K_MAJOR:
        tile = tl.load(w + rn[:, None].to(tl.int64) * stride_wn + rk[None, :] * stride_wk,
                       mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    else:
        tile = tl.load(w + rk[:, None].to(tl.int64) * stride_wk + rn[None, :] * stride_wn,
                       mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    return tile


@triton.jit
def row_sums(nxt, w, x, kk, rn, n_ok, k_lo, k_hi, stride_xk, stride_wn, stride_wk, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, K_MAJOR: tl.constexpr):
    """One row of x times the weight's columns rn over features [k_lo, k_hi): [BLOCK_N] float32 sums. ``nxt``
    is the first weight tile, already loaded (before a dependent launch's wait); each step issues the next
    tile's load before it multiplies, into a tile of partial sums reduced once after the loop."""
    if K_MAJOR:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        tile = nxt
        nxt = _tile(w, k0 + BLOCK_K + kk, rn, k_hi, n_ok, stride_wn, stride_wk, K_MAJOR)
        xk = tl.load(x + (k0 + kk) * stride_xk, mask=k0 + kk < k_hi, other=0.0).to(tl.float32)
        if K_MAJOR:
            acc2 += tile.to(tl.float32) * xk[None, :]
        else:
            acc2 += tile.to(tl.float32) * xk[:, None]
    return tl.sum(acc2, axis=1 if K_MAJOR else 0)


@triton.jit(do_not_specialize=["k_per_split", "split"])
def _dense_gemv_kernel(out, partials, counters, x, w, bias, N, K, k_per_split, split, stride_xk, stride_wn, stride_wk,
                       stride_b, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_MAJOR: tl.constexpr,
                       SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    rn, n_ok, k_lo, k_hi = row_slice(N, K, k_per_split, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    nxt = _tile(w, k_lo + kk, rn, k_hi, n_ok, stride_wn, stride_wk, K_MAJOR)  # weights: no wait
    gdc_enter(PDL)
    acc = row_sums(nxt, w, x, kk, rn, n_ok, k_lo, k_hi, stride_xk, stride_wn, stride_wk, BLOCK_N, BLOCK_K, K_MAJOR)
    finish_split(acc[None, :], out, partials, counters, bias, tl.arange(0, 1), rn, n_ok[None, :], 1, N, N, stride_b,
                 tl.program_id(0), tl.program_id(1), split, SPLIT_K, HAS_BIAS)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: DenseGemvConfig | None = None, pdl: bool | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] with one row; weight [N, K] with either dimension contiguous; bias [N] or None ->
    [..., N] in ``out_dtype`` (default x.dtype), float32 accumulation; x and weight may differ in dtype
    (a float32 router over a bfloat16 row, ``linear_float32``). ``pdl``: launch dependent on the previous
    kernel (default: where the device and Triton support it, ``pdl.pdl_launch``)."""
    k, n = x.shape[-1], weight.shape[0]
    k_major = weight.stride(1) == 1
    cfg = config or dense_gemv_config(n, k, k_major, num_compute_units(x.device))
    row = x.reshape(k)
    out = torch.empty(n, dtype=out_dtype or x.dtype, device=x.device)
    plan = row_split(k, n, cfg.block_k, cfg.block_n, cfg.split_k, out, "dense_gemv")
    b = bias if bias is not None else out
    use_pdl = pdl_launch(x.device) if pdl is None else pdl
    _dense_gemv_kernel[(plan.blocks, plan.split)](
        out, plan.partials, plan.counters, row, weight, b, n, k, plan.k_per_split, plan.split, row.stride(0),
        weight.stride(0), weight.stride(1), b.stride(0) if bias is not None else 0, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, K_MAJOR=k_major, SPLIT_K=plan.split > 1, HAS_BIAS=bias is not None, PDL=use_pdl,
        num_warps=cfg.num_warps, num_stages=1, **({"launch_pdl": True} if use_pdl else {}))
    return out.reshape(*x.shape[:-1], n)
