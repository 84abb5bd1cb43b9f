"""int4_linear for one row of 16-bit x on NVIDIA GPUs: the matrix-vector kernel with its inner product in
half-precision pairs (PTX through ``tl.inline_asm_elementwise``).

Each packed word (nibble j = feature 8i + j) takes 16 instructions for its eight weights, against
about 6 a nibble in the portable kernel (``chitu_core.kernels.triton.gemv``):

* four masks (one LOP3 each, and one shift) lay nibbles (j, j + 4) into the low mantissa bits of the
  fp16 pair (1024, 1024): nibbles 0 and 2 at the lowest bits, giving 1024 + q exactly, nibbles 1 and 3
  four bits higher, giving 1024 + 16 q (the shifts that would move them down are saved); one
  fp16-pair subtraction of 1024 leaves q, or one fused multiply-add, (1024 + 16 q) / 16 - 64 (exact);
* one multiply and three fused multiply-adds in fp16 pairs meet them with x's pairs (x_j, x_{j+4});
* the pair's two halves widen to float32 and add: four products per half in fp16, all else float32.

x is scaled by 1/64 (exact, a power of two) before it is rounded to fp16, so a half's sum of four
products (q <= 15) overflows only for |x| above about 70,000 (fp16's range is 65,504); the scale comes
back in float32, as do the zero point (z times the float32 sum of the step's x) and the group's scale,
once a step: a step lies in one group, so its rows' sums are added first. The fp16 roundings cost
about 2^-11 of a product, under bfloat16's own 2^-9 on the output (conformance: ``int4_linear``).

A program owns BLOCK_N columns and a slice of K; every operand of a step (words, the group's scales
and zeros, x: one [R, 8] load) is loaded a step ahead; split-K partial sums are added in a fixed order
by the slice that finishes last (``split_k.finish_split``); dependent launch with the first words,
scales and zeros issued before the wait. On an H200 (plugins/nvidia/scripts/gemv_sweep.py, pages
docs/benchmarks/nvidia-h200-int4-gemv.md and nvidia-h200-int4-warps.md) it reads Llama-3.1-8B's gate/up
weights at 0.61 of the byte floor (portable: 0.36) and the smaller ones at 0.26-0.45 (0.22-0.33), where a
kernel's start and split-K finish weigh as much as its bytes (plugins/nvidia/scripts/bounds_check.py). On
other devices (the interpreter) the same sums run in float32 Triton (``ASM=False``), differing only by the
fp16 roundings.

The decode-step fusions over 4-bit weights (contract 1.18) in the same kernel: with a norm, x and the norm's
weight loaded as [R, 8] tiles and multiplied before the split into pairs (the squares of x kept by row, added
up after the loop), the norm's factor applied at the end; gated, a tile of each half a program; with a
residual, added before the one rounding (``fused_gemv.finish_fused_row``). The backend serves them only with
CHITU_INT4_FUSIONS=1 (``chitu_nvidia.ops.INT4_FUSIONS``: on an H200 not faster in the model).
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.fused_gemv import ACTIVATIONS, finish_fused_row
from chitu_core.kernels.triton.gemv import GemvConfig, launch_int4_gemv, split8, x8
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options
from chitu_core.kernels.triton.split_k import finish_split, row_slice, row_split

X_SCALE = tl.constexpr(1.0 / 64.0)
X_UNSCALE = tl.constexpr(64.0)

_DOT8 = tl.constexpr("""{
.reg .b32 a, b, c, d, t, k, lo4, hi4, sixteenth, neg64;
.reg .f16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 k, 0x64006400;
mov.b32 lo4, 0x000F000F;
mov.b32 hi4, 0x00F000F0;
mov.b32 sixteenth, 0x2C002C00;
mov.b32 neg64, 0xD400D400;
lop3.b32 a, $1, lo4, k, 0xea;
lop3.b32 b, $1, hi4, k, 0xea;
shr.u32 t, $1, 8;
lop3.b32 c, t, lo4, k, 0xea;
lop3.b32 d, t, hi4, k, 0xea;
sub.f16x2 a, a, k;
fma.rn.f16x2 b, b, sixteenth, neg64;
sub.f16x2 c, c, k;
fma.rn.f16x2 d, d, sixteenth, neg64;
mul.rn.f16x2 a, a, $2;
fma.rn.f16x2 a, b, $3, a;
fma.rn.f16x2 a, c, $4, a;
fma.rn.f16x2 a, d, $5, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")


@triton.jit
def fp16_pair(lo, hi, ASM: tl.constexpr):
    """fp16 pair (lo in the low half) of two float32 tensors, as int32 bits."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                         is_pure=True, pack=1)
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo16 | (hi16 << 16)


@triton.jit
def pair_half(pair, J: tl.constexpr):
    """Half J (0 low) of an fp16 pair, as float32."""
    return ((pair >> (16 * J)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dot8(w, x04, x15, x26, x37, ASM: tl.constexpr):
    """Sum over j of q_j x_j for each word of w (nibble j = q_j), given the fp16 pairs (x_j, x_{j+4})."""
    if ASM:
        return tl.inline_asm_elementwise(_DOT8, "=f,r,r,r,r,r", [w, x04, x15, x26, x37],
                                         dtype=tl.float32, is_pure=True, pack=1)
    t = ((w & 0xF).to(tl.float32) * pair_half(x04, 0) + ((w >> 16) & 0xF).to(tl.float32) * pair_half(x04, 1))
    t += ((w >> 4) & 0xF).to(tl.float32) * pair_half(x15, 0) + ((w >> 20) & 0xF).to(tl.float32) * pair_half(x15, 1)
    t += ((w >> 8) & 0xF).to(tl.float32) * pair_half(x26, 0) + ((w >> 24) & 0xF).to(tl.float32) * pair_half(x26, 1)
    t += ((w >> 12) & 0xF).to(tl.float32) * pair_half(x37, 0) + ((w >> 28) & 0xF).to(tl.float32) * pair_half(x37, 1)
    return t


@triton.jit
def step_operands(w_cols, g_s, g_z, row, ri, n_ok, stride_qk, stride_sg, stride_zg, GROUP: tl.constexpr):
    """A step's words (packed rows row + ri of the columns w_cols points at) and its group's scales and zeros."""
    w = tl.load(w_cols + (row + ri).to(tl.int64)[:, None] * stride_qk, mask=n_ok[None, :])
    group = row * 8 // GROUP
    return w, tl.load(g_s + group * stride_sg, mask=n_ok), tl.load(g_z + group * stride_zg, mask=n_ok)


@triton.jit
def _halves(w_cols, g_s, g_z, row, ri, n_ok, u_off, u_s, u_z, stride_qk, stride_sg, stride_zg, GROUP: tl.constexpr,
            GATED: tl.constexpr):
    """``step_operands`` of a step for the program's columns and, where gated, for the up half's (u_off, u_s, u_z
    past them; else the same ones again)."""
    w, s, z = step_operands(w_cols, g_s, g_z, row, ri, n_ok, stride_qk, stride_sg, stride_zg, GROUP)
    if GATED:
        w_u, s_u, z_u = step_operands(w_cols + u_off, g_s + u_s, g_z + u_z, row, ri, n_ok, stride_qk, stride_sg,
                                      stride_zg, GROUP)
    else:
        w_u, s_u, z_u = w, s, z
    return w, s, z, w_u, s_u, z_u


@triton.jit
def _x8_rows(x, rows, stride_xk):
    """x at features 8i + j for i in rows, j = 0..7: one [R, 8] load."""
    return tl.load(x + (rows * 8 * stride_xk)[:, None] + tl.arange(0, 8)[None, :] * stride_xk)


@triton.jit
def _step(w, s, z, p04, p15, p26, p37, sx, ASM: tl.constexpr):
    """One step's share of a column's sums: its rows' products added, less the zero point's z sum x, scaled."""
    t = _dot8(w, p04[:, None], p15[:, None], p26[:, None], p37[:, None], ASM)
    return (tl.sum(t, axis=0) - z.to(tl.float32) * sx) * (s.to(tl.float32) * X_UNSCALE)


@triton.jit(do_not_specialize=["k_per_split", "split"])
def _int4_pairs_kernel(
    out, partials, counters, x, qweight, scales, zeros, bias, N, K, k_per_split, split,
    stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_b,
    squares, nw, res, eps, stride_nw, stride_rn,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, EVEN_N: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr, WARPS: tl.constexpr,
):
    R: tl.constexpr = BLOCK_K // 8
    GATED: tl.constexpr = ACT != "none"
    rn, n_ok, k_lo, k_hi = row_slice(N, K, k_per_split, BLOCK_N)  # N: columns (of each half where gated)
    if EVEN_N:
        n_ok = tl.full((BLOCK_N,), True, tl.int1)
    ri = tl.arange(0, R)
    w_cols = qweight + rn[None, :] * stride_qn
    u_off, u_s, u_z = N * stride_qn, N * stride_sn, N * stride_zn  # the up half's columns, where gated
    last = k_hi // 8 - R  # the slice's last tile: a prefetch past it loads that tile again, unmasked
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = acc
    squares_r = tl.zeros((R,), dtype=tl.float32)  # the slice's squares of x by packed row, for the norm
    # every operand of a step is loaded a step ahead: the words, the group's scales and zeros, and x (with a
    # norm, x and the norm's weight as [R, 8] tiles, split once multiplied: one set of layout changes a step)
    row = k_lo // 8
    g_s, g_z = scales + rn * stride_sn, zeros + rn * stride_zn
    nxt, ns, nz, nxt_u, ns_u, nz_u = _halves(w_cols, g_s, g_z, row, ri, n_ok, u_off, u_s, u_z, stride_qk, stride_sg,
                                             stride_zg, GROUP, GATED)
    if NORM:
        n_nw = _x8_rows(nw, row + ri, stride_nw)
    gdc_enter(PDL)  # the loads before it are weights, which no earlier kernel writes
    if NORM:
        n_x = _x8_rows(x, row + ri, stride_xk)
    else:
        nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7 = x8(x + (row + ri) * 8 * stride_xk, stride_xk, R)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w, s, z, w_u, s_u, z_u = nxt, ns, nz, nxt_u, ns_u, nz_u
        if NORM:
            xt = n_x.to(tl.float32)
            squares_r += tl.sum(xt * xt, axis=1)
            x0, x1, x2, x3, x4, x5, x6, x7 = split8(xt * n_nw.to(tl.float32) * X_SCALE, R)
        else:
            x0, x1, x2, x3 = nx0.to(tl.float32) * X_SCALE, nx1.to(tl.float32) * X_SCALE, \
                nx2.to(tl.float32) * X_SCALE, nx3.to(tl.float32) * X_SCALE
            x4, x5, x6, x7 = nx4.to(tl.float32) * X_SCALE, nx5.to(tl.float32) * X_SCALE, \
                nx6.to(tl.float32) * X_SCALE, nx7.to(tl.float32) * X_SCALE
        row = tl.minimum(k0 // 8 + R, last)
        nxt, ns, nz, nxt_u, ns_u, nz_u = _halves(w_cols, g_s, g_z, row, ri, n_ok, u_off, u_s, u_z, stride_qk,
                                                 stride_sg, stride_zg, GROUP, GATED)
        if NORM:
            n_x = _x8_rows(x, row + ri, stride_xk)
            n_nw = _x8_rows(nw, row + ri, stride_nw)
        else:
            nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7 = x8(x + (row + ri) * 8 * stride_xk, stride_xk, R)
        p04, p15 = fp16_pair(x0, x4, ASM), fp16_pair(x1, x5, ASM)
        p26, p37 = fp16_pair(x2, x6, ASM), fp16_pair(x3, x7, ASM)
        sx = tl.sum(((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7)), axis=0)  # the zero point's share: z sum x
        acc += _step(w, s, z, p04, p15, p26, p37, sx, ASM)  # the step lies in one group
        if GATED:
            acc_u += _step(w_u, s_u, z_u, p04, p15, p26, p37, sx, ASM)
    if NORM or GATED or RESIDUAL:
        ss = tl.zeros((1,), dtype=tl.float32) + tl.sum(squares_r, axis=0)
        finish_fused_row(acc, acc_u, ss, out, partials, squares, counters, bias, res, rn, rn + N, n_ok, N, K, eps,
                         stride_b, stride_rn, tl.program_id(0), tl.program_id(1), split, SPLIT_K, 32 * WARPS, NORM,
                         ACT, RESIDUAL, HAS_BIAS)
    else:
        finish_split(acc[None, :], out, partials, counters, bias, tl.arange(0, 1), rn, n_ok[None, :], 1, N, N,
                     stride_b, tl.program_id(0), tl.program_id(1), split, SPLIT_K, HAS_BIAS, 32 * WARPS)


def int4_gemv_config(n: int, k: int, group_size: int, compute_units: int) -> GemvConfig:
    """Four columns a thread, two warps a program: 256 columns and 64 features a step, K split until there
    are about four programs per compute unit; wide weights (n >= 16384, a gated pair's) 512 columns and 32
    features a step, about eight programs per unit. Fewer features a step where the group is smaller. On
    an H200, Llama-3.1-8B at batch 1 decodes 426 -> 434 tok/s against one warp of 128 columns a program,
    eight a unit (the split's finish now reading as many slices a load as 64 float32 a thread allows:
    ``split_k.finish_split``); four or eight warps a program were slower, and no tile of
    plugins/nvidia/scripts/gemv_sweep.py's 54 beats these alone (docs/benchmarks/nvidia-h200-int4-warps.md)."""
    block_n, warps, block_k, per_unit = (512, 2, 32, 8) if n >= 16384 else (256, 2, 64, 4)
    block_k = next(b for b in (block_k, 32, 16, 8) if b <= block_k and group_size % b == 0)
    programs = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(k, block_k), triton.cdiv(per_unit * compute_units, programs)))
    return GemvConfig(block_n, block_k, split, warps)


def int4_fused_config(n: int, k: int, group_size: int, gated: bool, compute_units: int) -> GemvConfig:
    """Tiles of the fused forms (n: the output's columns): ``int4_gemv_config``'s; gated, 128 columns of each
    half for one warp, 64 features a step, K split until there are about 16 programs a compute unit. On an
    H200 at Llama-3.1-8B's gate/up (plugins/nvidia/scripts/gemv_sweep.py fused) that took 26.3 us, the
    halved wide tiles 30.3 us, the norm in the product's kernel then the activation 32.4 us."""
    if not gated:
        return int4_gemv_config(n, k, group_size, compute_units)
    block_k = next(b for b in (64, 32, 16, 8) if group_size % b == 0)
    return GemvConfig(128, block_k, max(1, min(triton.cdiv(k, block_k), triton.cdiv(16 * compute_units,
                                                                                    triton.cdiv(n, 128)))), 1)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None, config: GemvConfig | None = None, asm: bool | None = None,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0, activation: str | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [K] or [1, K] (bfloat16 or float16) -> [N] or [1, N] in x.dtype; operands as ``int4_linear``
    takes them (checked by the caller). ``asm``: the PTX products (default: where x is on a CUDA device),
    else the float32 Triton form. The decode-step fusions of contract 1.18: with ``norm_weight`` [K],
    the product of rms_norm(x) (``int4_rms_norm_linear``), with ``activation`` too its gated activation
    ([N/2]: the program holds a tile of each half); with ``residual`` [N], residual + the product
    (``int4_linear_add``)."""
    n, k = qweight.shape[1], x.shape[-1]
    asm = x.device.type == "cuda" if asm is None else asm
    if norm_weight is None and activation is None and residual is None:
        cfg = config or int4_gemv_config(n, k, group_size, num_compute_units(x.device))
        row = x.reshape(k)
        return launch_int4_gemv(_int4_pairs_kernel, x, qweight, scales, zeros, group_size, bias, cfg,
                                "int4_gemv (pairs)", ASM=asm, EVEN_N=n % cfg.block_n == 0, squares=row, nw=row,
                                res=row, eps=0.0, stride_nw=0, stride_rn=0, NORM=False, ACT="none", RESIDUAL=False,
                                WARPS=cfg.num_warps)
    if activation not in ACTIVATIONS or (activation is not None and (n % 2 or norm_weight is None)):
        raise ValueError(f"int4_gemv: activation {activation!r} with {n} outputs (one of {list(ACTIVATIONS)}, an "
                         "even width and a norm where gated)")
    gated = activation is not None
    n_out = n // 2 if gated else n
    cfg = config or int4_fused_config(n_out, k, group_size, gated, num_compute_units(x.device))
    if group_size % cfg.block_k or cfg.block_k % 8:
        raise ValueError(f"int4_gemv: block_k {cfg.block_k} must be a multiple of 8 dividing group size {group_size}")
    row = x.reshape(k)
    out = torch.empty(n_out, dtype=x.dtype, device=x.device)
    plan = row_split(k, n, cfg.block_k, cfg.block_n, cfg.split_k, out, "int4_gemv (fused)")  # partials: [split, n]
    tiles = triton.cdiv(n_out, cfg.block_n)
    squares = torch.empty(tiles * plan.split if norm_weight is not None and plan.split > 1 else 1,
                          dtype=torch.float32, device=x.device)
    res = residual.reshape(n_out) if residual is not None else out
    b = bias if bias is not None else out
    _int4_pairs_kernel[(tiles, plan.split)](
        out, plan.partials, plan.counters, row, qweight, scales, zeros, b, n_out, k, plan.k_per_split, plan.split,
        row.stride(0), *qweight.stride(), *scales.stride(), *zeros.stride(), b.stride(0),
        squares, norm_weight if norm_weight is not None else row, res, eps,
        norm_weight.stride(0) if norm_weight is not None else 0, res.stride(0),
        GROUP=group_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=plan.split > 1, HAS_BIAS=bias is not None,
        ASM=asm, EVEN_N=n_out % cfg.block_n == 0, NORM=norm_weight is not None, ACT=ACTIVATIONS[activation],
        RESIDUAL=residual is not None, WARPS=cfg.num_warps, num_warps=cfg.num_warps, num_stages=1,
        **pdl_options(x.device))
    return out.reshape(*x.shape[:-1], n_out)
