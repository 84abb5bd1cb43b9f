"""STAND-IN for torch_npu, for tests only: NOT Huawei's torch_npu, and nothing here runs on an NPU.

It makes ``import torch_npu`` and ``torch.npu`` work on a machine without CANN, so that chitu-ascend's op
mapping runs in CI on CPU tensors. Each operator below implements the semantics its torch_npu API reference
page documents (the page is named in its docstring): argument order, shapes, layouts, dtypes it accepts,
and what it leaves undefined (filled with NaN here, so that a caller relying on it fails). It was written
from those pages, not from chitu's ops, and it is deliberately strict: an argument outside the documented
layout raises. It proves the mapping's arguments, not the NPU's numerics or speed.
"""

import torch

from torch_npu import npu
from torch_npu.attention import npu_fused_infer_attention_score  # noqa: F401  (re-exported)

__version__ = "0.0+standin"
IS_STANDIN = True
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
npu.install()

Tensor = torch.Tensor


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"torch_npu stand-in: {what} (outside the operator's documented arguments)")


def npu_rms_norm(self: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Doc: "(beta) torch_npu.npu_rms_norm": y = x / sqrt(mean(x^2) + eps) * gamma; gamma of x's dtype;
    returns (y, rstd), rstd float32."""
    _require(self.dtype in FLOAT_DTYPES and gamma.dtype == self.dtype, "self and gamma of one float dtype")
    xf = self.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(self.dtype), rstd


def npu_add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """Doc: op-plugin test_npu_add_rms_norm: x = x1 + x2 (in the dtype), y = rms_norm(x) * gamma; (y, rstd, x)."""
    _require(x1.dtype == x2.dtype == gamma.dtype, "x1, x2 and gamma of one dtype")
    total = x1 + x2
    y, rstd = npu_rms_norm(total, gamma, epsilon)
    return y, rstd, total


def npu_rotary_mul(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> Tensor:
    """Doc: "torch_npu.npu_rotary_mul": 4-D input, r1 (cos) and r2 (sin) broadcast to it; output =
    r1 * input + r2 * rotate(input); "half": rotate = cat(-x2, x1) of the halves; "interleave": pairs
    (2i, 2i+1) become (-x[2i+1], x[2i])."""
    _require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "input, r1, r2 4-D")
    _require(input.dtype == r1.dtype == r2.dtype, "input, r1, r2 of one dtype")
    _require(input.shape[-1] % 2 == 0 and r1.shape[-1] == input.shape[-1], "an even D shared by r1, r2")
    if rotary_mode == "half":
        x1, x2 = input.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-input[..., 1::2], input[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise RuntimeError(f"torch_npu stand-in: rotary_mode {rotary_mode!r} is not 'half' or 'interleave'")
    return r1 * input + r2 * rotated


def npu_swiglu(input: Tensor, dim: int = -1) -> Tensor:
    """Doc: "(beta) torch_npu.npu_swiglu": A, B the halves of input along dim; A * sigmoid(A) * B in input's
    dtype; the input must be contiguous."""
    _require(input.is_contiguous(), "a contiguous input")
    a, b = input.float().chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(input.dtype)


def npu_scatter_nd_update_(input: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
    """Doc: "torch_npu.npu_scatter_nd_update_": in place input[indices[i]] = updates[i]; indices int32/int64,
    at least 2-D, last dim a <= input.dim(); updates.shape == indices.shape[:-1] + input.shape[a:]; indices
    must not be out of range (negative ones are out of range here)."""
    _require(indices.dtype in (torch.int32, torch.int64) and indices.dim() >= 2, "int indices of 2+ dims")
    a = indices.shape[-1]
    _require(tuple(updates.shape) == tuple(indices.shape[:-1]) + tuple(input.shape[a:]), "updates of indices' shape")
    _require(updates.dtype == input.dtype, "updates of input's dtype")
    bounds = torch.tensor(input.shape[:a])
    _require(bool(((indices >= 0) & (indices < bounds)).all()), "indices in range")
    input[tuple(indices.long().unbind(-1))] = updates
    return input


def npu_moe_gating_top_k_softmax(x: Tensor, finished: Tensor | None = None, k: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """Doc: "torch_npu.npu_moe_gating_top_k_softmax": y, expert_idx = topk(softmax(x, -1), k), y in x's
    dtype, expert_idx int32; rows whose finished is True get expert id E; row_idx int32 =
    arange(T * k).reshape(k, T).T."""
    _require(x.dim() == 2 and 0 < k <= min(x.shape[-1], 1024), "2-D x and 0 < k <= E")
    y, idx = x.float().softmax(-1).topk(k, dim=-1)
    if finished is not None:
        idx = torch.where(finished[:, None], x.shape[-1], idx)
    rows = torch.arange(x.shape[0] * k, dtype=torch.int32).reshape(k, x.shape[0]).T
    return y.to(x.dtype), idx.to(torch.int32), rows


def npu_grouped_matmul(x: list[Tensor], weight: list[Tensor], *, bias=None, scale=None, offset=None,
                       antiquant_scale=None, antiquant_offset=None, per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None, activation_quant_offset=None,
                       split_item: int = 0, group_type: int = -1, group_list_type: int = 0, act_type: int = 0,
                       output_dtype=None) -> list[Tensor]:
    """Doc: "torch_npu.npu_grouped_matmul" (7.0.0). Only the unquantized single-x case chitu uses: x [M, K],
    weight one [E, K, N] tensor, group_type 0 (split M), split_item 2 or 3 (one output), group_list an
    int64 tensor of cumulative ends (group_list_type 0) or counts (1). Rows in no group are undefined: NaN."""
    _require(len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3, "one x and one 3-D weight")
    _require(group_type == 0 and split_item in (2, 3) and group_list_type in (0, 1), "group_type 0, split_item 2|3")
    _require(all(t is None for t in (bias, scale, offset, antiquant_scale, per_token_scale)), "no quantization")
    _require(isinstance(group_list, Tensor) and group_list.dtype == torch.int64, "an int64 group_list tensor")
    rows, w = x[0], weight[0]
    _require(rows.dim() == 2 and w.shape[1] == rows.shape[1] and group_list.numel() == w.shape[0], "[M, K] @ [E, K, N]")
    ends = group_list.cumsum(0) if group_list_type == 1 else group_list
    out = torch.full((rows.shape[0], w.shape[2]), float("nan"), dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = rows[start:end].float() @ w[e].float()
        start = end
    return [out.to(rows.dtype)]


def npu_quant_matmul(x1: Tensor, x2: Tensor, scale: Tensor, *, offset=None, pertoken_scale=None, bias=None,
                     output_dtype=None) -> Tensor:
    """Doc: "torch_npu.npu_quant_matmul": x1 int8 [M, K] @ x2 int8 [K, N] in int32, times scale (float32 [N]
    or [1]) and pertoken_scale (float32 [M]), in output_dtype (float16/bfloat16 here; int8 output is
    not implemented by the stand-in)."""
    _require(x1.dtype == x2.dtype == torch.int8 and x1.dim() == 2 and x2.shape[0] == x1.shape[1], "int8 [M, K] @ [K, N]")
    _require(output_dtype in HALF_DTYPES and scale.dtype == torch.float32, "float32 scale, 16-bit output_dtype")
    _require(offset is None and bias is None, "no offset or bias (the stand-in leaves them out)")
    out = (x1.to(torch.int64) @ x2.to(torch.int64)).to(torch.float64) * scale.double()
    if pertoken_scale is not None:
        _require(pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == (x1.shape[0],), "float32 [M]")
        out = out * pertoken_scale.double()[:, None]
    return out.to(output_dtype)


def npu_weight_quant_batchmatmul(x: Tensor, weight: Tensor, antiquant_scale: Tensor, antiquant_offset=None,
                                 quant_scale=None, quant_offset=None, bias=None, antiquant_group_size: int = 0,
                                 inner_precise: int = 0) -> Tensor:
    """Doc: "torch_npu.npu_weight_quant_batchmatmul": x float16/bfloat16 [M, K]; weight int8 [K, N];
    antiquant_scale [N] or [1, N] of x's dtype (per channel); y = x @ ((weight + offset) * scale) + bias,
    bias float16/float32 [N]; output in x's dtype."""
    _require(x.dtype in HALF_DTYPES and weight.dtype == torch.int8 and x.shape[-1] == weight.shape[0], "[M, K] @ int8 [K, N]")
    _require(antiquant_scale.dtype == x.dtype and antiquant_scale.numel() == weight.shape[1], "scale [N] of x's dtype")
    _require(quant_scale is None and antiquant_group_size == 0, "per-channel, no output quantization")
    w = weight.float() if antiquant_offset is None else weight.float() + antiquant_offset.float().reshape(1, -1)
    out = x.float() @ (w * antiquant_scale.float().reshape(1, -1))
    if bias is not None:
        _require(bias.dtype in (torch.float16, torch.float32), "bias float16 or float32")
        out = out + bias.float()
    return out.to(x.dtype)
