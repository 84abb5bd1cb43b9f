"""The second pass of split-K matmuls: float32 partial sums added in a fixed order (deterministic, no
atomics), the bias added once, the result cast to the output's dtype."""

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["total"])
def _sum_splits_kernel(out, parts, bias, total, N, splits, stride_b, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(parts + s * total + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + (i % N) * stride_b, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + i, acc.to(out.dtype.element_ty), mask=ok)


def sum_splits(parts: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out [M, N] (contiguous) = sum over s, in order, of parts [S, M, N] (float32, contiguous), + bias [N]."""
    total, n = out.numel(), out.shape[-1]
    block = 1024
    _sum_splits_kernel[(triton.cdiv(total, block),)](
        out, parts, bias if bias is not None else out, total, n, parts.shape[0],
        bias.stride(0) if bias is not None else 0, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
