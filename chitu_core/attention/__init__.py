"""The attention contract: paged KV cache whose layout the backend chooses, metadata built once a
step, one call for a mixed batch of prefills and decodes. ``reference`` is its plain-PyTorch oracle."""

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]
