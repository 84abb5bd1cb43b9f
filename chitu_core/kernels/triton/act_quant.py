"""Dynamic activation quantization for the quantized linears (``int8_linear``, ``fp8_linear`` with
``act_quant``), rounding exactly as the op contract and its reference (``chitu_core.ops.quant_reference``).

Per group of g values of a row (int8: the whole row; FP8: ``block_size[1]`` values with block
scales, else the whole row), in float32: s = max|group| / QMAX (IEEE division; 1 for an all-zero
group), then each value divided by s (IEEE) and rounded:

* int8: to the nearest integer, ties to even, clamped to [-127, 127];
* FP8 e4m3: to the nearest e4m3 value, ties to even. Computed here in float32 arithmetic
  (``round_to_e4m3``), so the result is the same on every Triton target and in the interpreter
  (whose float32 -> fp8 cast rounds ties away from zero); the value is then exact in any carrier:
  float8_e4m3fn where the target has it, float16 elsewhere.

Rounding to an integer is ``(v + 1.5 * 2**23) - 1.5 * 2**23``: an IEEE float32 add rounds to
nearest even at the units place for |v| < 2**22, on every target and in the interpreter (where
``libdevice.rint`` does not run).

``quantize_groups`` is the stand-alone pass the GEMM path of ``quant_matmul`` reads from; the
matrix-vector path quantizes its x tiles inline with the same ``quantize_tile``.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import pow2

ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
FP8_MAX = 448.0
INT8_MAX = 127.0


@triton.jit
def round_half_even(v):
    """v (float32, |v| < 2**22) rounded to an integer value, ties to even."""
    return (v + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, as float32.

    The e4m3 grid in the binade [2**e, 2**(e+1)) has step 2**(e-3); below 2**-6 (subnormals) the step
    stays 2**-9. v * 2**(3-e) is exact (a power of two), so one integer rounding does it."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    up = ((127 + 3 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**(3-e)
    down = ((127 - 3 + exponent) << 23).to(tl.float32, bitcast=True)  # 2**(e-3)
    return round_half_even(v * up) * down


@triton.jit
def group_scale(amax, QMAX: tl.constexpr):
    """The quantization scale of a group from its max |value|: amax / QMAX, or 1 for an all-zero group."""
    return tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)


@triton.jit
def quantize_tile(x, scale, KIND: tl.constexpr):
    """x (float32 [.., K]) / scale (broadcastable), rounded: KIND "int8" or "fp8". Returns float32 values."""
    v = tl.math.div_rn(x, scale)
    if KIND == "int8":
        return tl.minimum(tl.maximum(round_half_even(v), -127.0), 127.0)
    else:
        return round_to_e4m3(v)


@triton.jit
def decode_e4m3_bytes(b):
    """float8_e4m3fn bit patterns (uint8) -> float16 values of 1/256 of theirs, exactly (sign, then
    exponent and mantissa moved into float16's fields: float16's bias is 8 more than e4m3's, and
    e4m3's subnormals land on float16's). The caller multiplies by 256 (FP8_BYTES_FACTOR) in its scale."""
    h = ((b & 0x80).to(tl.uint16) << 8) | ((b & 0x7F).to(tl.uint16) << 7)
    return h.to(tl.float16, bitcast=True)


FP8_BYTES_FACTOR = 256.0


@triton.jit
def _quantize_groups_kernel(q_ptr, s_ptr, x_ptr, K, group, num_groups, stride_xm, stride_xk,
                            KIND: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, group): the group's max |x|, its scale, then its values quantized."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(start + group, K)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(start, end, BLOCK):
        k = k0 + cols
        x = tl.load(x_ptr + row * stride_xm + k * stride_xk, mask=k < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = group_scale(tl.max(amax, axis=0), QMAX)
    tl.store(s_ptr + row * num_groups + g, scale)
    for k0 in range(start, end, BLOCK):
        k = k0 + cols
        x = tl.load(x_ptr + row * stride_xm + k * stride_xk, mask=k < end, other=0.0).to(tl.float32)
        q = quantize_tile(x, scale, KIND)
        tl.store(q_ptr + row * K + k, q.to(q_ptr.dtype.element_ty), mask=k < end)


def quantize_groups(x: torch.Tensor, group: int, kind: str, carrier: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any strides) -> (q [M, K] contiguous in ``carrier``, scales float32 [M, ceil(K / group)]).

    kind "int8" (carrier int8) or "fp8" (carrier float8_e4m3fn, or float16, which holds every e4m3
    value exactly, for targets without FP8 types); q * s is the value the quantized product sees."""
    if kind not in ("int8", "fp8"):
        raise ValueError(f"quantize_groups: kind {kind!r} is not 'int8' or 'fp8'")
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=carrier, device=x.device)
    scales = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(pow2(group), 1024)
        _quantize_groups_kernel[(m, num_groups)](
            q, scales, x, k, group, num_groups, x.stride(0), x.stride(1), KIND=kind,
            QMAX=INT8_MAX if kind == "int8" else FP8_MAX, BLOCK=block, num_warps=max(1, min(8, block // 256)))
    return q, scales
