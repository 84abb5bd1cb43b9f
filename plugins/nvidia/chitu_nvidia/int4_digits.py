"""int4_linear for one row of 16-bit x on NVIDIA GPUs, its products in 8-bit integer dot products (``dp4a``).

Each program first writes its slice of x, by steps of BLOCK_K features, as two signed 8-bit digits a feature:
with u = max |x| over the step / (127 * 254), x = u (254 h + l) + e, h and l in [-127, 127] and
|e| <= u / 2 (about 2^-16 of the step's largest feature, finer than fp16's 2^-11 of each feature). The digits
of four features go in one word, as the nibbles sit in a packed weight word (features 8i + 0, 2, 4, 6 and
8i + 1, 3, 5, 7), so a word's eight weights meet them in seven instructions: two masks and a shift lay the
nibbles into bytes, four ``dp4a.u32.s32`` add the exact integer products of each digit (``_WORD``). A step's
sum over a column is then u (254 H + L), less the zero point's z sum x, times the group's scale, in float32.

The digits are computed once a program, spread over its threads, into a scratch of its own (global memory
the program reads back after a barrier): each thread would otherwise repeat them for every step. An
sm_90 build's loop takes about 13 instructions a word where the fp16-pair kernel's (``int4_gemv``) takes 28,
yet on an H200 the kernel alone is only 3-6% faster at Llama-3.1-8B's shapes, with its weights in L2 or not
(``plugins/nvidia/scripts/gemv_sweep.py digits``): a batch-1 product of a few programs' steps each is bound
by its chain of latencies (the first loads, the split's finish), not by issuing instructions. Its results
are as close to float64 as the pairs' or closer (NMSE 2.8e-06 against 2.9e-06 in bfloat16).

Split-K and its finish, and dependent launch, as ``int4_gemv`` (the first words, scales and zeros issued
before the wait); tiles: ``int4_digits_config``. On other devices (the interpreter) the same integer sums
run in plain Triton (``ASM=False``), bit for bit.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import num_compute_units, pow2
from chitu_core.kernels.triton.gemv import GemvConfig, launch_int4_gemv
from chitu_core.kernels.triton.pdl import gdc_enter
from chitu_core.kernels.triton.split_k import RowSplit, finish_split, row_slice
from chitu_nvidia.int4_gemv import step_operands

LOW = tl.constexpr(254)
"""The high digit's unit over the low digit's: both digits of a feature then lie in [-127, 127]."""
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + ROUND - ROUND is v rounded to an integer (|v| < 2^22)

_WORD = tl.constexpr("""{
.reg .b32 lo, hi, zero;
mov.b32 zero, 0;
and.b32 lo, $2, 0x0F0F0F0F;
shr.u32 hi, $2, 4;
and.b32 hi, hi, 0x0F0F0F0F;
dp4a.u32.s32 $0, lo, $3, zero;
dp4a.u32.s32 $0, hi, $4, $0;
dp4a.u32.s32 $1, lo, $5, zero;
dp4a.u32.s32 $1, hi, $6, $1;
}""")


@triton.jit
def _dp4(a, b):
    """Sum of the four unsigned bytes of a times the four signed bytes of b (dp4a.u32.s32 with c = 0)."""
    t = ((a & 255) * ((b << 24) >> 24)) + (((a >> 8) & 255) * ((b << 16) >> 24))
    return t + (((a >> 16) & 255) * ((b << 8) >> 24)) + (((a >> 24) & 255) * (b >> 24))


@triton.jit
def _word(w, he, ho, le, lo, ASM: tl.constexpr):
    """For each word of w: the sums over its eight nibbles of q times the high digits (H) and the low (L)."""
    if ASM:
        return tl.inline_asm_elementwise(_WORD, "=r,=r,r,r,r,r,r", [w, he, ho, le, lo], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    even, odd = w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F
    return _dp4(even, he) + _dp4(odd, ho), _dp4(even, le) + _dp4(odd, lo)


@triton.jit
def _pack(d, STEPS: tl.constexpr, R: tl.constexpr):
    """Digits d [STEPS, 8R] (integer-valued float32) as words [STEPS, R, 2]: word e of packed row i holds the
    digits of features 8i + 2m + e in byte m."""
    m = tl.arange(0, 4)[None, None, :, None]
    bytes_ = (tl.reshape(d.to(tl.int32), (STEPS, R, 4, 2)) & 255) << (8 * m)
    return tl.sum(bytes_, axis=2)  # disjoint bits: the sum is their union


@triton.jit
def _write_digits(x, words, units, k_lo, k_hi, stride_xk, STEPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The program's slice of x as digit words [STEPS, R, 4] (high even, low even, high odd, low odd) and, by
    step, the low digit's unit and the sum of x [STEPS, 2]."""
    R: tl.constexpr = BLOCK_K // 8
    st = tl.arange(0, STEPS)
    k = k_lo + st[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    v = tl.load(x + k * stride_xk, mask=k < k_hi, other=0.0).to(tl.float32)
    top = tl.max(tl.abs(v), axis=1)
    unit = top / (127.0 * LOW)
    inv = tl.where(top > 0.0, (127.0 * LOW) / tl.where(top > 0.0, top, 1.0), 0.0)  # 1 / unit; a step of zeros: 0
    h = ((v * (inv / LOW)[:, None] + ROUND) - ROUND)
    low = (v - h * (unit * LOW)[:, None]) * inv[:, None]
    low = tl.minimum(tl.maximum((low + ROUND) - ROUND, -127.0), 127.0)
    hw, lw = _pack(h, STEPS, R), _pack(low, STEPS, R)
    at = (st[:, None, None] * R + tl.arange(0, R)[None, :, None]) * 4 + 2 * tl.arange(0, 2)[None, None, :]
    tl.store(words + at, hw)
    tl.store(words + at + 1, lw)
    tl.store(units + st * 2, unit)
    tl.store(units + st * 2 + 1, tl.sum(v, axis=1))


@triton.jit
def _digits(words, units, step, ri, R: tl.constexpr):
    """A step's digit words, by packed row, and its unit and sum of x."""
    d = tl.load(words + ((step * R + ri) * 4)[:, None] + tl.arange(0, 4)[None, :])  # one load a row
    high, low = tl.split(tl.reshape(d, (R, 2, 2)))  # split takes the last axis: words 0 2, then 1 3
    he, ho = tl.split(high)
    le, lo = tl.split(low)
    return he, ho, le, lo, tl.load(units + step * 2), tl.load(units + step * 2 + 1)


@triton.jit(do_not_specialize=["k_per_split", "split"])
def _int4_digits_kernel(
    out, partials, counters, x, qweight, scales, zeros, bias, N, K, k_per_split, split,
    stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_b, words, units,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, EVEN_N: tl.constexpr, STEPS: tl.constexpr,
    WARPS: tl.constexpr,
):
    R: tl.constexpr = BLOCK_K // 8
    rn, n_ok, k_lo, k_hi = row_slice(N, K, k_per_split, BLOCK_N)
    if EVEN_N:
        n_ok = tl.full((BLOCK_N,), True, tl.int1)
    ri = tl.arange(0, R)
    w_cols = qweight + rn[None, :] * stride_qn
    g_s, g_z = scales + rn * stride_sn, zeros + rn * stride_zn
    last = k_hi // 8 - R  # the slice's last tile: a prefetch past it loads that tile again, unmasked
    nxt, ns, nz = step_operands(w_cols, g_s, g_z, k_lo // 8, ri, n_ok, stride_qk, stride_sg, stride_zg, GROUP)
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    words += program.to(tl.int64) * (STEPS * R * 4)
    units += program.to(tl.int64) * (STEPS * 2)
    gdc_enter(PDL)  # the loads before it are weights, which no earlier kernel writes
    _write_digits(x, words, units, k_lo, k_hi, stride_xk, STEPS, BLOCK_K)
    tl.debug_barrier()  # the digits written before any thread reads them
    he, ho, le, lo, unit, sx = _digits(words, units, 0, ri, R)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w, s, z = nxt, ns, nz
        c_he, c_ho, c_le, c_lo, c_unit, c_sx = he, ho, le, lo, unit, sx
        nxt, ns, nz = step_operands(w_cols, g_s, g_z, tl.minimum(k0 // 8 + R, last), ri, n_ok, stride_qk, stride_sg,
                                    stride_zg, GROUP)
        he, ho, le, lo, unit, sx = _digits(words, units, tl.minimum((k0 - k_lo) // BLOCK_K + 1, STEPS - 1), ri, R)
        hs, ls = _word(w, c_he[:, None], c_ho[:, None], c_le[:, None], c_lo[:, None], ASM)
        dot = (tl.sum(hs, axis=0) * LOW + tl.sum(ls, axis=0)).to(tl.float32) * c_unit
        acc += (dot - z.to(tl.float32) * c_sx) * s.to(tl.float32)  # the step lies in one group
    finish_split(acc[None, :], out, partials, counters, bias, tl.arange(0, 1), rn, n_ok[None, :], 1, N, N,
                 stride_b, tl.program_id(0), tl.program_id(1), split, SPLIT_K, HAS_BIAS, 32 * WARPS)


def int4_digits_config(n: int, k: int, group_size: int, compute_units: int) -> GemvConfig:
    """Four warps a program of 512 columns (four a thread), 64 features a step (fewer where the group is
    smaller), K split until there are about four programs a compute unit, two where the weight has at most
    4,096 columns. On an H200 at Llama-3.1-8B's shapes that decoded 453.9 and 453.3 tok/s at batch 1 against
    445.9 and 445.6 for the fp16-pair kernel's tiles (two warps, 256 columns; 512 and 32 features for
    gate/up) and 443.7 and 444.2 for four programs a unit everywhere, in one call
    (docs/benchmarks/nvidia-h200-int4-digits.md)."""
    block_k = next(b for b in (64, 32, 16, 8) if group_size % b == 0)
    per_unit = 2 if n <= 4096 else 4
    split = max(1, min(triton.cdiv(k, block_k), triton.cdiv(per_unit * compute_units, triton.cdiv(n, 512))))
    return GemvConfig(512, block_k, split, 4)


def int4_digits_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None, config: GemvConfig | None = None,
                     asm: bool | None = None) -> torch.Tensor:
    """x [K] or [1, K] (bfloat16 or float16) -> [N] or [1, N] in x.dtype; operands as ``int4_linear`` takes
    them (checked by the caller). ``asm``: the PTX products (default: where x is on a CUDA device), else the
    same integer sums in plain Triton."""
    k, n = x.shape[-1], qweight.shape[1]
    cfg = config or int4_digits_config(n, k, group_size, num_compute_units(x.device))

    def scratch(plan: RowSplit) -> dict:  # each program's digits of its slice of x, and their units and sums
        steps, programs = pow2(plan.k_per_split // cfg.block_k), plan.blocks * plan.split
        return {"words": torch.empty(programs * steps * cfg.block_k // 2, dtype=torch.int32, device=x.device),
                "units": torch.empty(programs * steps * 2, dtype=torch.float32, device=x.device), "STEPS": steps}

    return launch_int4_gemv(_int4_digits_kernel, x, qweight, scales, zeros, group_size, bias, cfg, "int4_digits_gemv",
                            scratch, ASM=x.device.type == "cuda" if asm is None else asm, EVEN_N=n % cfg.block_n == 0,
                            WARPS=cfg.num_warps)
