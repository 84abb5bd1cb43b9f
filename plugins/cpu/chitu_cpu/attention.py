"""Paged attention on the CPU with PyTorch's scaled_dot_product_attention.

Layout: [2, num_blocks, block_size, num_kv_heads, head_dim]. Per step, ``prepare``
builds the packed<->padded index and the causal mask once; each layer then
scatters its new keys/values into the cache, gathers every sequence's keys and
values through its block table, and runs one SDPA call for the whole batch.

An fp8 cache (contract 1.2) is written as the reference writes it; the gathered
keys and values are upcast to the model dtype (exact for e4m3) and the scales
applied outside SDPA: the key scale folded into the softmax scale, the value
scale multiplied into the output.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chitu_core.attention.contract import VARIANTS, AttentionBackend, AttentionMetadata
from chitu_core.attention.reference import causal_mask, gather_kv, packed_to_padded_index, paged_attention, write_kv


@dataclass
class CpuStepState:
    seq_idx: torch.Tensor  # [T] sequence of each packed row
    pos: torch.Tensor  # [T] its row among the sequence's new tokens
    mask: torch.Tensor  # bool [B, 1, max_query_len, max_seq_len]
    windows: dict = field(default_factory=dict)  # window -> its mask, made by the first layer that asks

    def windowed(self, meta: AttentionMetadata, window: int) -> torch.Tensor:
        if window not in self.windows:
            self.windows[window] = causal_mask(meta, window)[:, None]
        return self.windows[window]


class CpuSdpaAttention(AttentionBackend):
    name = "sdpa"
    block_sizes = (16, 1, 8, 32, 64, 128)
    supports_fp8_kv_cache = True
    variants = VARIANTS  # contract 1.6: a window masks more; a capped layer takes the reference's math

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def prepare(self, meta: AttentionMetadata) -> CpuStepState:
        seq_idx, pos = packed_to_padded_index(meta)
        return CpuStepState(seq_idx, pos, causal_mask(meta)[:, None])

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=None, softcap=None, window=None):
        if softcap is not None:  # SDPA has no logit cap
            return paged_attention(q, k, v, kv_cache, meta, scale, kv_scale, softcap, window)
        state: CpuStepState = meta.backend_state
        mask = state.mask if window is None else state.windowed(meta, window)
        write_kv(kv_cache, k, v, meta.slot_mapping, kv_scale)
        keys, values = gather_kv(kv_cache, meta)  # [B, S, Hk, D]
        v_scale = None
        if kv_scale is not None:  # an fp8 cache
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            k_scale, v_scale = kv_scale.tolist()
            scale *= k_scale
        b, hq, d = meta.num_seqs, q.shape[1], q.shape[2]
        q_pad = q.new_zeros(b, meta.max_query_len, hq, d)
        q_pad[state.seq_idx, state.pos] = q
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, Hq, max_q, D]
        out = out.transpose(1, 2)[state.seq_idx, state.pos]
        return out if v_scale is None else (out.float() * v_scale).to(q.dtype)
