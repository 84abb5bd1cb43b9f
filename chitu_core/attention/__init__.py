"""The attention contract: paged KV cache whose layout the backend chooses, metadata built once a
step, one call for a mixed batch of prefills and decodes. ``reference`` is its plain-PyTorch oracle;
``mla`` is the multi-head latent attention variant (contract 1.1) with its own reference; ``fp8`` is the format of
an FP8 KV cache (contract 1.2)."""

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata, PagedKVBackend
from chitu_core.attention.mla import MLAAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "MLAAttentionBackend", "PagedKVBackend"]
