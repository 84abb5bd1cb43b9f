"""Which attention an engine runs: the backend's default of the model's kind, or the core's reference."""

import logging
from collections.abc import Sequence

import torch

from chitu_core.attention.contract import PagedKVBackend
from chitu_core.attention.mla import ReferenceMLAAttention
from chitu_core.attention.reference import ReferenceAttention
from chitu_core.model import KVGeometry

log = logging.getLogger(__name__)


def build_attention(backend, geometry: KVGeometry, block_size: int | None, dtype: torch.dtype,
                    device: torch.device, kv_cache_dtype: str | Sequence[str] = "auto") -> PagedKVBackend:
    """The backend's default attention of the geometry's kind (regular or latent), or the core's
    reference where the backend declares none, with its cache in ``kv_cache_dtype`` ("auto": the
    model dtype; "fp8", "float16", "bfloat16": a ChituError naming the attention backend where it does
    not support one). A sequence is an order of preference: the first the attention accepts, else the last."""
    if geometry.is_mla:
        cls = next(iter(backend.mla_attention_backends().values()), ReferenceMLAAttention)
        attention = cls(geometry.num_heads, geometry.kv_lora_rank, geometry.rope_dim,
                        block_size or cls.block_sizes[0], dtype, device)
    else:
        cls = next(iter(backend.attention_backends().values()), ReferenceAttention)
        missing = geometry.attention_variants - cls.supported_variants()
        if missing:
            log.warning("attention backend %r lacks the attention variant(s) %s this model uses; the core's reference "
                        "attention runs instead (correct, not fast)", cls.name, ", ".join(sorted(missing)))
            cls = ReferenceAttention
        attention = cls(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim,
                        block_size or cls.block_sizes[0], dtype, device)
    choices = (kv_cache_dtype,) if isinstance(kv_cache_dtype, str) else tuple(kv_cache_dtype)
    attention.set_kv_cache_dtype(next((c for c in choices if attention.accepts_kv_cache_dtype(c)), choices[-1]))
    return attention
