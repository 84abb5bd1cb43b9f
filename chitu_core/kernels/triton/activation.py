"""silu_and_mul and gelu_and_mul of the op contract (``chitu_core.ops.spec``) in one Triton kernel.

x: [..., 2I] -> act(x[..., :I]) * x[..., I:], computed in float32 and rounded once
to x.dtype. A program covers BLOCK columns of one row.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import as_rows, pow2
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options

SQRT_HALF = tl.constexpr(0.7071067811865476)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def act_and_mul(gate, up, ACT: tl.constexpr):
    """act(gate) * up in float32, ACT "silu", "gelu" (erf) or "gelu_tanh": this kernel's, and the epilogue
    of the products that end in a gated activation (fused_experts' gate/up, fused_gemv's)."""
    if ACT == "silu":
        act = gate * tl.sigmoid(gate)
    elif ACT == "gelu":
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * SQRT_HALF))
    else:  # gelu, tanh approximation; tanh(y) = 2 sigmoid(2y) - 1
        y = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * y)
    return act * up


@triton.jit
def _act_and_mul_kernel(out_ptr, x_ptr, inter, stride_row, stride_col, BLOCK: tl.constexpr, ACT: tl.constexpr,
                        PDL: tl.constexpr):
    gdc_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    base = x_ptr + row * stride_row
    gate = tl.load(base + cols * stride_col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + (cols + inter) * stride_col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, act_and_mul(gate, up, ACT).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    rows = as_rows(x)
    if rows.shape[0] and inter:
        block = min(pow2(inter), 1024)
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _act_and_mul_kernel[grid](out, rows, inter, rows.stride(0), rows.stride(1), BLOCK=block, ACT=act,
                                  num_warps=max(1, min(4, block // 256)), **pdl_options(x.device))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, "silu")


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu_and_mul: approximate must be 'none' or 'tanh', not {approximate!r}")
    return _act_and_mul(x, "gelu" if approximate == "none" else "gelu_tanh")
