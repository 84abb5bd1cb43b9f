"""Acme's native ops. Each has the signature and semantics of ``chitu_core.ops.spec.OpSet``; every op
left out of NATIVE_OPS is served by chitu-core's reference implementation (reported as a fallback)."""

import torch

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # The contract: normalise in float32, round to x.dtype, then multiply by the weight.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def silu_and_mul(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]
    return gate * torch.sigmoid(gate) * up  # a new tensor: ops never modify their inputs


def greedy_sample(logits: Tensor) -> Tensor:
    # argmax returns the first maximal index: the contract's "lowest index among ties".
    return torch.argmax(logits, dim=-1)


NATIVE_OPS = {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul, "greedy_sample": greedy_sample}
