"""Native CPU ops: fused where PyTorch offers it. Ops absent from NATIVE_OPS fall back to the reference."""

import torch
import torch.nn.functional as F

from chitu_core.ops import reference
from chitu_cpu.moe import fused_experts, fused_experts_fp8

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """In float32, times weight, rounded once (as the Triton kernel: closer to float32 than rounding
    the normalised row before the weight, as transformers' Llama norm does)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The norm of x + residual as summed in float32; the sum returned rounded to x.dtype (no casts where x
    is float32: ``float()`` and ``to`` return the tensor itself)."""
    total = x.float() + residual.float()
    return rms_norm(total, weight, eps).to(x.dtype), total.to(x.dtype)


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + weight.float())).to(x.dtype)


def fused_add_offset_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = x + residual
    return offset_rms_norm(total, weight, eps), total


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps).to(x.dtype)


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> tuple[Tensor, Tensor]:
    # One pass over queries and keys together: [T, Hq + Hk, D].
    hq, rot = q.shape[1], cos_sin_cache.shape[-1]
    qk = torch.cat((q, k), dim=1)
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    x = qk[..., :rot].float()
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    out = torch.cat((rotated.to(qk.dtype), qk[..., rot:]), dim=-1)
    return out[:, :hq], out[:, hq:]


def silu_and_mul(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


def rms_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                    activation: str | None = None) -> Tensor:
    """Contract 1.9, as the unfused ops compute it (inductor fuses the elementwise parts)."""
    y = linear(rms_norm(x, norm_weight, eps), weight, bias)
    if activation is None:
        return y
    return silu_and_mul(y) if activation == "silu" else reference.rms_norm_linear_gated(y, activation)


def linear_add(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    """Contract 1.9: the BLAS adds the residual to its sums (one rounding)."""
    if bias is None and x.dim() == 2 and residual.dim() == 2:
        return torch.addmm(residual, x, weight.t())
    return residual + linear(x, weight, bias)


def mla_inputs(q: Tensor, kv: Tensor, w_uk: Tensor, kv_norm_weight: Tensor, eps: float, positions: Tensor,
               cos_sin_cache: Tensor, is_neox: bool) -> tuple[Tensor, Tensor]:
    """Contract 1.10, as the MLA layer's unfused ops compute it: the reference's composition (the rotary, one
    batched product over the heads, the norm, two concatenations) of this backend's rotary and norm."""
    return reference.mla_inputs(q, kv, w_uk, kv_norm_weight, eps, positions, cos_sin_cache, is_neox,
                                rotary=rotary_embedding, norm=rms_norm)


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return F.embedding(ids, weight)


def greedy_sample(logits: Tensor) -> Tensor:
    return torch.argmax(logits, dim=-1)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    # Same semantics as the reference; sorts ascending so the kept set is a suffix.
    vocab = logits.shape[-1]
    logits = logits.float()
    sorted_logits, order = logits.sort(dim=-1)
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    kth = sorted_logits.gather(1, (vocab - k)[:, None])
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_after = probs.flip(-1).cumsum(-1).flip(-1) - probs  # mass of strictly better-ranked tokens
    # p = 1 keeps everything, though the float sum may reach 1 before the last token.
    drop = (mass_after >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_penalties(
    logits: Tensor, prompt_mask: Tensor, output_counts: Tensor, repetition: Tensor, frequency: Tensor, presence: Tensor
) -> Tensor:
    # One [B, V] factor (the repetition penalty where the token was seen, 1 elsewhere), then the
    # frequency and presence terms as two fused multiply-subtracts.
    in_output = output_counts > 0
    factor = torch.where(prompt_mask | in_output, repetition[:, None], 1.0)
    x = logits.float()
    x = torch.where(x > 0, x / factor, x * factor)
    x = torch.addcmul(x, output_counts.float(), frequency[:, None], value=-1.0)
    return torch.addcmul(x, in_output.float(), presence[:, None], value=-1.0)


def log_softmax(logits: Tensor) -> Tensor:
    return F.log_softmax(logits.float(), dim=-1)


NATIVE_OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "offset_rms_norm": offset_rms_norm,  # contract 1.6
    "fused_add_offset_rms_norm": fused_add_offset_rms_norm,
    "layer_norm": layer_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "linear": linear,
    "rms_norm_linear": rms_norm_linear,  # contract 1.9
    "linear_add": linear_add,
    "mla_inputs": mla_inputs,  # contract 1.10
    "linear_float32": reference.linear_float32,  # contract 1.11: x widened, then F.linear (no cast where x is float32)
    "embedding": embedding,
    "greedy_sample": greedy_sample,
    "apply_top_k_top_p": apply_top_k_top_p,
    "apply_penalties": apply_penalties,
    "log_softmax": log_softmax,
    "moe_route": reference.moe_route,  # whole-tensor ops in float32 already: what the CPU would run
    "fused_experts": fused_experts,
    "fused_experts_fp8": fused_experts_fp8,
}
