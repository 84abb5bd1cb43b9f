"""int4_linear of the op contract (``chitu_core.ops.spec``): x [..., K] times 4-bit weights in groups along K.

Weights stay packed in memory (int32 [K/8, N], nibble j of word [i, n] = q[8i + j, n]) and are
dequantized in registers. One row of x (batch-1 decode) goes to the matrix-vector kernel
(``gemv.int4_gemv``). More rows: a program owns a [BLOCK_M, BLOCK_N] tile of the output and one slice
of K (split-K); each step it loads the [BLOCK_K, BLOCK_N] weight tile through word pointers (row k
reads word k // 8, which the eight rows sharing it find in the L1 cache) and shifts nibble k % 8
down, makes (q - z) a float exactly (the bits of 2^23 + q, less 2^23; a small integer, so exact in
x's dtype too), and meets the contiguous [BLOCK_M, BLOCK_K] tile of x in one tl.dot with float32
accumulation. Where a K tile lies in one group (G % BLOCK_K == 0) the scale multiplies the tile's
product; otherwise each weight row is scaled before the product (then rounded to a 16-bit x's dtype:
groups under BLOCK_K cost that rounding). Split-K partial sums are added in order by the last slice of
each tile (``split_k.finish_split``: deterministic, no second launch). Tiles: ``int4_config``. Both
kernels launch dependent (``pdl``).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import as_rows, num_compute_units
from chitu_core.kernels.triton.gemv import GemvConfig, int4_gemv
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options
from chitu_core.kernels.triton.split_k import check_split_tiles, finish_split, k_mask, split_counters


@dataclass(frozen=True)
class Int4Config:
    """block_m rows of x, block_n columns, block_k features a step (powers of two, each >= 16), split_k
    slices of K."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def int4_config(m: int, n: int, k: int, group_size: int, num_compute_units: int) -> Int4Config:
    """Tiles by shape: 16 or 64 rows by 64 columns (128 for wide weights, n >= 16384: a gated pair's),
    128 features a step, K split (up to 4 ways) until there are about four programs per compute unit.
    From the sweeps at Llama-3.1-8B's shapes (plugins/nvidia/scripts/quant_sweep.py, SWEEP_M="16 64"): on
    an H100 these tiles with two programs a unit; on an H200 (page docs/benchmarks/nvidia-h200-int4-gemv.md,
    quant_sweep-int4.txt) this rule's tiles were the fastest of 48 at qkv, o and down, and gate/up's within
    11% of the fastest, which takes 128 columns too (64 had been 15-23% slower in a scratch sweep)."""
    del group_size
    block_m = 16 if m <= 16 else 64
    block_n = 128 if n >= 16384 else 64
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = max(1, min(4, triton.cdiv(k, 128), triton.cdiv(4 * num_compute_units, programs)))
    return Int4Config(block_m, block_n, 128, split)


@triton.jit(do_not_specialize=["M", "split"])
def _int4_kernel(
    out, partials, counters, x, qweight, scales, zeros, bias, M, N, K, group_size, k_per_split, split,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_TILE: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, n] = sum over K of x[m, k] * W[n, k] (+ bias), this program's slice of K. EVEN_K: every tile
    lies inside K (slices are whole tiles), so loads are masked by rows and columns only and x's tile can
    load in wide vectors. On an H200 at Llama-3.1-8B's shapes that took 16-34% off its time at 16 and 64 rows
    (64 rows: gate_up 139.2 -> 103.6 us), and batch 64 decode 6,236 -> 8,065 tok/s
    (docs/benchmarks/nvidia-h200-even-k.md)."""
    gdc_enter(PDL)
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_rows = x + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = qweight + rn[None, :] * stride_qn
    ri = tl.arange(0, BLOCK_K // 8)
    jj = tl.arange(0, 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + rk
        packed = k0 // 8 + ri
        k_ok = k_mask(k, k_hi, EVEN_K)
        words = tl.load(w_cols + packed.to(tl.int64)[:, None] * stride_qk,  # [BLOCK_K / 8, BLOCK_N]
                        mask=k_mask(packed * 8, k_hi, EVEN_K)[:, None] & n_ok[None, :], other=0)
        nibbles = (words[:, None, :] >> (jj * 4)[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: feature 8i + j
        q = (tl.reshape(nibbles, (BLOCK_K, BLOCK_N)) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if GROUP_TILE:  # the whole tile is one group: s, z [BLOCK_N]
            grp = k0 // group_size
            s = tl.load(scales + grp * stride_sg + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(zeros + grp * stride_zg + rn * stride_zn, mask=n_ok, other=0.0).to(tl.float32)
            wq = (q - z[None, :]).to(a.dtype)
            acc += tl.dot(a, wq, input_precision=PRECISION) * s[None, :]
        else:  # each row's group: s, z [BLOCK_K, BLOCK_N]
            grp = (k // group_size)[:, None]
            g_mask = k_ok[:, None] & n_ok[None, :]
            s = tl.load(scales + grp * stride_sg + rn[None, :] * stride_sn, mask=g_mask, other=0.0).to(tl.float32)
            z = tl.load(zeros + grp * stride_zg + rn[None, :] * stride_zn, mask=g_mask, other=0.0).to(tl.float32)
            acc = tl.dot(a, ((q - z) * s).to(a.dtype), acc, input_precision=PRECISION)
    tile = pid_m * tl.num_programs(1) + pid_n
    finish_split(acc, out, partials, counters, bias, rm, rn, m_ok[:, None] & n_ok[None, :], M, N, N, stride_b,
                 tile, pid_s, split, SPLIT_K, HAS_BIAS)


def check_operands(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    k, n = x.shape[-1], qweight.shape[1]
    groups = k // group_size if group_size > 0 else 0
    packed = qweight.dtype == torch.int32 and qweight.shape[0] * 8 == k
    grouped = group_size > 0 and group_size % 8 == 0 and k % group_size == 0
    if not (packed and grouped and tuple(scales.shape) == tuple(zeros.shape) == (groups, n)):
        raise ValueError(f"int4_linear: x [..., {k}], qweight {qweight.dtype} {list(qweight.shape)}, scales "
                         f"{list(scales.shape)}, zeros {list(zeros.shape)}, group_size {group_size} do not fit "
                         "(qweight int32 [K/8, N], scales and zeros [K/G, N], G a multiple of 8 dividing K)")


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None, config: Int4Config | GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] (any strides) -> [..., N] in x.dtype. ``config`` overrides the choice (tests, tuning): a
    GemvConfig takes the matrix-vector kernel (one row), an Int4Config the tiled one."""
    check_operands(x, qweight, scales, zeros, group_size)
    k, n = x.shape[-1], qweight.shape[1]
    rows = as_rows(x)
    m = rows.shape[0]
    if m == 1 and n > 0 and not isinstance(config, Int4Config):
        return int4_gemv(rows, qweight, scales, zeros, group_size, bias, config).reshape(*x.shape[:-1], n)
    if isinstance(config, GemvConfig):
        raise ValueError(f"int4_linear: {config} is the matrix-vector kernel's, for one row of x, not {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    cfg = config or int4_config(m, n, k, group_size, num_compute_units(x.device))
    if min(cfg.block_m, cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"int4_linear: {cfg} needs block_m, block_n and block_k >= 16 (tl.dot)")
    steps = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(steps, max(1, min(cfg.split_k, steps))) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    if split > 1:
        check_split_tiles(grid[0] * grid[1], "int4_linear")
    partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else out
    _int4_kernel[grid](
        out, partials, split_counters(x.device), rows, qweight, scales, zeros, b, m, n, k, group_size, k_per_split,
        split, rows.stride(0), rows.stride(1), *qweight.stride(), *scales.stride(), *zeros.stride(), b.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_TILE=group_size % cfg.block_k == 0,
        EVEN_K=k % cfg.block_k == 0,
        SPLIT_K=split > 1, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # ignored for 16-bit operands
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(x.device))
    return out.reshape(*x.shape[:-1], n)
