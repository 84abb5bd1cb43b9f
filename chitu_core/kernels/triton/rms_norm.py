"""rms_norm and fused_add_rms_norm of the op contract (``chitu_core.ops.spec``) in one Triton kernel.

One program normalises one row held whole in registers: the statistics in float32,
the normalised row rounded to x.dtype, then multiplied by weight (the Llama
convention); the fused variant first rounds x + residual to x.dtype, as an
unfused add would, and writes that sum as its second output.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import as_rows, pow2

MAX_HIDDEN = 65536  # one row per program, in registers


@triton.jit
def _rms_norm_kernel(
    out_ptr, sum_ptr, x_ptr, res_ptr, w_ptr, H, eps,
    stride_x_row, stride_x_col, stride_r_row, stride_r_col, stride_w,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x_row + cols * stride_x_col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r_row + cols * stride_r_col, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * H + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {hidden} is over this kernel's {MAX_HIDDEN}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    rows = as_rows(x)
    res = as_rows(residual) if residual is not None else rows
    if rows.shape[0]:
        block = pow2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            out, total, rows, res, weight, hidden, eps,
            rows.stride(0), rows.stride(1), res.stride(0), res.stride(1), weight.stride(0),
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 512)),
        )
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)
