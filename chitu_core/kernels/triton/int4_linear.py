"""int4_linear of the op contract (``chitu_core.ops.spec``): x [..., K] times 4-bit weights in groups along K.

Weights stay packed in memory (int32 [K/8, N], nibble j of word [i, n] = q[8i + j, n]) and are
dequantized in registers. A program owns BLOCK_N output columns, BLOCK_M rows of x and one slice of K
(split-K); it walks its slice BLOCK_K features at a time, reading a [BLOCK_K/8, BLOCK_N] tile of
words coalesced along N, so every weight byte is read once. Nibble j of the tile is features
8i + j, so the tile is consumed as eight [BLOCK_K/8, BLOCK_N] slices against the matching strided
columns of x: no reshape, no repeated loads.

Two ways to multiply, chosen by ``Int4Config.use_dot``:

* FMA (decode, a few rows): q is made a float without an int-to-float conversion by putting its bits
  under a float's exponent (1 + q/16), products accumulate in a [BLOCK_M, BLOCK_K/8, BLOCK_N] float32
  tile, and the zero and scale are applied once per tile and row: sum x (q - z) s =
  (16 sum x (1 + q/16) - (16 + z) sum x) s. Reduced over K once, at the end.
* tl.dot (more rows): (q - z), a small integer and so exact in x.dtype, meets x in tl.dot with
  float32 accumulation; the scale multiplies the tile's result.

Both apply the scale after the products where a K tile lies in one group (G % BLOCK_K == 0, the
exact way), else per packed row before them (on the tl.dot path the scaled weight is then rounded to
a 16-bit x's dtype: groups under 128 cost that rounding there). With split-K each slice writes float32 partial sums to a
workspace and a second kernel adds them in order (deterministic), adds the bias and rounds to
x.dtype; without it the main kernel does that itself. Tiles: ``int4_config``.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import as_rows, num_compute_units
from chitu_core.kernels.triton.split_k import sum_splits



@dataclass(frozen=True)
class Int4Config:
    """block_m rows of x (FMA: 1..8, dot: >= 16), block_n columns, block_k features a step (a power of
    two >= 8; >= 128 with dot), split_k slices of K, tl.dot or FMA."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 2


def int4_config(m: int, n: int, k: int, group_size: int, num_compute_units: int) -> Int4Config:
    """Tiles by shape, from the sweep on an H100 (plugins/nvidia/scripts/quant_sweep.py) at Llama-3.1-8B's
    shapes: decode (m <= 16) is fastest on the tl.dot path with 16-row tiles and K split 8 ways (batch 1:
    0.23-0.35 of the byte floor; the FMA path measured slower at every shape), and M = 64 on 64-row tl.dot
    tiles with K split 4 ways where N alone gives few programs. Both are far from the floor still."""
    del group_size, num_compute_units  # the measured tiles did not depend on them at these shapes
    if m <= 16:
        return Int4Config(16, 128 if n <= 8192 else 64, 128, 8 if k >= 1024 else 1, True)
    return Int4Config(64, 128, 128, 4 if n <= 8192 and k >= 512 else 1, True, num_warps=4, num_stages=3)


@triton.jit
def _nibble(w, J: tl.constexpr):
    """Nibble J of each word of w as an exact float32: the bits of 2^23 + q, less 2^23."""
    return (((w >> (4 * J)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _nibble_sixteenths(w, J: tl.constexpr):
    """1 + q/16 for nibble J of each word of w: q moved into the top four mantissa bits of 1.0."""
    if 4 * J <= 19:
        bits = w << (19 - 4 * J)
    else:
        bits = w >> (4 * J - 19)
    return ((bits & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_kernel(
    out, x, qweight, scales, zeros, bias, M, N, K, group_size, k_per_split,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_os, stride_om, stride_on, stride_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    GROUP_TILE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[pid_s, m, n] = sum over this program's slice of K of x[m, k] * W[n, k] (+ bias, when one slice)."""
    R: tl.constexpr = BLOCK_K // 8  # packed rows a step
    pid_s = tl.program_id(2)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, R)
    m_ok, n_ok = rm < M, rn < N
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x + rm.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, R, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rows = k0 // 8 + ri
        r_ok = rows * 8 < k_end
        w_mask = r_ok[:, None] & n_ok[None, :]
        w = tl.load(qweight + rows.to(tl.int64)[:, None] * stride_qk + rn[None, :] * stride_qn, mask=w_mask, other=0)
        if GROUP_TILE:  # the whole tile is one group: s, z [1, BLOCK_N]
            grp = k0 // group_size
            s = tl.load(scales + grp * stride_sg + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(zeros + grp * stride_zg + rn * stride_zn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        else:  # each packed row's group: s, z [R, BLOCK_N]
            grp = (rows * 8) // group_size
            s = tl.load(scales + grp[:, None] * stride_sg + rn[None, :] * stride_sn, mask=w_mask, other=0.0)
            z = tl.load(zeros + grp[:, None] * stride_zg + rn[None, :] * stride_zn, mask=w_mask, other=0.0)
            s, z = s.to(tl.float32), z.to(tl.float32)
        x_mask = m_ok[:, None] & r_ok[None, :]
        if USE_DOT:
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x_rows + (rows * 8 + j)[None, :] * stride_xk, mask=x_mask, other=0.0)  # [BLOCK_M, R]
                if GROUP_TILE:
                    wj = (_nibble(w, j) - z).to(xj.dtype)
                else:
                    wj = ((_nibble(w, j) - z) * s).to(xj.dtype)
                part = tl.dot(xj, wj, part, input_precision=PRECISION)
            if GROUP_TILE:
                acc += part * s
            else:
                acc += part
        else:
            sf = tl.zeros((BLOCK_M, R, BLOCK_N), dtype=tl.float32)
            sx = tl.zeros((BLOCK_M, R), dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x_rows + (rows * 8 + j)[None, :] * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
                sf += xj[:, :, None] * _nibble_sixteenths(w, j)[None, :, :]
                sx += xj
            acc += (16.0 * sf - (16.0 + z)[None, :, :] * sx[:, :, None]) * s[None, :, :]
    if USE_DOT:
        result = acc
    else:
        result = tl.sum(acc, axis=1)
    if HAS_BIAS:
        result += tl.load(bias + rn * stride_b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    ptrs = out + pid_s * stride_os + rm.to(tl.int64)[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(ptrs, result.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    k, n = x.shape[-1], qweight.shape[1]
    groups = k // group_size if group_size > 0 else 0
    packed = qweight.dtype == torch.int32 and qweight.shape[0] * 8 == k
    grouped = group_size > 0 and group_size % 8 == 0 and k % group_size == 0
    if not (packed and grouped and tuple(scales.shape) == tuple(zeros.shape) == (groups, n)):
        raise ValueError(f"int4_linear: x [..., {k}], qweight {qweight.dtype} {list(qweight.shape)}, scales "
                         f"{list(scales.shape)}, zeros {list(zeros.shape)}, group_size {group_size} do not fit "
                         "(qweight int32 [K/8, N], scales and zeros [K/G, N], G a multiple of 8 dividing K)")


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None, config: Int4Config | None = None) -> torch.Tensor:
    """x [..., K] (any strides) -> [..., N] in x.dtype; ``config`` overrides ``int4_config`` (tests, tuning)."""
    _check(x, qweight, scales, zeros, group_size)
    k, n = x.shape[-1], qweight.shape[1]
    rows = as_rows(x)
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    cfg = config or int4_config(m, n, k, group_size, num_compute_units(x.device))
    if cfg.use_dot and min(cfg.block_m, cfg.block_n, cfg.block_k // 8) < 16:
        raise ValueError(f"int4_linear: {cfg} uses tl.dot, which needs block_m, block_n >= 16 and block_k >= 128")
    steps = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(steps, max(1, min(cfg.split_k, steps))) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    stride_os = 0 if splits == 1 else m * n
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _int4_kernel[grid](
        target, rows, qweight, scales, zeros, bias if bias is not None else out, m, n, k, group_size, k_per_split,
        rows.stride(0), rows.stride(1), *qweight.stride(), *scales.stride(), *zeros.stride(),
        stride_os, target.stride(-2), target.stride(-1), bias.stride(0) if bias is not None else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
        GROUP_TILE=group_size % cfg.block_k == 0, HAS_BIAS=bias is not None and splits == 1,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # ignored for 16-bit operands
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        sum_splits(target, out, bias)
    return out.reshape(*x.shape[:-1], n)
