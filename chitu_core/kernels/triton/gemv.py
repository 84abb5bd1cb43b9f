"""int4_linear for one row of x (batch-1 decode): a matrix-vector product that streams the packed weight.

Weights as ``int4_linear`` reads them (int32 [K/8, N], nibble j of word [i, n] = q[8i + j, n]), scales
and zeros [K/G, N]. A program owns BLOCK_N output columns and one of ``split`` slices of K; each step
takes a [BLOCK_K/8, BLOCK_N] tile of words (coalesced along N), its group's scales and zeros and its x
(one [BLOCK_K/8, 8] load, ``x8``), all loaded a step ahead, and for each nibble j multiplies 1 + q/16
(the nibble moved under the exponent of 1.0: a shift, a mask, no conversion) by the x of features
8i + j. A tile lies in one group (BLOCK_K divides G), so per packed row
sum x (q - z) s = (16 sum x (1 + q/16) - (16 + z) sum x) s; the rows are added once, after the loop.

Split-K without a second launch (``split_k.finish_split``): the last slice of a column block to finish
adds every slice's float32 partial sums in a fixed order (deterministic), with the bias. Tiles:
``gemv_config``. Dependent launch (``pdl``) with the first words, scales and zeros loaded before the
wait.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options
from chitu_core.kernels.triton.split_k import RowSplit, finish_split, row_slice, row_split


@dataclass(frozen=True)
class GemvConfig:
    """block_n output columns a program, block_k features a step (a multiple of 8 dividing the group
    size), split_k slices of K (each its own program), num_warps."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 1


def gemv_config(n: int, k: int, group_size: int, compute_units: int) -> GemvConfig:
    """Tiles from the sweep on an H100 at Llama-3.1-8B's shapes (plugins/nvidia/scripts/gemv_sweep.py):
    64 columns, 128 features a step, 4 warps; K split until there are about four programs per compute
    unit. (There: 0.31-0.50 of the byte floor, 1.6-1.9x the tl.dot tiles it replaced at batch 1.)"""
    block_n, block_k = 64, min(128, group_size)
    programs = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    split = max(1, min(steps, triton.cdiv(4 * compute_units, programs)))
    return GemvConfig(block_n, block_k, split)


@triton.jit
def _nibble_sixteenths(w, J: tl.constexpr):
    """1 + q/16 for nibble J of each word of w, exactly: q moved into the top four mantissa bits of 1.0."""
    if 4 * J <= 19:
        bits = w << (19 - 4 * J)
    else:
        bits = w >> (4 * J - 19)
    return ((bits & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def x8(xs, stride_xk, R: tl.constexpr):
    """x at features 8i + j for j = 0..7 (a tuple of [R]; xs: the packed rows' first features), as stored:
    one [R, 8] load (a row's eight in one request), split into its columns."""
    return split8(tl.load(xs[:, None] + tl.arange(0, 8)[None, :] * stride_xk), R)


@triton.jit
def split8(t, R: tl.constexpr):
    """The eight columns of t [R, 8], as a tuple of [R]."""
    even, odd = tl.split(tl.reshape(t, (R, 4, 2)))  # columns 0 2 4 6, 1 3 5 7
    e04, e26 = tl.split(tl.reshape(even, (R, 2, 2)))
    o15, o37 = tl.split(tl.reshape(odd, (R, 2, 2)))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit(do_not_specialize=["k_per_split", "split"])
def _int4_gemv_kernel(
    out, partials, counters, x, qweight, scales, zeros, bias, N, K, k_per_split, split,
    stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_b,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    R: tl.constexpr = BLOCK_K // 8
    rn, n_ok, k_lo, k_hi = row_slice(N, K, k_per_split, BLOCK_N)
    ri = tl.arange(0, R)
    w_cols = qweight + rn[None, :] * stride_qn
    # every operand of a step is loaded a step ahead: the words, the group's scales and zeros, and x
    acc2 = tl.zeros((R, BLOCK_N), dtype=tl.float32)
    nxt = tl.load(w_cols + (k_lo // 8 + ri).to(tl.int64)[:, None] * stride_qk, mask=n_ok[None, :], other=0)
    ns = tl.load(scales + (k_lo // GROUP) * stride_sg + rn * stride_sn, mask=n_ok, other=0.0)
    nz = tl.load(zeros + (k_lo // GROUP) * stride_zg + rn * stride_zn, mask=n_ok, other=0.0)
    gdc_enter(PDL)  # the loads before it are weights, which no earlier kernel writes
    nx = x8(x + (k_lo // 8 + ri) * 8 * stride_xk, stride_xk, R)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w, s, z, xs = nxt, ns.to(tl.float32), nz.to(tl.float32), nx
        rows = k0 // 8 + ri
        nxt = tl.load(w_cols + (rows + R).to(tl.int64)[:, None] * stride_qk,
                      mask=((rows + R) * 8 < k_hi)[:, None] & n_ok[None, :], other=0)
        k1 = tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K)  # past the slice: this step's again
        ns = tl.load(scales + (k1 // GROUP) * stride_sg + rn * stride_sn, mask=n_ok, other=0.0)
        nz = tl.load(zeros + (k1 // GROUP) * stride_zg + rn * stride_zn, mask=n_ok, other=0.0)
        nx = x8(x + (k1 // 8 + ri) * 8 * stride_xk, stride_xk, R)
        t = tl.zeros((R, BLOCK_N), dtype=tl.float32)
        sxr = tl.zeros((R,), dtype=tl.float32)
        for j in tl.static_range(8):
            xj = xs[j].to(tl.float32)
            t += _nibble_sixteenths(w, j) * xj[:, None]  # x (1 + q/16): one shift, one mask, one FMA
            sxr += xj
        # sum x (q - z) s with q = 16 (1 + q/16) - 16, per packed row; rows are added after the loop
        acc2 += (16.0 * t - (16.0 + z)[None, :] * sxr[:, None]) * s[None, :]
    acc = tl.sum(acc2, axis=0)
    finish_split(acc[None, :], out, partials, counters, bias, tl.arange(0, 1), rn, n_ok[None, :], 1, N, N, stride_b,
                 tl.program_id(0), tl.program_id(1), split, SPLIT_K, HAS_BIAS)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None, config: GemvConfig | None = None) -> torch.Tensor:
    """x [K] or [1, K] -> [N] or [1, N] in x.dtype; operands checked by the caller (``int4_linear``)."""
    cfg = config or gemv_config(qweight.shape[1], x.shape[-1], group_size, num_compute_units(x.device))
    return launch_int4_gemv(_int4_gemv_kernel, x, qweight, scales, zeros, group_size, bias, cfg, "int4_gemv")


def launch_int4_gemv(kernel, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None, cfg: GemvConfig, what: str,
                     scratch: Callable[[RowSplit], dict] | None = None, **extra) -> torch.Tensor:
    """Launch a one-row int4 kernel that takes ``_int4_gemv_kernel``'s arguments (and ``extra`` ones, by
    name, beside them, with those ``scratch`` makes for the split, such as buffers sized by it) over
    ``cfg``'s column blocks and slices of K; the result as ``int4_gemv`` returns it."""
    k, n = x.shape[-1], qweight.shape[1]
    if group_size % cfg.block_k or cfg.block_k % 8:
        raise ValueError(f"{what}: block_k {cfg.block_k} must be a multiple of 8 dividing group size {group_size}")
    row = x.reshape(k)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    plan = row_split(k, n, cfg.block_k, cfg.block_n, cfg.split_k, out, what)
    if scratch is not None:
        extra.update(scratch(plan))
    b = bias if bias is not None else out
    kernel[(plan.blocks, plan.split)](
        out, plan.partials, plan.counters, row, qweight, scales, zeros, b, n, k, plan.k_per_split, plan.split,
        row.stride(0), *qweight.stride(), *scales.stride(), *zeros.stride(), b.stride(0),
        GROUP=group_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=plan.split > 1, HAS_BIAS=bias is not None,
        **extra, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(x.device))
    return out.reshape(*x.shape[:-1], n)
