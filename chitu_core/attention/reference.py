"""Reference paged attention in plain PyTorch: the oracle and the fallback attention backend.

Cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values).
Vectorized over the batch: sequences are gathered from their block tables and
padded to [B, max_len], never looped over in Python. An fp8 cache (contract 1.2)
holds exactly what ``chitu_core.attention.fp8`` says, and is read back as it says,
in the accumulation dtype: the oracle for every backend's fp8 cache.
"""

import torch

from chitu_core.attention import fp8
from chitu_core.attention.contract import VARIANTS, AttentionBackend, AttentionMetadata

Tensor = torch.Tensor


def write_kv(kv_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor, kv_scale: Tensor | None = None) -> None:
    """Store new keys and values at their slots; kv_cache is [2, N, block_size, Hk, D]. Rows whose
    slot is negative (padding) are not stored. An fp8 cache stores them quantized by ``kv_scale``
    (float32 [2]: keys', values')."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    if fp8.is_fp8(kv_cache):  # copied as bytes: not every device's index_copy_ takes float8
        fp8.check_scale(kv_cache, kv_scale, 2)
        flat = flat.view(torch.uint8)
        k, v = fp8.quantize(k, kv_scale[0]).view(torch.uint8), fp8.quantize(v, kv_scale[1]).view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


def packed_to_padded_index(meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """For each packed token row, its (sequence index, position among the sequence's new tokens)."""
    qsl = meta.query_start_loc.long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(meta.num_seqs, device=qsl.device), query_lens)
    pos = torch.arange(seq_idx.shape[0], device=qsl.device) - qsl[seq_idx]
    return seq_idx, pos


def gather_kv(kv_cache: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """Each sequence's keys and values in order: two [B, max_seq_len, Hk, D] tensors."""
    n_blocks = -(-meta.max_seq_len // meta.block_size)
    tables = meta.block_tables[:, :n_blocks].long()
    b = meta.num_seqs
    keys = kv_cache[0][tables].reshape(b, n_blocks * meta.block_size, *kv_cache.shape[3:])
    values = kv_cache[1][tables].reshape(b, n_blocks * meta.block_size, *kv_cache.shape[3:])
    return keys[:, : meta.max_seq_len], values[:, : meta.max_seq_len]


def causal_mask(meta: AttentionMetadata, window: int | None = None) -> Tensor:
    """bool [B, max_query_len, max_seq_len]: may query row i of sequence b see key position j (with
    ``window``, only the last ``window`` positions up to its own)."""
    dev = meta.seq_lens.device
    q_abs = meta.context_lens.long()[:, None] + torch.arange(meta.max_query_len, device=dev)[None]
    k_pos = torch.arange(meta.max_seq_len, device=dev)
    mask = (k_pos[None, None, :] <= q_abs[:, :, None]) & (k_pos[None, None, :] < meta.seq_lens.long()[:, None, None])
    return mask if window is None else mask & (k_pos[None, None, :] > q_abs[:, :, None] - window)


def paged_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                    kv_scale: Tensor | None = None, softcap: float | None = None, window: int | None = None) -> Tensor:
    """The contract's ``forward`` computed literally (see AttentionBackend.forward and, for ``softcap``
    and ``window``, the contract module)."""
    write_kv(kv_cache, k, v, meta.slot_mapping, kv_scale)
    keys, values = gather_kv(kv_cache, meta)
    mask = causal_mask(meta, window)
    seq_idx, pos = packed_to_padded_index(meta)
    b, hq, d = meta.num_seqs, q.shape[1], q.shape[2]
    hk = keys.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if fp8.is_fp8(kv_cache):
        keys, values = fp8.dequantize(keys, kv_scale[0], acc), fp8.dequantize(values, kv_scale[1], acc)
    q_pad = q.new_zeros(b, meta.max_query_len, hq, d)
    q_pad[seq_idx, pos] = q
    q_pad = q_pad.to(acc).view(b, meta.max_query_len, hk, hq // hk, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", q_pad, keys.to(acc)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)  # padded query rows see nothing
    values = torch.where(mask.any(1)[:, :, None, None], values.to(acc), 0)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, values).reshape(b, meta.max_query_len, hq, d)
    return out[seq_idx, pos].to(q.dtype)


class ReferenceAttention(AttentionBackend):
    """The reference as an attention backend (fallback for backends that declare none)."""

    name = "reference"
    block_sizes = (16, 1, 8, 32, 64, 128)
    supports_fp8_kv_cache = True
    supports_16bit_kv_cache = True  # contract 1.15: write_kv rounds to the cache dtype, the read upcasts
    variants = VARIANTS

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=None, softcap=None, window=None):
        return paged_attention(q, k, v, kv_cache, meta, scale, kv_scale, softcap, window)
