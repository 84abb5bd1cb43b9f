"""The norms of the op contract (``chitu_core.ops.spec``) in one Triton kernel: rms_norm and
fused_add_rms_norm, and (contract 1.6) offset_rms_norm, fused_add_offset_rms_norm and layer_norm.

One program normalises one row held whole in registers, in float32, and rounds once: the row times
1/rms times weight (Llama), times 1 + weight (the offset, Gemma's, convention), or centred, times
weight, plus bias (LayerNorm). transformers' Llama norm rounds the normalised row to x.dtype before
the weight; rounding once is closer to float32 (plugins/nvidia/scripts/models_check.py compares a
model's bfloat16 logits with float32's). The fused variants normalise x + residual as summed in
float32, and write that sum, rounded to x.dtype, as their second output.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import as_row_grid, pow2
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options

MAX_HIDDEN = 65536  # one row per program, in registers


@triton.jit
def _rms_norm_kernel(
    out_ptr, sum_ptr, x_ptr, res_ptr, w_ptr, b_ptr, H, eps, x_inner, r_inner,
    stride_x_outer, stride_x_row, stride_x_col, stride_r_outer, stride_r_row, stride_r_col, stride_w, stride_b,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # MODE 0: Llama's RMSNorm, 1: the offset RMSNorm, 2: LayerNorm. x, residual: [outer, inner, H] views.
    gdc_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x_at = (row // x_inner) * stride_x_outer + (row % x_inner) * stride_x_row
    x = tl.load(x_ptr + x_at + cols * stride_x_col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_at = (row // r_inner) * stride_r_outer + (row % r_inner) * stride_r_row
        r = tl.load(res_ptr + r_at + cols * stride_r_col, mask=mask, other=0.0)
        xf = x.to(tl.float32) + r.to(tl.float32)
        tl.store(sum_ptr + row * H + cols, xf.to(sum_ptr.dtype.element_ty), mask=mask)
    else:
        xf = x.to(tl.float32)
    if MODE == 2:
        xf = tl.where(mask, xf - tl.sum(xf, axis=0) / H, 0.0)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    if MODE == 0:
        y = xf * rstd * w
    elif MODE == 1:
        y = xf * rstd * (1.0 + w)
    else:
        y = xf * rstd * w
        if HAS_BIAS:
            y += tl.load(b_ptr + cols * stride_b, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, mode: int = 0,
            bias: torch.Tensor | None = None):
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {hidden} is over this kernel's {MAX_HIDDEN}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    rows = as_row_grid(x)  # a per-head slice of a fused projection ([T, heads, D], the q/k norms) is read in place
    res = as_row_grid(residual) if residual is not None else rows
    if out.numel():
        block = pow2(hidden)
        b = weight if bias is None else bias
        _rms_norm_kernel[(out.numel() // hidden,)](
            out, total, rows, res, weight, b, hidden, eps, rows.shape[1], res.shape[1],
            *rows.stride(), *res.stride(), weight.stride(0), b.stride(0),
            BLOCK=block, HAS_RESIDUAL=residual is not None, MODE=mode, HAS_BIAS=bias is not None,
            num_warps=min(16, max(1, block // 512)), **pdl_options(x.device),
        )
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps, mode=1)[0]


def fused_add_offset_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps, mode=1)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps, mode=2, bias=bias)[0]
