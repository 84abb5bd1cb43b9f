"""``fp8_linear`` of the op contract (``chitu_core.ops.spec``): FP8 e4m3 weights with per-channel or
block scales, x in 16 bits (soft FP8) or quantized dynamically to FP8 per token group (``act_quant``).

Two entry points, the same contract: ``fp8_linear`` reads the weight as float8_e4m3fn, for Triton
targets that have that type (NVIDIA compute capability 8.9 and newer: there, with ``act_quant``, the
GEMM multiplies FP8 by FP8 on the tensor cores); ``fp8_linear_bytes`` reads the same weight as bytes
and decodes them in registers, for targets without FP8 types (compute capability 8.0/8.6, and other
Triton ports): its quantized activations are float16 numbers of e4m3 values, multiplied in float16
with the exact products the FP8 ones would have. A backend registers whichever suits its device.

The matmul itself is ``quant_matmul``: a matrix-vector path with split K for decode (M <= 16) that
reads each weight byte once, and tl.dot GEMM tiles beyond; tiles in ``quant_matmul.matmul_config``.
"""

import torch

from chitu_core.kernels.triton.quant_matmul import MatmulConfig, quant_matmul


def check_operands(weight: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int] | None) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    n, k = weight.shape
    expected = (n,) if block_size is None else (-(-n // block_size[0]), -(-k // block_size[1]))
    if tuple(scales.shape) != expected or scales.dtype != torch.float32:
        raise ValueError(f"fp8_linear: scales must be float32 {list(expected)} for a [{n}, {k}] weight with "
                         f"block_size {block_size}, got {scales.dtype} {list(scales.shape)}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int] | None,
               act_quant: bool, bias: torch.Tensor | None, config: MatmulConfig | None = None) -> torch.Tensor:
    """x [..., K] @ (weight float8_e4m3fn [N, K] * scales).T + bias -> [..., N] in x.dtype (see the spec)."""
    check_operands(weight, scales, block_size)
    return quant_matmul(x, weight, scales, bias, w_kind="fp8", act_quant="fp8" if act_quant else None,
                        block_size=tuple(block_size) if block_size is not None else None, config=config)


def fp8_linear_bytes(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                     block_size: tuple[int, int] | None, act_quant: bool, bias: torch.Tensor | None,
                     config: MatmulConfig | None = None) -> torch.Tensor:
    """``fp8_linear`` for Triton targets without FP8 types: the weight's bytes decoded in registers."""
    check_operands(weight, scales, block_size)
    return quant_matmul(x, weight, scales, bias, w_kind="fp8_bytes", act_quant="fp8" if act_quant else None,
                        block_size=tuple(block_size) if block_size is not None else None, config=config)
