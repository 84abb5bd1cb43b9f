"""fp8_linear for one row of 16-bit x (soft FP8: x not quantized) on NVIDIA GPUs of compute capability
8.9 and newer: a matrix-vector kernel with its products in half-precision pairs (PTX through
``tl.inline_asm_elementwise``), as ``int4_gemv`` does for 4-bit weights.

The weight [N, K] float8_e4m3fn is read as int32 words of four bytes along K. Each word takes 9
instructions for its four weights: two ``cvt.rn.f16x2.e4m3x2`` (two e4m3 bytes to an fp16 pair, exact:
every e4m3 value is an fp16 value), a multiply and a fused multiply-add in fp16 pairs against x's pairs
(x_k, x_{k+1}), and the pair's halves widened to float32 and added: two products per half in fp16, all
else float32. x is scaled by 2^-10 (exact) before it is rounded to fp16, so a half's sum of two
products (|w| <= 448) overflows only for |x| above about 74,000; the scale comes back in float32
with the weight's scales (per 128 x 128 block, or per output channel after the loop).

A program owns BLOCK_N rows of the weight and one of ``split`` slices of K, BLOCK_K features a step (one
scale block along K), the next step's words, x and scales loaded a step ahead; split-K partial sums are
added in a fixed order by the slice that finishes last (``split_k.finish_split``). Dependent launch
with the first words issued before the wait. On an H100 (plugins/nvidia/scripts/gemv_sweep.py, page
docs/benchmarks/nvidia-h100-pairs-gemv.md) it reads Llama-3.1-8B's gate/up weights at 0.79 of the byte
floor (``quant_matmul``'s tiles: 0.70), the others at 0.49-0.67 (0.43-0.65). On other devices (the
interpreter) the same sums run in float32 Triton (``ASM=False``), differing only by the fp16 roundings.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.act_quant import decode_e4m3_bytes
from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options
from chitu_core.kernels.triton.split_k import finish_split, row_slice, row_split
from chitu_core.kernels.triton.gemv import GemvConfig
from chitu_nvidia.int4_gemv import fp16_pair, pair_half

X_SCALE = tl.constexpr(1.0 / 1024.0)
X_UNSCALE = tl.constexpr(1024.0)

_DOT4 = tl.constexpr("""{
.reg .b16 lo, hi;
.reg .b32 a, b, p;
.reg .f16 e, f;
.reg .f32 fe, ff;
mov.b32 {lo, hi}, $1;
cvt.rn.f16x2.e4m3x2 a, lo;
cvt.rn.f16x2.e4m3x2 b, hi;
mul.rn.f16x2 p, a, $2;
fma.rn.f16x2 p, b, $3, p;
mov.b32 {e, f}, p;
cvt.f32.f16 fe, e;
cvt.f32.f16 ff, f;
add.f32 $0, fe, ff;
}""")


@triton.jit
def _e4m3(w, SHIFT: tl.constexpr):
    """float32 of the e4m3 byte at bit SHIFT of each word of w (``act_quant.decode_e4m3_bytes``, exact)."""
    return decode_e4m3_bytes(((w >> SHIFT) & 0xFF).to(tl.uint8)).to(tl.float32) * 256.0  # FP8_BYTES_FACTOR


@triton.jit
def _dot(w, p01, p23, ASM: tl.constexpr):
    """For each word of w (four e4m3 bytes, feature k = byte b's), sum over b of w_b x_b, x as fp16 pairs
    (x_{4i}, x_{4i+1}) and (x_{4i+2}, x_{4i+3})."""
    if ASM:
        return tl.inline_asm_elementwise(_DOT4, "=f,r,r,r", [w, p01, p23], dtype=tl.float32, is_pure=True, pack=1)
    t = _e4m3(w, 0) * pair_half(p01, 0) + _e4m3(w, 8) * pair_half(p01, 1)
    return t + _e4m3(w, 16) * pair_half(p23, 0) + _e4m3(w, 24) * pair_half(p23, 1)


@triton.jit
def _x_pairs(x, k0, stride_xk, W: tl.constexpr, ASM: tl.constexpr):
    """x at features k0 .. k0 + 4W as fp16 pairs a word: (x_{4i}, x_{4i+1}) and (x_{4i+2}, x_{4i+3}), scaled."""
    t = tl.load(x + (k0 + 4 * tl.arange(0, W))[:, None] * stride_xk + tl.arange(0, 4)[None, :] * stride_xk)
    even, odd = tl.split(tl.reshape(t.to(tl.float32) * X_SCALE, (W, 2, 2)))  # columns 0 2, 1 3
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return fp16_pair(x0, x1, ASM), fp16_pair(x2, x3, ASM)


@triton.jit(do_not_specialize=["k_per_split", "split"])
def _fp8_pairs_kernel(
    out, partials, counters, x, w32, scales, bias, N, K, k_per_split, split,
    stride_xk, stride_wn, stride_sn, stride_sk, stride_b,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, EVEN_N: tl.constexpr,
):
    W: tl.constexpr = BLOCK_K // 4
    rn, n_ok, k_lo, k_hi = row_slice(N, K, k_per_split, BLOCK_N)
    if EVEN_N:
        n_ok = tl.full((BLOCK_N,), True, tl.int1)
    rw = tl.arange(0, W)
    w_rows = w32 + rn.to(tl.int64)[:, None] * stride_wn
    last = k_hi - BLOCK_K  # the slice's last step: a prefetch past it loads that step again, unmasked
    acc2 = tl.zeros((BLOCK_N, W), dtype=tl.float32)
    s_rows = scales + (rn // SCALE_N) * stride_sn
    nxt = tl.load(w_rows + (k_lo // 4 + rw)[None, :], mask=n_ok[:, None])
    if SCALE_K > 0:
        ns = tl.load(s_rows + (k_lo // SCALE_K) * stride_sk, mask=n_ok)
    gdc_enter(PDL)  # the loads before it are weights, which no earlier kernel writes
    np01, np23 = _x_pairs(x, k_lo, stride_xk, W, ASM)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w, p01, p23 = nxt, np01, np23
        k1 = tl.minimum(k0 + BLOCK_K, last)
        nxt = tl.load(w_rows + (k1 // 4 + rw)[None, :], mask=n_ok[:, None])
        np01, np23 = _x_pairs(x, k1, stride_xk, W, ASM)
        t = _dot(w, p01[None, :], p23[None, :], ASM)
        if SCALE_K > 0:  # a step lies in one scale block along K
            s = ns
            ns = tl.load(s_rows + (k1 // SCALE_K) * stride_sk, mask=n_ok)
            acc2 += t * s[:, None]
        else:
            acc2 += t
    acc = tl.sum(acc2, axis=1) * X_UNSCALE
    if SCALE_K == 0:  # per output channel
        acc *= tl.load(s_rows, mask=n_ok)
    finish_split(acc[None, :], out, partials, counters, bias, tl.arange(0, 1), rn, n_ok[None, :], 1, N, N, stride_b,
                 tl.program_id(0), tl.program_id(1), split, SPLIT_K, HAS_BIAS)


def fp8_gemv_config(n: int, k: int, compute_units: int) -> GemvConfig:
    """128 features (one scale block) a step. Wide weights (n >= 16384, a gated pair's): 64 rows for eight
    warps, no split; else 32 rows for four warps (two where K > 8192), K split until there are about
    eight programs per compute unit. From plugins/nvidia/scripts/gemv_sweep.py on an H100 at
    Llama-3.1-8B's shapes."""
    if n >= 16384:
        return GemvConfig(64, 128, 1, 8)
    block_n, warps = 32, (2 if k > 8192 else 4)
    programs = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(k, 128), triton.cdiv(8 * compute_units, programs)))
    return GemvConfig(block_n, 128, split, warps)


def fits(weight: torch.Tensor, block_size: tuple[int, int] | None, block_k: int = 128) -> bool:
    """Whether this kernel takes the weight: K a multiple of the step, whole words, the step inside one
    scale block along K."""
    k = weight.shape[1]
    return (k % block_k == 0 and weight.stride(1) == 1 and weight.stride(0) % 4 == 0
            and (block_size is None or block_size[1] % block_k == 0))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int] | None,
             bias: torch.Tensor | None, config: GemvConfig | None = None, asm: bool | None = None) -> torch.Tensor:
    """x [K] or [1, K] (bfloat16 or float16) -> [N] or [1, N] in x.dtype: x @ (weight * scales).T + bias,
    operands as ``fp8_linear`` takes them (checked by the caller). ``asm``: the PTX products (default:
    where x is on a CUDA device), else the float32 Triton form."""
    n, k = weight.shape
    cfg = config or fp8_gemv_config(n, k, num_compute_units(x.device))
    if not fits(weight, block_size, cfg.block_k):
        raise ValueError(f"fp8_gemv: weight {list(weight.shape)} (strides {weight.stride()}), block_size {block_size} "
                         f"do not fit {cfg.block_k}-feature steps")
    row = x.reshape(k)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    plan = row_split(k, n, cfg.block_k, cfg.block_n, cfg.split_k, out, "fp8_gemv")
    w32 = weight.view(torch.int32)
    b = bias if bias is not None else out
    scale_n, scale_k = (block_size[0], block_size[1]) if block_size is not None else (1, 0)
    _fp8_pairs_kernel[(plan.blocks, plan.split)](
        out, plan.partials, plan.counters, row, w32, scales, b, n, k, plan.k_per_split, plan.split,
        row.stride(0), w32.stride(0), scales.stride(0), scales.stride(1) if scales.dim() > 1 else 0, b.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCALE_N=scale_n, SCALE_K=scale_k, SPLIT_K=plan.split > 1,
        HAS_BIAS=bias is not None, ASM=x.device.type == "cuda" if asm is None else asm, EVEN_N=n % cfg.block_n == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(x.device))
    return out.reshape(*x.shape[:-1], n)
