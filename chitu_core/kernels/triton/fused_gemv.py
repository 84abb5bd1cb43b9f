"""The decode-step fusions of contract 1.9 for a few rows of x (decode at batch 1 to ``MAX_ROWS``): a
matrix-vector product with the RMSNorm of its input folded into its prologue (``rms_norm_linear``,
optionally with the gated activation of a merged gate/up projection in its epilogue) or the residual
add folded into its epilogue (``linear_add``). Each saves a launch and a round trip of the activations
through memory; the weight streams as in ``dense_gemv`` (same tiles, no split of K).

A program owns BLOCK_N output columns (of both halves where gated) for all rows. Each step loads a
weight tile and a slice of x (the next ones issued before these are used), multiplies x by the norm's
weight and adds its squares to the row's sum: a row's 1 / rms is a factor of all its sums, applied in
the epilogue, so the norm costs no pass of its own. One row: the tile is multiplied elementwise into a
float32 tile of partial sums, reduced once after the loop. More rows (``_fused_rows_kernel``): the loop's
loads are left to Triton's pipeliner, and each step is a tensor-core product of the rows (padded to 16)
with the tile, float32 accumulation (IEEE float32 products for float32 weights). On an H100 that is no
faster than cuBLAS beyond SmolLM2-sized weights (plugins/nvidia/scripts/fused_gemv_sweep.py), so the
NVIDIA backend's layers take the fusions at batch 1 only (``fusion_max_tokens``). The epilogue applies
the norm's factor, adds the bias, applies the gated activation or adds the residual, all in float32,
and rounds once.

Programmatic dependent launch (``pdl``): the first weight tile is loaded before ``gdc_enter`` waits; x
and the residual, which the previous kernel wrote, only after.

``finish_fused_row`` is the same epilogue for one-row kernels split along K (the NVIDIA plugin's int4
kernel with contract 1.18's fusions): the slices' sums and squares meet in the slice that arrives last.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.activation import act_and_mul
from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.dense_gemv import _tile, dense_gemv_config
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_launch

MAX_ROWS = 8
"""Most rows the kernel takes; more go to the backend's GEMM (rows pad to 16 in the tensor-core product,
so the weight is read once for up to 16; past 8 a BLAS tile is as good)."""
ACTIVATIONS = {None: "none", "silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}
"""``activation`` -> the kernel's ACT ("none": none; else ``activation.act_and_mul``'s name)."""


@dataclass(frozen=True)
class FusedGemvConfig:
    """block_n output columns a program (of each half where gated), block_k features a step, num_warps;
    num_stages: the steps Triton's pipeliner keeps in flight for several rows (one row: 1, the kernel
    issues its next tile itself)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1


def fused_gemv_config(n: int, k: int, k_major: bool, rows: int, gated: bool, units: int) -> FusedGemvConfig:
    """One row: ``dense_gemv_config``'s tiles for the whole output (both halves where gated: each program
    then holds two tiles of half the width, so there are as many programs, with as much in flight each).
    Several rows: at least 16 columns, 128 features a step, 3 steps in flight."""
    cfg = dense_gemv_config(n, k, k_major, units)
    block_n = max(8, cfg.block_n // 2 if gated else cfg.block_n)
    if rows == 1:
        return FusedGemvConfig(block_n, cfg.block_k, cfg.num_warps)
    return FusedGemvConfig(max(16, block_n), 128, 4, 3)


@triton.jit
def _x_tile(x, nw, rm, m_ok, ks, K, stride_xm, stride_xk, stride_nw, NORM: tl.constexpr):
    """x[rm, ks] in float32 ([BLOCK_M, BLOCK_K]; zero past M and K), and times the norm's weight."""
    k_ok = ks < K
    xk = tl.load(x + rm[:, None] * stride_xm + ks[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                 other=0.0).to(tl.float32)
    xw = xk
    if NORM:
        xw = xk * tl.load(nw + ks * stride_nw, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    return xk, xw


@triton.jit
def _step(acc, tile, xk, BLOCK_M: tl.constexpr, K_MAJOR: tl.constexpr, IEEE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (one row: acc [BLOCK_K, BLOCK_N] or [BLOCK_N, BLOCK_K] of partial sums)."""
    if BLOCK_M == 1:
        if K_MAJOR:
            acc += tile.to(tl.float32) * tl.sum(xk, axis=0)[None, :]
        else:
            acc += tile.to(tl.float32) * tl.sum(xk, axis=0)[:, None]
    else:
        b = tl.trans(tile) if K_MAJOR else tile
        if IEEE:
            acc = tl.dot(xk, b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xk.to(tile.dtype), b, acc)
    return acc


@triton.jit
def _finish(acc, K_MAJOR: tl.constexpr):
    """One row's [1, BLOCK_N] sums from its tile of partial sums."""
    return tl.sum(acc, axis=1 if K_MAJOR else 0)[None, :]


@triton.jit
def _fused_gemv_kernel(out, x, w, bias, nw, res, M, N, K, eps, stride_xm, stride_xk, stride_wn, stride_wk,
                       stride_b, stride_nw, stride_rm, stride_rn, stride_om, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_MAJOR: tl.constexpr, NORM: tl.constexpr,
                       ACT: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N  # N: output columns (of each half where gated)
    ru = rn + N  # the up half's columns where gated
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    kk = tl.arange(0, BLOCK_K)
    nxt = _tile(w, kk, rn, K, n_ok, stride_wn, stride_wk, K_MAJOR)  # weights: no wait
    if ACT != "none":
        nxt_u = _tile(w, kk, ru, K, n_ok, stride_wn, stride_wk, K_MAJOR)
    gdc_enter(PDL)
    nxt_x, nxt_xw = _x_tile(x, nw, rm, m_ok, kk, K, stride_xm, stride_xk, stride_nw, NORM)
    if K_MAJOR:  # one row: a tile of partial sums, reduced after the loop
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    acc_u = acc
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)  # the rows' sums of squares, for the norm
    for k0 in range(0, K, BLOCK_K):
        tile, xk, xw = nxt, nxt_x, nxt_xw
        nxt = _tile(w, k0 + BLOCK_K + kk, rn, K, n_ok, stride_wn, stride_wk, K_MAJOR)
        if ACT != "none":
            tile_u = nxt_u
            nxt_u = _tile(w, k0 + BLOCK_K + kk, ru, K, n_ok, stride_wn, stride_wk, K_MAJOR)
        nxt_x, nxt_xw = _x_tile(x, nw, rm, m_ok, k0 + BLOCK_K + kk, K, stride_xm, stride_xk, stride_nw, NORM)
        if NORM:
            ss += tl.sum(xk * xk, axis=1)
        acc = _step(acc, tile, xw, BLOCK_M, K_MAJOR, IEEE)
        if ACT != "none":
            acc_u = _step(acc_u, tile_u, xw, BLOCK_M, K_MAJOR, IEEE)
    y = _finish(acc, K_MAJOR)
    up = _finish(acc_u, K_MAJOR)
    _epilogue(y, up, ss, out, bias, res, rm, m_ok, rn, ru, n_ok, K, eps, stride_b, stride_rm, stride_rn, stride_om,
              NORM, ACT, RESIDUAL, HAS_BIAS)

@triton.jit
def _epilogue(y, up, ss, out, bias, res, rm, m_ok, rn, ru, n_ok, K, eps, stride_b, stride_rm, stride_rn, stride_om,
              NORM: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y (and up where gated) [BLOCK_M, BLOCK_N] float32 sums -> the norm's factor, bias, activation or
    residual, all in float32; stored rounded once."""
    if NORM:  # a row's factor: the norm's 1 / rms, applied to its sums
        y = y * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    if HAS_BIAS:
        y += tl.load(bias + rn * stride_b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT != "none":
        if NORM:
            up = up * (1.0 / tl.sqrt(ss / K + eps))[:, None]
        if HAS_BIAS:
            up += tl.load(bias + ru * stride_b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = act_and_mul(y, up, ACT)
    ok = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        y += tl.load(res + rm[:, None] * stride_rm + rn[None, :] * stride_rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + rm[:, None] * stride_om + rn[None, :], y.to(out.dtype.element_ty), mask=ok)


@triton.jit
def finish_fused_row(acc, acc_u, ss, out, partials, squares, counters, bias, res, rn, ru, n_ok, N, K, eps, stride_b,
                     stride_rn, tile, pid_s, split, SPLIT_K: tl.constexpr, THREADS: tl.constexpr, NORM: tl.constexpr,
                     ACT: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The fused epilogue (``_epilogue``) of a one-row kernel split along K. acc (and acc_u, the up half's,
    where gated): [BLOCK_N] float32 sums over this program's slice of K; ss: [1], its slice of x's sum of
    squares. Without SPLIT_K, finished at once; else stored in partials [split, N] ([split, 2N] gated,
    the up half after the gate's) and squares [tiles, split], then ``tile``'s counter bumped: the slice
    arriving last adds every slice in a fixed order (as many slices a load as ``split_k.finish_split`` reads
    for the program's THREADS, both halves counted; each chunk as a tree), applies the epilogue and zeroes the
    counter (``split_k.finish_split``'s protocol). out, res: rows of N."""
    rm = tl.arange(0, 1)
    if not SPLIT_K:
        _epilogue(acc[None, :], acc_u[None, :], ss, out, bias, res, rm, rm < 1, rn, ru, n_ok, K, eps, stride_b, 0,
                  stride_rn, 0, NORM, ACT, RESIDUAL, HAS_BIAS)
    else:
        width = 2 * N if ACT != "none" else N
        tl.store(partials + pid_s * width + rn, acc, mask=n_ok)
        if ACT != "none":
            tl.store(partials + pid_s * width + N + rn, acc_u, mask=n_ok)
        if NORM:
            tl.store(squares + tile * split + pid_s + rm, ss)
        tl.debug_barrier()  # every thread's stores made before the counter moves
        done = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
        if done == split - 1:
            CHUNK: tl.constexpr = min(16, max(2, 64 * THREADS // (acc.shape[0] * (2 if ACT != "none" else 1))))
            rs = tl.arange(0, CHUNK)
            y = tl.zeros(acc.shape, dtype=tl.float32)
            up = y
            total_ss = tl.zeros((1,), dtype=tl.float32)
            for s0 in range(0, split, CHUNK):
                s_ok = s0 + rs < split
                offs = (s0 + rs).to(tl.int64)[:, None] * width + rn[None, :]
                ok = s_ok[:, None] & n_ok[None, :]
                y += tl.sum(tl.load(partials + offs, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
                if ACT != "none":
                    up += tl.sum(tl.load(partials + offs + N, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
                if NORM:
                    total_ss += tl.sum(tl.load(squares + tile * split + s0 + rs, mask=s_ok, other=0.0,
                                               cache_modifier=".cg"), axis=0)
            _epilogue(y[None, :], up[None, :], total_ss, out, bias, res, rm, rm < 1, rn, ru, n_ok, K, eps, stride_b, 0,
                      stride_rn, 0, NORM, ACT, RESIDUAL, HAS_BIAS)
            tl.atomic_xchg(counters + tile, 0)


@triton.jit
def _fused_rows_kernel(out, x, w, bias, nw, res, M, N, K, eps, stride_xm, stride_xk, stride_wn, stride_wk,
                       stride_b, stride_nw, stride_rm, stride_rn, stride_om, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_MAJOR: tl.constexpr, NORM: tl.constexpr,
                       ACT: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       STAGES: tl.constexpr, PDL: tl.constexpr):
    """Several rows: the loads in a loop Triton pipelines (STAGES steps in flight), tensor-core products."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    ru = rn + N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    kk = tl.arange(0, BLOCK_K)
    gdc_enter(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = acc
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        tile = _tile(w, k0 + kk, rn, K, n_ok, stride_wn, stride_wk, K_MAJOR)
        xk, xw = _x_tile(x, nw, rm, m_ok, k0 + kk, K, stride_xm, stride_xk, stride_nw, NORM)
        if NORM:
            ss += tl.sum(xk * xk, axis=1)
        acc = _step(acc, tile, xw, BLOCK_M, K_MAJOR, IEEE)
        if ACT != "none":
            acc_u = _step(acc_u, _tile(w, k0 + kk, ru, K, n_ok, stride_wn, stride_wk, K_MAJOR), xw, BLOCK_M,
                          K_MAJOR, IEEE)
    _epilogue(acc, acc_u, ss, out, bias, res, rm, m_ok, rn, ru, n_ok, K, eps, stride_b, stride_rm, stride_rn,
              stride_om, NORM, ACT, RESIDUAL, HAS_BIAS)


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0, activation: str | None = None,
               residual: torch.Tensor | None = None, config: FusedGemvConfig | None = None,
               pdl: bool | None = None) -> torch.Tensor:
    """x [..., K] of at most ``MAX_ROWS`` rows; weight [N, K] with either dimension contiguous; bias [N]
    or None. With ``norm_weight`` [K]: rms_norm(x) @ weight.T (+ bias); with ``activation`` too, its gated
    activation ([..., N/2]); with ``residual`` [..., N] (and no norm): residual + x @ weight.T (+ bias).
    Output in x.dtype, float32 accumulation, rounded once. ``pdl``: as ``dense_gemv``'s."""
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // max(1, k)
    if rows > MAX_ROWS:
        raise ValueError(f"fused_gemv takes at most {MAX_ROWS} rows, got {rows}")
    if activation not in ACTIVATIONS or (activation is not None and n % 2):
        raise ValueError(f"fused_gemv: activation {activation!r} with {n} outputs (one of {list(ACTIVATIONS)}, "
                         "an even width where gated)")
    n_out = n // 2 if activation is not None else n
    k_major = weight.stride(1) == 1
    x2 = x.reshape(rows, k)
    cfg = config or fused_gemv_config(n, k, k_major, rows, activation is not None, num_compute_units(x.device))
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    r2 = residual.reshape(rows, n) if residual is not None else out
    b = bias if bias is not None else out
    use_pdl = pdl_launch(x.device) if pdl is None else pdl
    kernel = _fused_gemv_kernel if rows == 1 else _fused_rows_kernel
    extra = {} if rows == 1 else {"STAGES": cfg.num_stages}
    kernel[(triton.cdiv(n_out, cfg.block_n),)](
        out, x2, weight, b, norm_weight if norm_weight is not None else x2, r2, rows, n_out, k, eps,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), b.stride(0) if bias is not None else 0,
        norm_weight.stride(0) if norm_weight is not None else 0, r2.stride(0), r2.stride(1), out.stride(0),
        BLOCK_M=1 if rows == 1 else 16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_MAJOR=k_major,
        NORM=norm_weight is not None, ACT=ACTIVATIONS[activation], RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, IEEE=weight.dtype == torch.float32, PDL=use_pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **extra, **({"launch_pdl": True} if use_pdl else {}))
    return out.reshape(*x.shape[:-1], n_out)
