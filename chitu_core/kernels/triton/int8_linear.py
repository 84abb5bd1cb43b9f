"""``int8_linear`` of the op contract (``chitu_core.ops.spec``): int8 weights with a float32 scale per
output channel; x in 16 bits (W8A16: the weight converted in registers) or, with ``act_quant`` (W8A8),
quantized per token to int8 and multiplied as integers (exact int32 sums), scaled once at the end.

The matmul is ``quant_matmul`` (decode: split-K matrix-vector products; larger M: int8 tl.dot tiles
after a per-token quantization pass); tiles in ``quant_matmul.matmul_config``.
"""

import torch

from chitu_core.kernels.triton.quant_matmul import MatmulConfig, quant_matmul


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, act_quant: bool,
                bias: torch.Tensor | None, config: MatmulConfig | None = None) -> torch.Tensor:
    """x [..., K] @ (weight int8 [N, K] * scales[:, None]).T + bias -> [..., N] in x.dtype (see the spec)."""
    n = weight.shape[0]
    if weight.dtype != torch.int8:
        raise ValueError(f"int8_linear: weight must be int8, got {weight.dtype}")
    if tuple(scales.shape) != (n,) or scales.dtype != torch.float32:
        raise ValueError(f"int8_linear: scales must be float32 [{n}], got {scales.dtype} {list(scales.shape)}")
    return quant_matmul(x, weight, scales, bias, w_kind="int8", act_quant="int8" if act_quant else None,
                        block_size=None, config=config)
