"""The dense ops of the op contract (``chitu_core.ops.spec``) mapped to torch_npu's fused operators.

Each mapping's docstring names the operator, the page of the torch_npu API reference it follows
(Ascend Extension for PyTorch, "torch_npu custom API" list, hiascend.com), and the argument layout it
relies on. torch_npu is imported inside each op: importing this module never needs it. The MoE ops are
in ``chitu_ascend.moe``, the quantized linears in ``chitu_ascend.quant``.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)``.

    Doc: torch_npu API reference, "(beta) torch_npu.npu_rms_norm" (Pytorch 7.0.0, ptaoplist_000860):
    self float16/bfloat16/float32 of 2-8 dims, gamma of self's dtype over its last dimension; output 0 is
    gamma * self / sqrt(mean(self^2) + epsilon), output 1 the reciprocal RMS (kept for training; unused)."""
    import torch_npu

    return torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x)``.

    Doc: op-plugin's npu_add_rms_norm (test/test_custom_ops/test_npu_add_rms_norm.py, the reference it is
    checked against): x = x1 + x2 in the inputs' dtype, y = rms_norm(x) * gamma, rstd the reciprocal RMS.
    The contract's pair is (y, x); x1 and x2 are the layer output and the residual, in either order."""
    import torch_npu

    y, _, total = torch_npu.npu_add_rms_norm(x, residual, weight.to(x.dtype), epsilon=eps)
    return y, total


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor,
                     is_neox: bool) -> tuple[Tensor, Tensor]:
    """``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor``.

    Doc: torch_npu API reference, "torch_npu.npu_rotary_mul" (Pytorch 7.0.0, ptaoplist_000141; op-plugin
    docs/context/torch_npu-npu_rotary_mul.md): output = r1 * input + r2 * rotate(input), r1 the cosines,
    r2 the sines, all 4-D; rotary_mode "half" rotates cat(-x2, x1) of the two halves (GPT-NeoX),
    "interleave" the pairs (2i, 2i+1) (GPT-J). Queries and keys go in one call as BSND ([1, T, Hq + Hk, R]),
    with r1, r2 as 1S1D ([1, T, 1, R]): the cache's R/2 cosines (sines) repeated over both halves, or
    each repeated twice in place for interleave. Computed in float32, as the contract asks; the channels
    past the rotary dimension R pass through."""
    import torch_npu

    hq, rot = q.shape[1], cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions).float().chunk(2, dim=-1)  # [T, R/2] each
    if is_neox:
        r1, r2, mode = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), "half"
    else:
        r1, r2, mode = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), "interleave"
    heads = torch.cat((q[..., :rot], k[..., :rot]), dim=1).float()[None]  # [1, T, Hq + Hk, R]
    rotated = torch_npu.npu_rotary_mul(heads, r1[None, :, None], r2[None, :, None], rotary_mode=mode)[0]
    q_out = torch.cat((rotated[:, :hq].to(q.dtype), q[..., rot:]), dim=-1)
    k_out = torch.cat((rotated[:, hq:].to(k.dtype), k[..., rot:]), dim=-1)
    return q_out, k_out


def silu_and_mul(x: Tensor) -> Tensor:
    """``torch_npu.npu_swiglu(input, dim=-1) -> Tensor``.

    Doc: torch_npu API reference, "(beta) torch_npu.npu_swiglu" (Pytorch 6.0.0, ptaoplist_000834):
    input split in halves A, B along dim; output A * sigmoid(A) * B in input's dtype. The input must be
    contiguous (the doc's constraint), so a strided view is copied first."""
    import torch_npu

    return torch_npu.npu_swiglu(x.contiguous(), dim=-1)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """PyTorch's linear, which torch_npu dispatches to the NPU's matrix unit (no custom operator)."""
    return F.linear(x, weight, bias)


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """PyTorch's embedding, served by torch_npu's kernel for aten::embedding (no custom operator)."""
    return F.embedding(ids, weight)


def native_ops() -> dict[str, Callable]:
    """Every op this backend maps; the rest of ``chitu_core.ops.OP_NAMES`` falls back to the reference."""
    from chitu_ascend.moe import fused_experts, moe_route
    from chitu_ascend.quant import int8_linear

    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "silu_and_mul": silu_and_mul,
        "linear": linear,
        "embedding": embedding,
        "moe_route": moe_route,
        "fused_experts": fused_experts,
        "int8_linear": int8_linear,
    }
