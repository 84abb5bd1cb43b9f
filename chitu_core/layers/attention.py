"""The attention layer: hands q, k, v of one layer to the backend's paged attention."""

import torch
from torch import nn

from chitu_core.layers.context import BuildContext, StepContext


class Attention(nn.Module):
    """One layer's attention. Where the backend's cache is fp8 (contract 1.2) the layer keeps its
    scales (``kv_scale``, float32 [2]: keys, values; the checkpoint's where it has them, else 1.0) and
    passes them to every backend call; otherwise it calls the backend as contract 1.0 does."""

    checkpoint_kv_scales = ("k", "v")
    """The checkpoint scales that fill ``kv_scale``, in order (``chitu_core.quantization.kv_scales``)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int, ctx: BuildContext,
                 scale: float | None = None, softcap: float | None = None, window: int | None = None):
        """``scale`` (default head_dim ** -0.5) multiplies q . k; ``softcap`` and ``window``: the attention
        variants of contract 1.6 (``chitu_core.attention.contract``), passed to the backend only when set;
        the model must declare them in its ``KVGeometry.attention_variants``."""
        super().__init__()
        self.backend = ctx.attention
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx, self.scale = layer_idx, head_dim**-0.5 if scale is None else scale
        self.variant = {k: v for k, v in (("softcap", softcap), ("window", window)) if v is not None}
        self.register_buffer("kv_scale", self.backend.new_kv_scale(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepContext,
                rotary=None, positions: torch.Tensor | None = None, qk_norm=None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq * D]. With ``rotary`` (a RotaryEmbedding) and
        ``positions``, q and k are rotated first: by the backend in its cache write where it fuses
        the two, else by the rotary layer's op. ``qk_norm``: per-head norms (q's and k's ``RMSNorm``
        over head_dim) applied to q and k before all that: by the backend in that same cache write where
        it fuses them too (contract 1.12's ``fuses_qk_norm``), else by the two layers."""
        cache = step.kv_caches[self.layer_idx]
        fp8 = {} if self.kv_scale is None else {"kv_scale": self.kv_scale}
        fused = rotary is not None and self.backend.fuses_rotary
        if qk_norm is not None and not (fused and self.backend.fuses_qk_norm and _plain_norms(qk_norm, q.dtype)):
            q, k = qk_norm[0](q), qk_norm[1](k)
            qk_norm = None
        if fused:
            norms = {} if qk_norm is None else {"qk_norm": (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)}
            q, _ = self.backend.rotary_and_write_kv(positions, q, k, v, rotary.cos_sin_cache, rotary.is_neox, cache,
                                                    step.meta, **fp8, **norms)
            out = self.backend.attend(q, cache, step.meta, self.scale, **fp8, **self.variant)
        else:
            if rotary is not None:
                q, k = rotary(positions, q, k)
            out = self.backend.forward(q, k, v, cache, step.meta, self.scale, **fp8, **self.variant)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


def _plain_norms(qk_norm, dtype: torch.dtype) -> bool:
    """Whether a backend's fused per-head norms can stand for these two RMSNorm layers: weights of the
    activations' dtype, no offset (Gemma's 1 + w stays with the layers), one eps."""
    q_norm, k_norm = qk_norm
    return (not q_norm.offset and not k_norm.offset and q_norm.eps == k_norm.eps
            and q_norm.weight.dtype == k_norm.weight.dtype == dtype)
