"""Acme's paged attention, with a cache layout of its own choosing.

Layout: [num_blocks, block_size, 2, num_kv_heads, head_dim]: a block holds, token by token, that
token's key and value. The engine deals in block ids only, so any layout works as long as
``kv_cache_shape`` describes it and ``forward`` writes and reads it consistently.
"""

import torch

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata


class AcmePagedAttention(AttentionBackend):
    name = "acme-paged"
    block_sizes = (16, 32)  # the first is the default

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, 2, self.num_kv_heads, self.head_dim)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        # 1. Store the step's new keys and values at their slots (block_id * block_size + offset). A negative
        #    slot marks a padding row: nothing of it is stored (as an index, -1 would wrap to the last slot).
        keep = meta.slot_mapping >= 0
        slot_mapping, k, v = meta.slot_mapping[keep], k[keep], v[keep]
        slots = kv_cache.view(-1, 2, self.num_kv_heads, self.head_dim)  # one row per slot
        slots[slot_mapping, 0] = k.to(kv_cache.dtype)
        slots[slot_mapping, 1] = v.to(kv_cache.dtype)
        # 2. Attend, sequence by sequence, over the cached keys at positions <= each query's own.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        group = self.num_heads // self.num_kv_heads
        starts = meta.query_start_loc.tolist()
        for b, (seq_len, context) in enumerate(zip(meta.seq_lens.tolist(), meta.context_lens.tolist())):
            n_blocks = -(-seq_len // self.block_size)
            blocks = meta.block_tables[b, :n_blocks].long()
            kv = kv_cache[blocks].reshape(-1, 2, self.num_kv_heads, self.head_dim)[:seq_len].float()
            rows = slice(starts[b], starts[b + 1])
            n = starts[b + 1] - starts[b]
            qb = q[rows].float().reshape(n, self.num_kv_heads, group, self.head_dim)
            scores = torch.einsum("nhgd,shd->hgns", qb, kv[:, 0]) * scale
            visible = torch.arange(seq_len, device=q.device)[None, :] <= context + torch.arange(n, device=q.device)[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            # Like flash-attention kernels, Acme multiplies probabilities rounded to the input dtype
            # by V; in bfloat16 that costs precision, hence the widened threshold in backend.py.
            probs = probs.to(q.dtype).float()
            out[rows] = torch.einsum("hgns,shd->nhgd", probs, kv[:, 1]).reshape(n, self.num_heads, self.head_dim).to(q.dtype)
        return out
