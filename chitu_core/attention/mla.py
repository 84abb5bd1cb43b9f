"""Multi-head latent attention (DeepSeek-V2/V3), the contract's MLA variant (contract 1.1).

MLA caches one latent vector per token instead of per-head keys and values: ``kv_lora_rank``
(L) channels of the normalised compressed KV, then ``rope_dim`` (R) channels of the rotated,
head-shared rotary key. The model absorbs the key up-projection into the query and the value
up-projection into the output, so that attention runs over the latent cache directly:

    q       [T, H, L + R]  per head: (q_nope @ W_UK) channels, then the rotated q_pe
    latent  [T, L + R]     this step's new latents (normalised c_kv, then rotated k_pe)
    out     [T, H, L]      softmax(scale * q . K^T) V, with K = the cached latents and
                           V = their first L channels; the model applies W_UV and o_proj after.

This is multi-query attention with one shared "head" whose value is a prefix of its key, so
a backend stores each token once. The block manager still deals in block ids only; the
cache layout is the backend's (``kv_cache_shape``). One call serves a mixed batch of
prefills and decodes, as regular attention does (``AttentionMetadata``).
"""

from abc import abstractmethod

import torch

from chitu_core.attention.contract import AttentionMetadata, PagedKVBackend
from chitu_core.attention.reference import causal_mask, packed_to_padded_index

Tensor = torch.Tensor


class MLAAttentionBackend(PagedKVBackend):
    """Paged latent attention for one model: one instance serves every layer.

    num_heads: query heads on this rank; kv_lora_rank (L) and rope_dim (R): the latent's parts.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(block_size, dtype, device)
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @abstractmethod
    def forward(self, q: Tensor, latent: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        """q: [T, num_heads, L + R]; latent: [T, L + R]; kv_cache: this layer's cache.

        Writes ``latent`` to ``meta.slot_mapping`` (negative slots: padding rows, not written), then
        returns [T, num_heads, L]: for each new token and head, softmax(scale * q . K^T) V over its
        sequence's latents at positions <= its own, K the whole latents and V their first L
        channels, accumulated in float32."""


def write_latent(kv_cache: Tensor, latent: Tensor, slot_mapping: Tensor) -> None:
    """Store new latents at their slots; kv_cache is [num_blocks, block_size, L + R]."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, latent = slot_mapping[keep], latent[keep]
    flat.index_copy_(0, slot_mapping, latent.to(kv_cache.dtype))


def gather_latents(kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    """Each sequence's cached latents in order: [B, max_seq_len, L + R]."""
    n_blocks = -(-meta.max_seq_len // meta.block_size)
    tables = meta.block_tables[:, :n_blocks].long()
    latents = kv_cache[tables].reshape(meta.num_seqs, n_blocks * meta.block_size, kv_cache.shape[-1])
    return latents[:, : meta.max_seq_len]


def mla_attention(q: Tensor, latent: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                  kv_lora_rank: int) -> Tensor:
    """The contract's ``forward`` computed literally (see MLAAttentionBackend.forward)."""
    write_latent(kv_cache, latent, meta.slot_mapping)
    keys = gather_latents(kv_cache, meta)
    mask = causal_mask(meta)
    seq_idx, pos = packed_to_padded_index(meta)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h = meta.num_seqs, q.shape[1]
    q_pad = q.new_zeros(b, meta.max_query_len, h, q.shape[2])
    q_pad[seq_idx, pos] = q
    scores = torch.einsum("bqhd,bkd->bhqk", q_pad.to(acc), keys.to(acc)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)  # padded query rows see nothing
    values = torch.where(mask.any(1)[:, :, None], keys[..., :kv_lora_rank].to(acc), 0)
    out = torch.einsum("bhqk,bkd->bqhd", probs, values)
    return out[seq_idx, pos].to(q.dtype)


class ReferenceMLAAttention(MLAAttentionBackend):
    """The reference as an MLA backend (the fallback for backends that declare none).
    Cache layout: [num_blocks, block_size, L + R]."""

    name = "reference-mla"
    block_sizes = (16, 1, 8, 32, 64, 128)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.latent_dim)

    def forward(self, q, latent, kv_cache, meta, scale):
        return mla_attention(q, latent, kv_cache, meta, scale, self.kv_lora_rank)
