"""gguf_linear of the op contract (``chitu_core.ops.spec``) as a Triton kernel: y = x @ W.T (+ bias), W
the rows of GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) read as the file stores them.

The weight is never written dequantized anywhere: each program loads whole blocks of its BLOCK_N
rows and decodes them in registers with integer ops, as ``gguf_blocks`` does. Every field of every
type starts at an even byte, so a row is read as 16-bit words: a half-float field is one word, and
a word of quants holds 2 bytes, i.e. 4 nibbles (or 2 int8). A row's blocks are taken as "groups" (a
whole block of the small types, a quarter block of the K-quants); a "plane" of a group is the S
elements found at the same bit offset of S consecutive words (Q4_0: the low nibble of each word's
low byte is elements 0, 2, .., 14). A plane is a [BLOCK_N, G, S] tile multiplied with the
activations at its own input features, so no element is ever moved into the row's order (a sum
over K takes its terms in any order). A b-bit quant q is shifted to the top of a float's mantissa
and ORed with the bits of 1.0, which reads it as f = 1 + q / 2^b exactly: one shift and one
LOP3 a quant, no integer-to-float conversion. Each type's w = A q + B, with A, B per "unit" (a
block, or a K-quant sub-block: the planes sharing a scale and an offset over L consecutive
features).

Two paths; ``tiles`` picks one and its sizes by shape, the one place to tune them:

* decode (M <= DECODE_MAX_M): a program holds all M rows of x. For each unit it sums t = x * f
  element by element over the unit's planes (one multiply-add a quant), then adds A 2^b t to
  float32 [BLOCK_N, G, S] partial sums and (B - A 2^b) * (x summed over the unit's features) to
  [BLOCK_N, G] ones, so the scales cost per unit, not per quant; both are summed once at the end.
  Each weight byte is read once. Where the row tiles are too few to fill the device, K is split over
  ``split`` programs whose float32 partials ``_sum_splits_kernel`` adds in a fixed order
  (deterministic, no atomics). The result is x @ W.T for the exact W with float32 roundings in
  another order (a few times float32's epsilon relative to the output).
* matmul (larger M): W is dequantized exactly (A q is exact, one rounding for + B, as ggml) and fed
  to ``tl.dot`` on [BLOCK_M, G * S] x [G * S, BLOCK_N] tiles, rounded to x.dtype for 16-bit x (as a
  16-bit GEMM rounds its weight), IEEE float32 products for float32 x.

No host synchronisation: sizes and grids come from shapes only, so a device graph can capture it.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import as_rows, num_compute_units, pow2
from chitu_core.kernels.triton.split_k import sum_splits
from chitu_core.quantization.gguf_blocks import BLOCK, NAMES, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, check_qtype

LAYOUT = {Q4_0: (1, 8, 4), Q4_1: (1, 8, 4), Q8_0: (1, 16, 2), Q4_K: (4, 16, 4), Q5_K: (4, 16, 4), Q6_K: (4, 8, 8)}
"""qtype -> (groups per block, S words per plane, planes per group)."""
DECODE_MAX_M = 4
"""Largest M the decode path takes (it keeps one [BLOCK_N, G, S] accumulator per row of x)."""


@dataclass(frozen=True)
class Tiles:
    """BLOCK_M rows of x and BLOCK_N weight rows a program; ``groups`` of a row's groups a step
    (G * S elements a plane); ``split``: programs that share one row tile's K (decode only)."""

    block_m: int
    block_n: int
    groups: int
    split: int = 1
    num_warps: int = 4
    num_stages: int = 2
    dot: bool = False


def tiles(m: int, n: int, k: int, qtype: int, num_compute_units: int) -> Tiles:
    """The tile sizes for x [m, k] times a [n, k] ``qtype`` weight (see the module docstring).
    Decode: 16 rows a program, 128 elements a plane a step, K split until the programs reach twice
    the compute units. Matmul: 64 features a plane a step, BLOCK_M by M."""
    e, _ = BLOCK[qtype]
    per_block, s, _ = LAYOUT[qtype]
    if m <= DECODE_MAX_M:
        block_n, groups = 16, 128 // s
        chunks = triton.cdiv(k // e * per_block, groups)
        programs = triton.cdiv(n, block_n)
        split = max(1, min(16, chunks, triton.cdiv(2 * num_compute_units, programs)))
        return Tiles(pow2(m), block_n, groups, split, num_warps=4, num_stages=1)
    block_m = 16 if m <= 16 else 32 if m <= 64 else 64
    return Tiles(block_m, 64, 64 // s, num_warps=4, num_stages=2, dot=True)


# ----- decoding -----


@triton.jit
def _word(ptr, mask):
    """The 16-bit words at ``ptr`` (an int16 pointer tile), sign-extended to int32 (every field read
    from them lies in their low 16 bits)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(ptr, mask):
    """The half float at ``ptr`` (an int16 pointer tile), as float32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _one_plus(bits):
    """The float 1 + bits / 2^23 for int32 ``bits`` in [0, 2^23): a quant q placed at the top of the
    mantissa reads as 1 + q / 2^b, exactly, with one OR."""
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _scale_byte(base, idx, mask, AT: tl.constexpr):
    """Byte AT + idx of each block at ``base`` (int16 pointers, AT even), as an int32."""
    return (_word(base + AT // 2 + idx // 2, mask) >> (8 * (idx % 2))) & 0xFF


@triton.jit
def _scale_min_k4(base, idx, mask):
    """The 6-bit (scale, min) pair ``idx`` ([1, G, 1] in 0..7) of the Q4_K/Q5_K blocks at ``base``:
    low 6 bits of scales[idx] and scales[idx + 4] for idx < 4, else the nibbles of scales[idx + 4]
    topped by the top 2 bits of scales[idx - 4] and scales[idx]."""
    a = _scale_byte(base, idx, mask, 4)
    b = _scale_byte(base, idx + 4, mask, 4)
    c = _scale_byte(base, tl.maximum(idx - 4, 0), mask, 4)
    first = idx < 4
    sc = tl.where(first, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(first, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc, mn


@triton.jit
def _zeros4(BLOCK_N: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    z = tl.zeros((BLOCK_N, G, S), dtype=tl.float32)
    return z, z, z, z


@triton.jit
def _x_row(xk, r: tl.constexpr, k_ok, M, stride_xm):
    """Row r of x at the features ``xk`` ([G, S] pointers into row 0), as float32. Rows past M read
    row M - 1 again (their sums are never stored), so no mask mixes a scalar with a tile."""
    return tl.load(xk + tl.minimum(r, M - 1) * stride_xm, mask=k_ok, other=0.0).to(tl.float32)


@triton.jit
def _plane(acc, t0, t1, t2, t3, f, A, B, xk, k_ok, m, M, stride_xm,
           BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
           DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Multiply one plane of quants q = (f - 1) 2^BITS (f float32 [BLOCK_N, G, S]), worth w = A q + B
    (A, B [BLOCK_N, G, 1]); xk [G, S]: pointers to their input features in row 0 of x, whose rows m
    [BLOCK_M] (M of them valid) are this program's.
    DOT: acc [BLOCK_M, BLOCK_N] += x[m, k] @ w.T, w computed exactly (A q exact, one rounding for + B).
    Decode: t_r [BLOCK_N, G, S] += x[r, k] * f for each row r < BLOCK_M <= 4; ``_unit`` applies A and
    B once for all the planes that share them."""
    if DOT:
        w = A * ((f - 1.0) * (1 << BITS)) + B
        xs = tl.load(xk[None, :, :] + m.to(tl.int64)[:, None, None] * stride_xm,
                     mask=(m < M)[:, None, None] & k_ok[None, :, :], other=0.0)
        xs = tl.reshape(xs, (BLOCK_M, G * S))
        ws = tl.reshape(w, (BLOCK_N, G * S)).to(xs.dtype)
        acc = tl.dot(xs, tl.trans(ws), acc=acc, input_precision=PRECISION)
    else:
        t0 += f * _x_row(xk, 0, k_ok, M, stride_xm)[None, :, :]
        if BLOCK_M > 1:
            t1 += f * _x_row(xk, 1, k_ok, M, stride_xm)[None, :, :]
        if BLOCK_M > 2:
            t2 += f * _x_row(xk, 2, k_ok, M, stride_xm)[None, :, :]
            t3 += f * _x_row(xk, 3, k_ok, M, stride_xm)[None, :, :]
    return acc, t0, t1, t2, t3


@triton.jit
def _x_sum(xu, r: tl.constexpr, u_ok, M, stride_xm):
    """Row r of x summed over each group's unit: xu [G, L] pointers to its L features."""
    return tl.sum(tl.load(xu + tl.minimum(r, M - 1) * stride_xm, mask=u_ok, other=0.0).to(tl.float32), axis=1)


@triton.jit
def _unit(a0, a1, a2, a3, c0, c1, c2, c3, t0, t1, t2, t3, A, B, xu, u_ok, M, stride_xm,
          BITS: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """Decode, once the planes of a unit (those sharing A and B) are in t_r: the unit's sum of x * w is
    sum x (A 2^BITS (f - 1) + B) = A 2^BITS t_r + (B - A 2^BITS) sum x, so a_r [BLOCK_N, G, S] += A 2^BITS
    t_r and c_r [BLOCK_N, G] += (B - A 2^BITS) * (x summed over the unit's features, xu [G, L])."""
    if not DOT:
        scale = A * (1 << BITS)
        offset = tl.sum(B - scale, axis=2)  # [BLOCK_N, G]
        a0 += scale * t0
        c0 += offset * _x_sum(xu, 0, u_ok, M, stride_xm)[None, :]
        if BLOCK_M > 1:
            a1 += scale * t1
            c1 += offset * _x_sum(xu, 1, u_ok, M, stride_xm)[None, :]
        if BLOCK_M > 2:
            a2 += scale * t2
            c2 += offset * _x_sum(xu, 2, u_ok, M, stride_xm)[None, :]
            a3 += scale * t3
            c3 += offset * _x_sum(xu, 3, u_ok, M, stride_xm)[None, :]
    return a0, a1, a2, a3, c0, c1, c2, c3


@triton.jit
def _row_sum(acc, a, c, r: tl.constexpr, m):
    """acc [BLOCK_M, BLOCK_N] plus, in row r, a [BLOCK_N, G, S] and c [BLOCK_N, G] summed over G (and S)."""
    return acc + tl.where(m[:, None] == r, (tl.sum(tl.sum(a, axis=2), axis=1) + tl.sum(c, axis=1))[None, :], 0.0)


@triton.jit(do_not_specialize=["M"])
def _gguf_linear_kernel(
    out, x, qw, bias, M, N, n_groups, n_chunks, chunks_per_split,
    stride_xm, stride_xk, stride_qn, stride_om, stride_os,
    QTYPE: tl.constexpr, E: tl.constexpr, WORDS: tl.constexpr, PER_BLOCK: tl.constexpr, S: tl.constexpr,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y over the chunks (G groups each) of split program_id(1);
    qw: the weight as int16 words, WORDS a block; with SPLIT, float32 partials at out[split, m, n],
    else y (+ bias) in out's dtype. A "unit" is the planes that share a scale and an offset, and
    the L consecutive features they cover."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N
    rows = qw + n.to(tl.int64)[:, None, None] * stride_qn  # [BLOCK_N, 1, 1]
    x0 = x + (pid_m * BLOCK_M).to(tl.int64) * stride_xm
    M = M - pid_m * BLOCK_M  # rows of x from this program's first
    i = tl.arange(0, S)
    i3 = i[None, None, :]
    L: tl.constexpr = 16 if QTYPE == 14 else 32  # features a unit covers
    xi = 2 * i[None, :] * stride_xk  # [1, S]: features 2i of a plane
    xl = tl.arange(0, L)[None, :] * stride_xk  # [1, L]: a unit's features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # DOT: the tile; decode: filled at the end
    a0, a1, a2, a3 = _zeros4(BLOCK_N, G, S)  # decode: row r's sums by element (a_r) and by group (c_r)
    c = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    c0, c1, c2, c3 = c, c, c, c
    first = pid_s * chunks_per_split
    for chunk in range(first, tl.minimum(first + chunks_per_split, n_chunks)):
        g = chunk * G + tl.arange(0, G)
        g_ok = g < n_groups
        blk, j = g // PER_BLOCK, g % PER_BLOCK  # the group's block, and which group of it
        base = rows + (blk.to(tl.int64) * WORDS)[None, :, None]  # [BLOCK_N, G, 1]: each group's block
        ok = n_ok[:, None, None] & g_ok[None, :, None]
        k_ok = g_ok[:, None] & (i[None, :] < S)  # [G, S]
        u_ok = g_ok[:, None] & (tl.arange(0, L)[None, :] < L)  # [G, L]
        xb = x0 + (blk * E)[:, None] * stride_xk  # [G, 1]: each group's block of features
        sub = j[None, :, None]
        if QTYPE == 2 or QTYPE == 3:  # Q4_0, Q4_1: d (m), 8 words; nibble u of byte 2i + b is element 16u + 2i + b
            d = _half(base, ok)
            v = _word(base + (1 if QTYPE == 2 else 2) + i3, ok)
            B = -8.0 * d if QTYPE == 2 else _half(base + 1, ok)
            t0, t1, t2, t3 = _zeros4(BLOCK_N, G, S)
            for p in tl.static_range(4):
                b, u = p % 2, p // 2
                f = _one_plus((v << (19 - 8 * b - 4 * u)) & 0x780000)
                acc, t0, t1, t2, t3 = _plane(acc, t0, t1, t2, t3, f, d, B, xb + (16 * u + b) * stride_xk + xi,
                                             k_ok, m, M, stride_xm, 4, BLOCK_M, BLOCK_N, G, S, DOT, PRECISION)
            a0, a1, a2, a3, c0, c1, c2, c3 = _unit(a0, a1, a2, a3, c0, c1, c2, c3, t0, t1, t2, t3, d, B,
                                                   xb + xl, u_ok, M, stride_xm, 4, BLOCK_M, DOT)
        elif QTYPE == 8:  # Q8_0: d, 16 words; byte 2i + b is the int8 element 2i + b, read as u = q + 128
            d = _half(base, ok)
            v = _word(base + 1 + i3, ok)
            t0, t1, t2, t3 = _zeros4(BLOCK_N, G, S)
            for b in tl.static_range(2):
                f = (((v << (15 - 8 * b)) & 0x7F8000) ^ 0x3FC00000).to(tl.float32, bitcast=True)  # 1 + u / 256
                acc, t0, t1, t2, t3 = _plane(acc, t0, t1, t2, t3, f, d, -128.0 * d, xb + b * stride_xk + xi,
                                             k_ok, m, M, stride_xm, 8, BLOCK_M, BLOCK_N, G, S, DOT, PRECISION)
            a0, a1, a2, a3, c0, c1, c2, c3 = _unit(a0, a1, a2, a3, c0, c1, c2, c3, t0, t1, t2, t3, d, -128.0 * d,
                                                   xb + xl, u_ok, M, stride_xm, 8, BLOCK_M, DOT)
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: nibble u of qs byte 32j + 2i + b is element 64j + 32u + 2i + b
            BITS: tl.constexpr = 4 if QTYPE == 12 else 5
            d = _half(base, ok)
            dmin = _half(base + 1, ok)
            v = _word(base + (8 if QTYPE == 12 else 24) + 16 * sub + i3, ok)
            if QTYPE == 13:
                vh = _word(base + 8 + i3, ok)  # qh bytes 2i, 2i + 1: bit 2j + u is the fifth bit
            for u in tl.static_range(2):
                sc, mn = _scale_min_k4(base, 2 * sub + u, ok)
                A = d * sc.to(tl.float32)
                B = -(dmin * mn.to(tl.float32))
                xu = xb + (64 * j + 32 * u)[:, None] * stride_xk  # [G, 1]: the sub-block's first feature
                t0, t1, t2, t3 = _zeros4(BLOCK_N, G, S)
                for b in tl.static_range(2):
                    if QTYPE == 12:
                        f = _one_plus((v << (19 - 8 * b - 4 * u)) & 0x780000)
                    else:
                        high = (vh << (22 - 8 * b - u - 2 * sub)) & 0x400000
                        f = _one_plus(((v << (18 - 8 * b - 4 * u)) & 0x3C0000) | high)
                    acc, t0, t1, t2, t3 = _plane(acc, t0, t1, t2, t3, f, A, B, xu + b * stride_xk + xi, k_ok,
                                                 m, M, stride_xm, BITS, BLOCK_M, BLOCK_N, G, S, DOT, PRECISION)
                a0, a1, a2, a3, c0, c1, c2, c3 = _unit(a0, a1, a2, a3, c0, c1, c2, c3, t0, t1, t2, t3, A, B,
                                                       xu + xl, u_ok, M, stride_xm, BITS, BLOCK_M, DOT)
        else:  # Q6_K: group j = 2h + lh; element 128h + 32t + 16lh + 2i + b for t < 4, scale 8h + 2t + lh
            h, lh = sub // 2, sub % 2
            d = _half(base + 104, ok)
            ql0 = _word(base + 32 * h + 8 * lh + i3, ok)  # ql bytes 64h + 16lh + 2i + b: t = 0, 2
            ql1 = _word(base + 32 * h + 16 + 8 * lh + i3, ok)  # ql bytes 64h + 32 + 16lh + 2i + b: t = 1, 3
            vh = _word(base + 64 + 16 * h + 8 * lh + i3, ok)  # qh bytes 32h + 16lh + 2i + b
            for tt in tl.static_range(4):
                sc = _scale_byte(base, 8 * h + 2 * tt + lh, ok, 192)
                A = d * (sc - ((sc >> 7) << 8)).to(tl.float32)  # the int8 scale
                xu = xb + (j // 2 * 128 + j % 2 * 16 + 32 * tt)[:, None] * stride_xk
                ql = ql0 if tt % 2 == 0 else ql1
                t0, t1, t2, t3 = _zeros4(BLOCK_N, G, S)
                for b in tl.static_range(2):
                    high = (vh << (21 - 8 * b - 2 * tt)) & 0x600000
                    f = _one_plus(((ql << (17 - 8 * b - 4 * (tt // 2))) & 0x1E0000) | high)
                    acc, t0, t1, t2, t3 = _plane(acc, t0, t1, t2, t3, f, A, -32.0 * A, xu + b * stride_xk + xi,
                                                 k_ok, m, M, stride_xm, 6, BLOCK_M, BLOCK_N, G, S, DOT, PRECISION)
                a0, a1, a2, a3, c0, c1, c2, c3 = _unit(a0, a1, a2, a3, c0, c1, c2, c3, t0, t1, t2, t3, A, -32.0 * A,
                                                       xu + xl, u_ok, M, stride_xm, 6, BLOCK_M, DOT)
    if not DOT:
        acc = _row_sum(acc, a0, c0, 0, m)
        if BLOCK_M > 1:
            acc = _row_sum(acc, a1, c1, 1, m)
        if BLOCK_M > 2:
            acc = _row_sum(acc, a2, c2, 2, m)
            acc = _row_sum(acc, a3, c3, 3, m)
    mask = (m < M)[:, None] & n_ok[None, :]
    ptrs = out + (pid_m * BLOCK_M + m).to(tl.int64)[:, None] * stride_om + n[None, :]
    if SPLIT:
        tl.store(ptrs + pid_s.to(tl.int64) * stride_os, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(ptrs, acc.to(out.dtype.element_ty), mask=mask)


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None,
                config: Tiles | None = None) -> torch.Tensor:
    """x [..., K] (any strides) times the ``qtype`` weight qweight uint8 [N, K / E * B] (+ bias [N]) ->
    [..., N] in x.dtype. ``config`` overrides ``tiles`` (tests, tuning)."""
    e, b = check_qtype(qtype)
    n, row_bytes = qweight.shape
    k = x.shape[-1]
    if qweight.dtype != torch.uint8 or row_bytes * e != k * b:
        raise ValueError(f"gguf_linear: a {list(qweight.shape)} {qweight.dtype} weight is not rows of {k} values in "
                         f"{e}-element {b}-byte blocks (expected uint8 [N, {k // e * b}])")
    if qweight.stride(1) != 1 or qweight.stride(0) % 2 or qweight.data_ptr() % 2:
        qweight = qweight.contiguous()
    words = qweight.view(torch.int16)  # every block is a whole number of 16-bit words
    rows = as_rows(x)
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    per_block, s, _ = LAYOUT[qtype]
    cfg = config or tiles(m, n, k, qtype, num_compute_units(x.device))
    if cfg.dot and min(cfg.block_m, cfg.block_n, cfg.groups * s) < 16 or not cfg.dot and cfg.block_m > DECODE_MAX_M:
        raise ValueError(f"gguf_linear: {cfg} is not a valid tiling for {NAMES[qtype]} (tl.dot needs BLOCK_M, BLOCK_N "
                         f"and groups * {s} of at least 16; the decode path at most {DECODE_MAX_M} rows of x)")
    bias = bias.contiguous() if bias is not None else None
    n_groups = k // e * per_block
    n_chunks = triton.cdiv(n_groups, cfg.groups)
    per_split = triton.cdiv(n_chunks, cfg.split)
    split = triton.cdiv(n_chunks, per_split)
    target = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    _gguf_linear_kernel[grid](
        target, rows, words, bias if bias is not None else out, m, n, n_groups, n_chunks, per_split,
        rows.stride(0), rows.stride(1), words.stride(0), target.stride(-2), target.stride(0) if split > 1 else 0,
        QTYPE=qtype, E=e, WORDS=b // 2, PER_BLOCK=per_block, S=s, G=cfg.groups, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, DOT=cfg.dot, SPLIT=split > 1, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # ignored for 16-bit operands
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        sum_splits(target, out, bias)
    return out.reshape(*x.shape[:-1], n)
