"""Paged attention on the CPU with PyTorch's scaled_dot_product_attention.

Layout: [2, num_blocks, block_size, num_kv_heads, head_dim], in anonymous zero pages that become
resident as they are written. Per step, ``prepare``
builds the packed<->padded index, the causal mask, the gather rows and the slots once; each layer then
scatters its new keys/values into the cache, gathers every sequence's keys and
values through its block table, and runs one SDPA call for the whole batch.

An fp8 cache (contract 1.2) is written as the reference writes it; the gathered
keys and values are upcast to the model dtype (exact for e4m3) and the scales
applied outside SDPA: the key scale folded into the softmax scale, the value
scale multiplied into the output.
"""

import mmap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chitu_core.attention.contract import VARIANTS, AttentionBackend, AttentionMetadata
from chitu_core.attention.reference import causal_mask, packed_to_padded_index, paged_attention, write_kv


@dataclass
class CpuStepState:
    seq_idx: torch.Tensor  # [T] sequence of each packed row
    pos: torch.Tensor  # [T] its row among the sequence's new tokens
    mask: torch.Tensor  # bool [B, 1, max_query_len, max_seq_len]
    rows: torch.Tensor  # [B * n] int64: the cache blocks holding each sequence's keys, in order (n blocks each)
    slots: torch.Tensor  # the cache slots of the rows stored (padding rows, slot < 0, left out)
    keep: torch.Tensor | None  # which rows those are, where some are padding
    windows: dict = field(default_factory=dict)  # window -> its mask, made by the first layer that asks

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "CpuStepState":
        """What every layer of the step shares: the padding index, the mask, the gather rows, the slots."""
        seq_idx, pos = packed_to_padded_index(meta)
        rows = meta.block_tables[:, :-(-meta.max_seq_len // meta.block_size)].reshape(-1).long()
        slots, keep = meta.slot_mapping, None
        if not bool((slots >= 0).all()):  # padding rows are not stored
            keep = slots >= 0
            slots = slots[keep]
        return cls(seq_idx, pos, causal_mask(meta)[:, None], rows, slots, keep)

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

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Anonymous zero pages (an mmap): zero-filled as the contract asks, but host memory is committed
        only as blocks are first written, so the budget costs resident memory only as sequences fill it."""
        shape = self.kv_cache_shape(num_blocks)
        pages = mmap.mmap(-1, max(1, torch.Size(shape).numel() * self.kv_cache_dtype.itemsize))
        return torch.frombuffer(pages, dtype=torch.uint8).view(self.kv_cache_dtype).view(shape)  # keeps `pages` alive

    def prepare(self, meta: AttentionMetadata) -> CpuStepState:
        return CpuStepState.of(meta)

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=None, softcap=None, window=None):
        if softcap is not None:  # SDPA has no logit cap
            return paged_attention(q, k, v, kv_cache, meta, scale, kv_scale, softcap, window)
        state: CpuStepState = meta.backend_state
        mask = state.mask if window is None else state.windowed(meta, window)
        call = paged_sdpa_op if torch.compiler.is_compiling() else paged_sdpa  # the op: opaque to a compiled step
        return call(q, k, v, kv_cache, state.slots, state.keep, state.rows, state.seq_idx, state.pos, mask, scale,
                    kv_scale, window is not None)


def paged_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
               keep: torch.Tensor | None, rows: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor,
               mask: torch.Tensor, scale: float, kv_scale: torch.Tensor | None, windowed: bool = False) -> torch.Tensor:
    """One layer's step, with ``CpuStepState``'s tensors: the cache write, the gather of the blocks
    ``rows`` names (the mask's [B, 1, max_query_len, max_seq_len] gives the sizes; whole blocks copied
    by index_select, several times faster than advanced indexing) and one SDPA call for the batch. A decode step (one
    query row per sequence) needs no padding, and a single sequence no mask unless ``windowed`` (a
    sliding-window mask hides its oldest keys)."""
    if keep is not None:
        k, v = k[keep], v[keep]
    if kv_scale is not None:  # an fp8 cache: written as the reference writes it
        write_kv(kv_cache, k, v, slots, kv_scale)
    else:
        kv_cache.view(2, -1, *kv_cache.shape[3:]).index_copy_(1, slots, torch.stack((k, v)).to(kv_cache.dtype))
    b, _, max_q, max_s = mask.shape
    num_blocks, block_size, hk, d = kv_cache.shape[1:]
    gathered = kv_cache.view(2, num_blocks, -1).index_select(1, rows)
    kv = gathered.view(2, b, -1, hk, d)[:, :, :max_s].transpose(2, 3)  # [2, B, Hk, S, D]
    keys, values = kv[0], kv[1]
    v_scale = None
    if kv_scale is not None:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        k_scale, v_scale = kv_scale.tolist()
        scale *= k_scale
    hq = q.shape[1]
    if max_q == 1:
        out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask if b > 1 or windowed else None,
                                             scale=scale, enable_gqa=hq != hk)[:, :, 0]
    else:
        q_pad = q.new_zeros(b, max_q, hq, d)
        q_pad[seq_idx, pos] = q
        out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=hq != hk)  # [B, Hq, max_q, D]
        out = out.transpose(1, 2)[seq_idx, pos]
    return out if v_scale is None else (out.float() * v_scale).to(q.dtype)


# ``paged_sdpa`` as an operator for torch.compile: the compiled step calls it as it is and takes its sizes
# from the tensors rather than specialising on them. Registered through torch.library.Library rather than
# the custom_op decorator, whose Python wrapper costs ~100 us a call here against ~4.
_LIBRARY = torch.library.Library("chitu_cpu", "DEF")
_LIBRARY.define("paged_sdpa(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slots, Tensor? keep, Tensor rows, "
                "Tensor seq_idx, Tensor pos, Tensor mask, float scale, Tensor? kv_scale, bool windowed) -> Tensor")
_LIBRARY.impl("paged_sdpa", paged_sdpa, "CPU")
_LIBRARY.impl("paged_sdpa", lambda q, *_: torch.empty_like(q), "Meta")
paged_sdpa_op = torch.ops.chitu_cpu.paged_sdpa
