"""The Triton matmul behind ``fp8_linear`` and ``int8_linear``: 8-bit weights, scaled, times x.

out[m, n] = sum_k a[m, k] * w[n, k] * scales + bias[n], in float32, stored in x.dtype. The weight
is FP8 e4m3 (loaded as float8e4nv, or as its byte patterns and decoded exactly in registers on
targets without FP8 types, see ``act_quant.decode_e4m3_bytes``) or int8; its scale is per output
channel (applied once, after the K loop) or per [BN_W, BK_W] block (applied to each K tile's
partial sum, every K tile lying inside one block column because BLOCK_K divides BK_W). ``a`` is:

* "x":    x itself: the weight tile is converted to x's dtype in registers ("soft" FP8, W8A16);
* "pre":  x already quantized by ``act_quant.quantize_groups`` (8-bit or float16 carrier and its
          float32 scales): 8-bit products on the tensor cores (the GEMM path, large M);
* "fp8" / "int8": x quantized here, tile by tile (the matrix-vector path, small M): with block
          scales each K tile is one group; otherwise a first pass over the row finds its scale.

Each program computes a [BLOCK_M, BLOCK_N] tile over one of SPLIT_K ranges of K, so small M still
spreads the weight over enough programs to keep every multiprocessor streaming it: each weight byte
is read once. ``DOT`` picks ``tl.dot`` (GEMM and M of a few tokens and more) or a broadcast multiply
and reduction along K in registers (M of one or two). With SPLIT_K > 1 each program writes float32
partial sums and the last slice of each output tile adds them in order (``split_k.finish_split``:
deterministic, no second launch), with the bias and the cast. Tile sizes: ``matmul_config``. The launch
reads nothing back from the device (graph-safe), and is dependent (``pdl``) where the device allows.
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.act_quant import (
    FP8_BYTES_FACTOR,
    FP8_MAX,
    INT8_MAX,
    decode_e4m3_bytes,
    group_scale,
    quantize_groups,
    quantize_tile,
)
from chitu_core.kernels.triton.common import as_rows, num_compute_units, pow2
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options
from chitu_core.kernels.triton.split_k import check_split_tiles, finish_split, k_mask, split_counters

TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class MatmulConfig:
    """Tiles: BLOCK_M rows of x, BLOCK_N output channels, BLOCK_K of the reduction per step, SPLIT_K
    ranges of K (each its own program), ``dot``: tl.dot or a reduction in registers; ``inline``:
    dynamic activation quantization inside the matmul (else a pass of its own before it)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    dot: bool = True
    inline: bool = False
    num_warps: int = 4
    num_stages: int = 3


DECODE_PROGRAMS_PER_UNIT = 6
"""Decode (M <= 16) splits K until there are about this many programs per compute unit: the
matrix-vector loop is not software-pipelined, so concurrent programs are what keep loads in flight."""


def matmul_config(m: int, n: int, k: int, compute_units: int, operand_bytes: int) -> MatmulConfig:
    """Tiles by the number of rows M (``operand_bytes``: 1 for 8-bit products, 2 for 16-bit, 4 for
    float32), from the sweep on an H100 at Llama-3.1-8B's shapes (plugins/nvidia/scripts/quant_sweep.py).
    Decode (M <= 16): 16-row tl.dot tiles, thin (32 columns) for 16-bit products, where batch 1 read the
    weights at 0.49-0.81 of the byte floor; one or two rows of 8-bit products keep the reduction in
    registers (fastest for int8 there); K split until DECODE_PROGRAMS_PER_UNIT programs per compute unit
    exist. M up to 64: 64x64 tiles, K split up to 4 ways where N gives fewer than two programs per unit.
    Larger M: GEMM tiles, K whole."""
    narrow_k = 2 if operand_bytes == 4 else 1  # float32 tiles take twice the registers
    if m <= 2 and operand_bytes == 1:
        config = MatmulConfig(pow2(m), 16, 256, dot=False, inline=True, num_warps=4)
    elif m <= 16:
        block_n = 128 if operand_bytes == 1 else 32
        config = MatmulConfig(16, block_n, 256 // narrow_k, inline=True, num_warps=4, num_stages=3)
    elif m <= 64:
        config = MatmulConfig(64, 64, (128 if operand_bytes == 1 else 64) // narrow_k, num_warps=4, num_stages=3)
        programs = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
        return replace(config, split_k=min(4, triton.cdiv(k, config.block_k), max(1, triton.cdiv(2 * compute_units, programs))))
    else:
        return MatmulConfig(128, 128, (128 if operand_bytes == 1 else 64) // narrow_k, num_warps=8, num_stages=3)
    programs = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    wanted = DECODE_PROGRAMS_PER_UNIT * compute_units
    return replace(config, split_k=min(triton.cdiv(k, config.block_k), max(1, triton.cdiv(wanted, programs))))


@triton.jit
def weight_tile(ptrs, mask, W_KIND: tl.constexpr, CT: tl.constexpr):
    """A weight tile as CT: "fp8_bytes" decoded in registers, "int8", or a float type ("fp8", "float")."""
    if W_KIND == "fp8_bytes":
        return decode_e4m3_bytes(tl.load(ptrs, mask=mask, other=0)).to(CT)
    elif W_KIND == "int8":
        return tl.load(ptrs, mask=mask, other=0).to(CT)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(CT)


@triton.jit(do_not_specialize=["M", "split_k"])
def _quant_matmul_kernel(
    out_ptr, partials_ptr, counters, x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, M, N, K, split_k,
    stride_xm, stride_xk, stride_xs, stride_wn, stride_wk, stride_wsn, stride_wsk, stride_b, stride_om,
    W_KIND: tl.constexpr, A_MODE: tl.constexpr, W_BLOCKS: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr,
    QMAX: tl.constexpr, CT: tl.constexpr, ACC_T: tl.constexpr, W_FACTOR: tl.constexpr, DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    """EVEN_K: K is a whole number of BLOCK_K tiles (and so is every slice), so no load is masked along K
    and a tile's rows may load in wide vectors (as ``int4_linear``'s kernel)."""
    gdc_enter(PDL)
    INLINE: tl.constexpr = A_MODE == "fp8" or A_MODE == "int8"
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = m < M, n < N
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k) * BLOCK_K
    k_lo = tl.program_id(2) * per_split
    k_hi = tl.minimum(K, k_lo + per_split)
    m64 = m.to(tl.int64)
    x_rows = x_ptr + m64[:, None] * stride_xm
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    if INLINE and not W_BLOCKS:  # one group per row: its scale before the products
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            xf = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_mask(k, K, EVEN_K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xf.to(tl.float32)), axis=1))
        a_scale = group_scale(amax, QMAX)
    if A_MODE == "pre" and not W_BLOCKS:
        a_scale = tl.load(xs_ptr + m * stride_xs, mask=m_ok, other=1.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_T)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        k_ok = k_mask(k, k_hi, EVEN_K)
        w = weight_tile(w_rows + k[None, :] * stride_wk, n_ok[:, None] & k_ok[None, :], W_KIND, CT)  # [BN, BK]
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        if INLINE:
            a = a.to(tl.float32)
            if W_BLOCKS:
                a_scale = group_scale(tl.max(tl.abs(a), axis=1), QMAX)
            a = quantize_tile(a, a_scale[:, None], A_MODE)
        a = a.to(CT)
        if DOT:
            if CT == tl.float32:
                part = tl.dot(a, tl.trans(w), input_precision="ieee", out_dtype=ACC_T)
            else:
                part = tl.dot(a, tl.trans(w), out_dtype=ACC_T)
        else:
            part = tl.sum(a[:, None, :] * w[None, :, :], axis=2)
        if W_BLOCKS:
            block_col = k0 // BK_W
            w_scale = tl.load(ws_ptr + (n // BN_W) * stride_wsn + block_col * stride_wsk, mask=n_ok, other=0.0)
            part = part * w_scale[None, :]
            if A_MODE == "pre":
                part = part * tl.load(xs_ptr + m * stride_xs + block_col, mask=m_ok, other=1.0)[:, None]
            elif INLINE:
                part = part * a_scale[:, None]
        acc += part
    result = acc.to(tl.float32)
    if W_BLOCKS:
        result = result * W_FACTOR
    else:
        result = result * (tl.load(ws_ptr + n * stride_wsn, mask=n_ok, other=0.0) * W_FACTOR)[None, :]
        if A_MODE != "x":
            result = result * a_scale[:, None]
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    finish_split(result, out_ptr, partials_ptr, counters, bias_ptr, m, n, m_ok[:, None] & n_ok[None, :], M, N,
                 stride_om, stride_b, tile, tl.program_id(2), split_k, PARTIALS, HAS_BIAS)

def quant_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, *,
                 w_kind: str, act_quant: str | None, block_size: tuple[int, int] | None,
                 config: MatmulConfig | None = None) -> torch.Tensor:
    """x [..., K] (any strides) @ (weight [N, K] * scales).T + bias -> [..., N] in x.dtype.

    w_kind: "fp8" (float8_e4m3fn, read as such), "fp8_bytes" (float8_e4m3fn read as bytes) or
    "int8"; act_quant: None, "fp8" or "int8" (x quantized dynamically, see ``act_quant``);
    block_size: (BN_W, BK_W) of block scales [ceil(N / BN_W), ceil(K / BK_W)], or None for scales
    [N]. ``config`` overrides ``matmul_config`` (tests, tuning)."""
    n, k = weight.shape
    rows = as_rows(x)
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if k == 0:
        return (out.zero_() if bias is None else out.copy_(bias.expand(m, n))).view(*x.shape[:-1], n)
    bn_w, bk_w = block_size if block_size is not None else (1, 1)
    operand_bytes = 1 if act_quant else (4 if x.dtype == torch.float32 else 2)
    config = config or matmul_config(m, n, k, num_compute_units(x.device), operand_bytes)
    block_k = config.block_k
    if block_size is not None:
        while bk_w % block_k:  # every K tile inside one block column
            block_k //= 2
    dot = config.dot and block_k >= 16
    inline = act_quant is not None and config.inline and (block_size is None or block_k == bk_w)
    a_mode, x_in, xs = "x", rows, scales
    if act_quant is not None and not inline:
        carrier = torch.int8 if act_quant == "int8" else (
            torch.float8_e4m3fn if w_kind == "fp8" else torch.float16)
        x_in, xs = quantize_groups(rows, bk_w if block_size is not None else k, act_quant, carrier)
        a_mode = "pre"
    elif act_quant is not None:
        a_mode = act_quant
    ct, acc_t = _compute_types(x.dtype, w_kind, act_quant, a_mode, dot)
    split = config.split_k
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split)
    if split > 1:
        check_split_tiles(grid[0] * grid[1], "quant_matmul")
    partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    w = weight.view(torch.uint8) if w_kind == "fp8_bytes" else weight
    b = bias if bias is not None else out  # an unread stand-in
    _quant_matmul_kernel[grid](
        out, partials, split_counters(x.device), x_in, xs, w, scales, b, m, n, k, split, x_in.stride(0),
        x_in.stride(1), xs.stride(0), w.stride(0), w.stride(1), scales.stride(0), scales.stride(-1), b.stride(-1), n,
        W_KIND=w_kind, A_MODE=a_mode, W_BLOCKS=block_size is not None, BN_W=bn_w, BK_W=bk_w,
        QMAX=INT8_MAX if act_quant == "int8" else FP8_MAX, CT=ct, ACC_T=acc_t,
        W_FACTOR=FP8_BYTES_FACTOR if w_kind == "fp8_bytes" else 1.0, DOT=dot, HAS_BIAS=bias is not None,
        PARTIALS=split > 1, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(x.device))
    return out.view(*x.shape[:-1], n)


def _compute_types(x_dtype: torch.dtype, w_kind: str, act_quant: str | None, a_mode: str, dot: bool):
    """(dtype the products are formed in, accumulator dtype): integer products of int8 activations
    are exact in int32; FP8 activations times FP8 weights are exact in float16 (or FP8 itself for
    the tensor cores); otherwise weights take x's dtype (float32 for the reduction in registers)."""
    if act_quant == "int8":
        return (tl.int8 if dot else tl.int32), tl.int32
    if not dot:
        return tl.float32, tl.float32
    if act_quant == "fp8":
        return (tl.float8e4nv if a_mode == "pre" and w_kind == "fp8" else tl.float16), tl.float32
    return TORCH_TO_TL[x_dtype], tl.float32
