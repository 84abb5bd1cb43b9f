"""The reference implementation of every op in ``spec``: plain PyTorch, any device, any dtype.

It is the oracle of the conformance suite (run there in float64) and the
fallback for ops a backend does not implement. Clarity over speed.
"""

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.to(_acc_dtype(x))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = x + residual
    return rms_norm(total, weight, eps), total


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:  # contract 1.6
    xf = x.to(_acc_dtype(x))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1 + weight.to(xf.dtype))).to(x.dtype)


def fused_add_offset_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = x + residual
    return offset_rms_norm(total, weight, eps), total


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:  # contract 1.6
    xf = x.to(_acc_dtype(x))
    centred = xf - xf.mean(-1, keepdim=True)
    out = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)
    return (out if bias is None else out + bias.to(xf.dtype)).to(x.dtype)


def rotary_embedding(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, R/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: Tensor) -> Tensor:
        acc = _acc_dtype(x)
        x_rot, x_pass = x[..., :rot].to(acc), x[..., rot:]
        if is_neox:
            x1, x2 = x_rot.chunk(2, dim=-1)
        else:
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        c, s = cos.to(acc), sin.to(acc)
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
        return torch.cat((out.to(x.dtype), x_pass), -1)

    return rotate(q), rotate(k)


def silu_and_mul(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


GATED = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_tanh": lambda y: gelu_and_mul(y, "tanh")}
"""rms_norm_linear's activations (contract 1.9): name -> the gated op over the product."""


def rms_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                    activation: str | None = None) -> Tensor:  # contract 1.9
    y = linear(rms_norm(x, norm_weight, eps), weight, bias)
    return y if activation is None else rms_norm_linear_gated(y, activation)


def rms_norm_linear_gated(y: Tensor, activation: str) -> Tensor:
    """rms_norm_linear's gated activation (one of ``GATED``) of a product y [..., N] -> [..., N/2]."""
    if activation not in GATED:
        raise ValueError(f"rms_norm_linear: activation {activation!r} is not one of {', '.join(GATED)} or None")
    return GATED[activation](y)


def linear_add(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:  # contract 1.9
    return residual + linear(x, weight, bias)


def mla_inputs(q: Tensor, kv: Tensor, w_uk: Tensor, kv_norm_weight: Tensor, eps: float, positions: Tensor,
               cos_sin_cache: Tensor, is_neox: bool, *, rotary=None, norm=None) -> tuple[Tensor, Tensor]:  # contract 1.10
    """``rotary`` and ``norm``: a backend's ``rotary_embedding`` and ``rms_norm`` to compose instead of these."""
    rotary, norm = rotary or rotary_embedding, norm or rms_norm
    nope, lora = w_uk.shape[1], w_uk.shape[2]
    q_pe, k_pe = rotary(positions, q[..., nope:], kv[:, None, lora:], cos_sin_cache, is_neox)
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)
    latent = torch.cat((norm(kv[:, :lora], kv_norm_weight, eps), k_pe[:, 0]), dim=-1)
    return torch.cat((q_latent, q_pe), dim=-1), latent


def linear_float32(x: Tensor, weight: Tensor) -> Tensor:  # contract 1.11
    acc = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    return F.linear(x.to(acc), weight.to(acc))


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return weight[ids]


def greedy_sample(logits: Tensor) -> Tensor:
    return logits.argmax(dim=-1)


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    t = temperature.to(torch.float32)
    t = torch.where(t > 0, t, torch.ones_like(t))
    return logits.to(torch.float32) / t[:, None]


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    vocab = logits.shape[-1]
    out = logits.to(torch.float32).clone()
    sorted_logits, order = out.sort(dim=-1, descending=True)
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better-ranked tokens
    p = top_p.to(torch.float32)[:, None]
    drop = (mass_before >= p) & (p < 1)  # p = 1 keeps all, though the float sum may reach 1 early
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return out.scatter(1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    out = logits.to(torch.float32)
    probs = out.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(torch.float32)[:, None]
    return out.masked_fill(probs < threshold, float("-inf"))


def apply_penalties(
    logits: Tensor, prompt_mask: Tensor, output_counts: Tensor, repetition: Tensor, frequency: Tensor, presence: Tensor
) -> Tensor:
    x = logits.to(_acc_dtype(logits))
    in_output = output_counts > 0
    r = repetition.to(x.dtype)[:, None]
    x = torch.where(prompt_mask | in_output, torch.where(x > 0, x / r, x * r), x)
    x = x - frequency.to(x.dtype)[:, None] * output_counts.to(x.dtype)
    return x - presence.to(x.dtype)[:, None] * in_output.to(x.dtype)


def random_sample(probs: Tensor, exponentials: Tensor) -> Tensor:
    return (probs / exponentials).argmax(dim=-1)


def log_softmax(logits: Tensor) -> Tensor:
    return torch.log_softmax(logits.to(_acc_dtype(logits)), dim=-1)


# --- contract 1.1: mixture of experts ------------------------------------------------------------


def moe_route(
    router_logits: Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
    correction_bias: Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
    group_score: str = "max", scaling: float = 1.0,
) -> tuple[Tensor, Tensor]:
    logits = router_logits.to(_acc_dtype(router_logits))
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"moe_route: scoring {scoring!r} is not 'softmax' or 'sigmoid'")
    choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype)
    if num_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, num_groups, e // num_groups)
        if group_score == "max":
            group_scores = grouped.amax(dim=-1)
        elif group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            raise ValueError(f"moe_route: group_score {group_score!r} is not 'max' or 'top2_sum'")
        best = group_scores.topk(topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // num_groups, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling, ids


def fused_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                  activation: str = "silu") -> Tensor:
    act = {"silu": silu_and_mul, "gelu": gelu_and_mul}.get(activation)
    if act is None:
        raise ValueError(f"fused_experts: activation {activation!r} is not 'silu' or 'gelu'")
    acc = _acc_dtype(x)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=acc, device=x.device)
    for expert in topk_ids[topk_ids >= 0].unique().tolist():  # the reference may loop; backends must not
        rows, slots = (topk_ids == expert).nonzero(as_tuple=True)
        hidden = act(linear(x[rows], w13[expert], None))
        y = linear(hidden, w2[expert], None).to(acc)
        out.index_add_(0, rows, y * topk_weights[rows, slots, None].to(acc))
    return out.to(x.dtype)


from chitu_core.ops.quant_reference import fp8_linear, gguf_linear, int4_linear, int8_linear  # noqa: E402,F401  contract 1.2
from chitu_core.ops.quant_reference import fused_experts_fp8  # noqa: E402,F401  contract 1.3


def int4_rms_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, qweight: Tensor, scales: Tensor, zeros: Tensor,
                         group_size: int, bias: Tensor | None, activation: str | None = None) -> Tensor:  # contract 1.18
    y = int4_linear(rms_norm(x, norm_weight, eps), qweight, scales, zeros, group_size, bias)
    return y if activation is None else rms_norm_linear_gated(y, activation)


def int4_linear_add(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int, bias: Tensor | None,
                    residual: Tensor) -> Tensor:  # contract 1.18
    return residual + int4_linear(x, qweight, scales, zeros, group_size, bias)
