"""``int8_linear`` of the op contract (contract 1.2) on torch_npu's quantized matmuls.

W8A8 (``act_quant``): each row of x is quantized here, symmetrically to int8 as the contract fixes it (a few
elementwise ops on the device), and ``npu_quant_matmul`` multiplies int8 by int8 with the per-channel and
per-token scales applied to the int32 products. W8A16: ``npu_weight_quant_batchmatmul`` dequantizes the
int8 weight inside the matmul. Both take float16/bfloat16 activations only; float32 activations run the
core's reference. The other quantized linears (int4, fp8, gguf) fall back to the reference: int4 would
need AWQ/GPTQ weights repacked at load into torch_npu's signed int4 packing, which the core's methods do
not ask a backend for yet.
"""

import torch

from chitu_core.ops import reference

Tensor = torch.Tensor
NPU_MATMUL_DTYPES = (torch.float16, torch.bfloat16)


def _quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """int8 rows and their float32 scales [M]: s = max|row| / 127 (1 for an all-zero row), q = round-half-even."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(xf / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor, act_quant: bool, bias: Tensor | None) -> Tensor:
    """x [..., K] @ (weight int8 [N, K] * scales [N]).T (+ bias), see ``chitu_core.ops.spec``.

    act_quant: ``torch_npu.npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
    output_dtype=None)``. Doc: torch_npu API reference, "torch_npu.npu_quant_matmul" (Pytorch 7.0.0,
    ptaoplist_000172): x1 int8 [M, K], x2 int8 [K, N], scale float32 [N] per output channel,
    pertoken_scale float32 [M] per row of x1; output_dtype float16/bfloat16 gives
    (x1 @ x2) * scale * pertoken_scale in that dtype. The bias is added here, in float32.

    otherwise: ``torch_npu.npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None,
    quant_scale=None, quant_offset=None, bias=None, antiquant_group_size=0)``. Doc: torch_npu API
    reference (Pytorch 7.0.0, ptaoplist_000179): x float16/bfloat16 [M, K], weight int8 [K, N] (a
    transposed view is allowed and recommended per channel), antiquant_scale [N] in x's dtype;
    y = x @ (weight * antiquant_scale) + bias, bias float16 or float32 [N]."""
    if x.dtype not in NPU_MATMUL_DTYPES:
        return reference.int8_linear(x, weight, scales, act_quant, bias)
    import torch_npu

    rows = x.reshape(-1, x.shape[-1])
    if act_quant:
        q, row_scales = _quantize_rows(rows)
        out = torch_npu.npu_quant_matmul(q, weight.T, scales.float(), pertoken_scale=row_scales,
                                         output_dtype=x.dtype)
        if bias is not None:
            out = (out.float() + bias.float()).to(x.dtype)
    else:
        b = None if bias is None else bias.float()  # the doc's bias dtypes: float16 or float32
        out = torch_npu.npu_weight_quant_batchmatmul(rows, weight.T, scales.to(x.dtype), bias=b)
    return out.reshape(*x.shape[:-1], weight.shape[0])
