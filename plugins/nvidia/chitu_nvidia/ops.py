"""Native ops of the NVIDIA backend: the portable Triton kernels (``chitu_core.kernels.triton``)
where the contract has one, PyTorch's CUDA kernels for the rest that are worth it here.

linear goes to cuBLAS, or to cuBLASLt for the batch sizes where its kernels are faster;
log_softmax is the reference's own PyTorch call, already the vendor kernel on CUDA tensors. greedy_sample is the Triton
two-pass argmax (torch's gives each row to one block: 28 us for 128256 logits on an H200); moe_route,
fused_experts and fused_experts_fp8 are the Triton MoE kernels. Sampling
filters and penalties stay reference fallbacks until on-device sampling kernels land.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from chitu_core.ops import reference


LT_ROWS = (32, 64)
"""Rows (tokens) for which ``linear`` asks PyTorch for cuBLASLt: on an H200, bf16 Llama-3.1-8B
decode shapes (scripts/gemm_layouts.py rows), cuBLASLt is as fast or faster for 32-64 rows
(at 64: gate_up 59.5 -> 56.8 us, down 34.9 -> 31.3 us) and slower at 16 (down) and at 128
(down, LM head); elsewhere they tie. Graph capture records the choice, so replays pay nothing."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // max(1, x.shape[-1])
    if not LT_ROWS[0] <= rows <= LT_ROWS[1]:
        return F.linear(x, weight, bias)
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight, bias)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


TORCH_OPS: dict[str, Callable] = {
    "linear": linear,
    "embedding": embedding,
    "log_softmax": reference.log_softmax,
}


def native_ops(with_triton: bool) -> dict[str, Callable]:
    """The op table; without triton installed, only the PyTorch ops (the backend is unavailable then)."""
    if not with_triton:
        return dict(TORCH_OPS)
    from chitu_core.kernels.triton.fp8_linear import fp8_linear_bytes
    from chitu_core.kernels.triton.moe_fp8 import fused_experts_fp8_bytes
    from chitu_core.kernels.triton.ops import TRITON_OPS

    ops = {**TORCH_OPS, **TRITON_OPS}
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        # no FP8 types before Ada/Hopper: the bytes are decoded in registers
        ops["fp8_linear"] = fp8_linear_bytes
        ops["fused_experts_fp8"] = fused_experts_fp8_bytes
    return ops
