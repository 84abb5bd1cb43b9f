"""The NVIDIA backend's ops over the portable Triton ones (``TritonBackend.native_ops``).

linear goes to cuBLAS, or to cuBLASLt for the batch sizes where its kernels are faster, or at batch 1
with an output of up to ``MAX_GEMV_N`` to the Triton matrix-vector kernel. Before
Ada/Hopper (compute capability 8.9) there are no FP8 types, so the FP8 linears and experts decode the
bytes in registers. Sampling filters and penalties stay reference fallbacks until on-device sampling
kernels land.
"""

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

LT_ROWS = (32, 64)
"""Rows (tokens) for which ``linear`` asks PyTorch for cuBLASLt: on an H200, bf16 Llama-3.1-8B
decode shapes (scripts/gemm_layouts.py rows), cuBLASLt is as fast or faster for 32-64 rows
(at 64: gate_up 59.5 -> 56.8 us, down 34.9 -> 31.3 us) and slower at 16 (down) and at 128
(down, LM head); elsewhere they tie. Graph capture records the choice, so replays pay nothing."""

MAX_GEMV_N = int(os.environ.get("CHITU_GEMV_MAX_N", 4096))
"""Widest output ``linear`` sends to the Triton matrix-vector kernel at batch 1 (``dense_gemv_config``);
CHITU_GEMV_MAX_N sets another (to compare). On an H100 (plugins/nvidia/scripts/dense_gemv_sweep.py,
SEARCH=0) the kernel beat cuBLAS on every bf16 decode shape of SmolLM2-135M, Qwen3-1.7B, Llama-3.1-8B,
Qwen3-30B-A3B and DeepSeek-V2-Lite up to 4096 outputs (Llama-3.1-8B down 52.6 -> 45.7 us, SmolLM2's
576 x 576 3.6 -> 1.7 us); wider (5632, the LM heads, 28672) cuBLAS was faster or tied."""
_dense_gemv: Callable | None = None  # bound by nvidia_ops(), which runs only where triton is installed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // max(1, x.shape[-1])
    if rows == 1 and weight.shape[0] <= MAX_GEMV_N and x.dtype == weight.dtype and _dense_gemv is not None:
        return _dense_gemv(x, weight, bias)  # batch 1: every projection but the widest and the LM head
    if not LT_ROWS[0] <= rows <= LT_ROWS[1]:
        return F.linear(x, weight, bias)
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight, bias)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def nvidia_ops() -> dict[str, Callable]:
    """Called only where triton is installed (``TritonBackend.native_ops``)."""
    global _dense_gemv
    from chitu_core.kernels.triton import pdl
    from chitu_core.kernels.triton.dense_gemv import dense_gemv

    _dense_gemv = dense_gemv
    pdl.allow()  # Hopper and newer: the decode path's kernels launch dependent (pdl.pdl_launch checks the device)
    ops: dict[str, Callable] = {"linear": linear}
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        from chitu_core.kernels.triton.fp8_linear import fp8_linear_bytes
        from chitu_core.kernels.triton.moe_fp8 import fused_experts_fp8_bytes

        ops["fp8_linear"] = fp8_linear_bytes
        ops["fused_experts_fp8"] = fused_experts_fp8_bytes
    return ops
