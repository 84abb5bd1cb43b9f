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

An fp8 cache (contract 1.2, ``chitu_core.attention.fp8``) has one scale per layer for the
whole latent row (the normalised c_kv and the rotary key alike): ``kv_scale`` float32 [1].
"""

from abc import abstractmethod

import torch

from chitu_core.attention import fp8
from chitu_core.attention.contract import AttentionMetadata, PagedKVBackend
from chitu_core.attention.reference import causal_mask, packed_to_padded_index

Tensor = torch.Tensor


class MLAAttentionBackend(PagedKVBackend):
    """Paged latent attention for one model: one instance serves every layer.

    num_heads: query heads on this rank; kv_lora_rank (L) and rope_dim (R): the latent's parts.
    """

    num_kv_scales = 1

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(block_size, dtype, device)
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @abstractmethod
    def forward(self, q: Tensor, latent: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                kv_scale: Tensor | None = None) -> Tensor:
        """q: [T, num_heads, L + R]; latent: [T, L + R]; kv_cache: this layer's cache.

        Writes ``latent`` to ``meta.slot_mapping`` (negative slots: padding rows, not written), then
        returns [T, num_heads, L]: for each new token and head, softmax(scale * q . K^T) V over its
        sequence's latents at positions <= its own, K the whole latents and V their first L
        channels, accumulated in float32.

        An fp8 cache (contract 1.2): ``kv_scale`` is the layer's float32 [1]; the latents are stored
        and read back as ``chitu_core.attention.fp8`` says, K and V above being the values read back.
        Never passed for a cache of the model dtype."""


def write_latent(kv_cache: Tensor, latent: Tensor, slot_mapping: Tensor, kv_scale: Tensor | None = None) -> None:
    """Store new latents at their slots; kv_cache is [num_blocks, block_size, L + R]. An fp8 cache
    stores them quantized by ``kv_scale`` (float32 [1])."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, latent = slot_mapping[keep], latent[keep]
    if fp8.is_fp8(kv_cache):  # copied as bytes: not every device's index_copy_ takes float8
        fp8.check_scale(kv_cache, kv_scale, 1)
        flat, latent = flat.view(torch.uint8), fp8.quantize(latent, kv_scale[0]).view(torch.uint8)
    flat.index_copy_(0, slot_mapping, latent.to(flat.dtype))


def gather_latents(kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    """Each sequence's cached latents in order: [B, max_seq_len, L + R]."""
    n_blocks = -(-meta.max_seq_len // meta.block_size)
    tables = meta.block_tables[:, :n_blocks].long()
    latents = kv_cache[tables].reshape(meta.num_seqs, n_blocks * meta.block_size, kv_cache.shape[-1])
    return latents[:, : meta.max_seq_len]


def mla_attention(q: Tensor, latent: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                  kv_lora_rank: int, kv_scale: Tensor | None = None) -> Tensor:
    """The contract's ``forward`` computed literally (see MLAAttentionBackend.forward)."""
    write_latent(kv_cache, latent, meta.slot_mapping, kv_scale)
    keys = gather_latents(kv_cache, meta)
    mask = causal_mask(meta)
    seq_idx, pos = packed_to_padded_index(meta)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if fp8.is_fp8(kv_cache):
        keys = fp8.dequantize(keys, kv_scale[0], acc)
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
    supports_fp8_kv_cache = True

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.latent_dim)

    def forward(self, q, latent, kv_cache, meta, scale, kv_scale=None):
        return mla_attention(q, latent, kv_cache, meta, scale, self.kv_lora_rank, kv_scale)
