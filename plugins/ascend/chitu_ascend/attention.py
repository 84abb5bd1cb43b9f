"""Paged attention on torch_npu: the cache write by ``npu_scatter_nd_update_``, attention for prefill, decode
and mixed batches by one ``npu_fused_infer_attention_score`` call with the block tables.

KV-cache layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads * head_dim]``. Index 0
holds keys, 1 values; element ``[0, b, o]`` is the key of the token in block b at offset o, all its heads
side by side. ``[0]`` is exactly the paged key the fused attention reads in its "BBH" form
([blockNum, blockSize, H], H = heads * head_dim), and ``[0].view(-1, H)`` is one row per cache slot
(slot = block_id * block_size + offset), which the scatter writes. Block sizes are multiples of 16, as the
operator's page-attention mode requires; 128 (vllm-ascend's default) comes first.

Per step (``prepare``): the host lists the operator takes (cumulative query ends, each sequence's cached
length) and where padding rows write. Not supported here (declared, so the engine takes the reference
attention): an fp8 cache, logit soft-capping, sliding windows; float32 (the operator takes float16 and
bfloat16 only).
"""

from dataclasses import dataclass

import torch

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata
from chitu_core.errors import ChituError

Tensor = torch.Tensor
CAUSAL_MASK_SIZE = 2048
"""sparse_mode 3 (right-down causal) takes a compressed 2048 x 2048 upper-triangular mask, whatever the lengths."""


@dataclass
class AscendStepState:
    query_ends: list[int]  # cumulative new-token counts: the operator's actual_seq_lengths in TND layout
    seq_lens: list[int]  # cached tokens of each sequence after this step: actual_seq_lengths_kv
    write_slots: Tensor  # int64 [T, 1]: each new token's slot; a padding row takes the first real row's
    write_rows: Tensor  # int64 [T]: the row of k and v written at write_slots[i] (padding: that real row)


class AscendPagedAttention(AttentionBackend):
    name = "npu-fia"
    block_sizes = (128, 16, 32, 64)

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, dtype, device):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ChituError(f"attention backend {self.name!r}: npu_fused_infer_attention_score takes float16 or "
                             f"bfloat16, not {dtype}; run the model with dtype='bfloat16'")
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, dtype, device)
        self._mask: Tensor | None = None

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads * self.head_dim)

    def causal_mask(self) -> Tensor:
        if self._mask is None:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=self.device)
            self._mask = torch.triu(ones, diagonal=1)  # True: masked
        return self._mask

    def prepare(self, meta: AttentionMetadata) -> AscendStepState:
        """Padding rows (slot -1) must not be written, and the scatter's indices may not be out of range: they
        rewrite the first real row's slot with that row's own key and value, so every write is one a new
        token makes anyway. A step of padding rows only is never sent by the engine."""
        slots = meta.slot_mapping.long()
        real = slots >= 0
        first = torch.argmax(real.to(torch.int8))  # the first real row, on the device
        rows = torch.arange(slots.shape[0], device=slots.device)
        write_rows = torch.where(real, rows, first)
        return AscendStepState(meta.query_start_loc[1:].tolist(), meta.seq_lens.tolist(),
                               slots.index_select(0, write_rows)[:, None], write_rows)

    def write_kv(self, k: Tensor, v: Tensor, kv_cache: Tensor, state: AscendStepState) -> None:
        """``torch_npu.npu_scatter_nd_update_(input, indices, updates) -> input``.

        Doc: torch_npu API reference, "torch_npu.npu_scatter_nd_update_" (Pytorch 7.0.0, ptaoplist_001254):
        in place, input[indices[i]] = updates[i]; indices int32/int64 with at least 2 dims, whose last
        dimension a indexes input's first a dims (here a = 1: a slot); updates is indices.shape[:-1] +
        input.shape[a:]; indices must not be out of range. input is one half of the cache as [slots, H]."""
        import torch_npu

        width = self.num_kv_heads * self.head_dim
        keys, values = kv_cache[0].view(-1, width), kv_cache[1].view(-1, width)
        for half, new in ((keys, k), (values, v)):
            rows = new.index_select(0, state.write_rows).reshape(-1, width).to(half.dtype)
            torch_npu.npu_scatter_nd_update_(half, state.write_slots, rows)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                kv_scale: Tensor | None = None) -> Tensor:
        """``torch_npu.npu_fused_infer_attention_score(query, key, value, *, atten_mask, actual_seq_lengths,
        actual_seq_lengths_kv, block_table, num_heads, scale, input_layout, num_key_value_heads, sparse_mode,
        block_size, ...) -> (attention_out, softmax_lse)``.

        Doc: torch_npu API reference, "torch_npu.npu_fused_infer_attention_score" (Pytorch 7.0.0,
        ptaoplist_001232): query float16/bfloat16, contiguous; input_layout "TND" packs every sequence's new
        tokens along T, actual_seq_lengths being the cumulative ends; with block_table (int32 [B, max
        blocks]) key and value are the paged caches [blockNum, blockSize, H] with block_size tokens a block,
        actual_seq_lengths_kv each sequence's cached length; num_key_value_heads < num_heads is GQA;
        sparse_mode 3 is right-down causal (query i of a sequence with S_q new of S_kv tokens sees keys
        j <= i + S_kv - S_q) with the 2048 x 2048 upper-triangular mask."""
        if kv_scale is not None:
            raise ChituError(f"attention backend {self.name!r} keeps its cache in the model dtype; "
                             "use kv_cache_dtype='auto'")
        import torch_npu

        state: AscendStepState = meta.backend_state
        self.write_kv(k, v, kv_cache, state)
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q.contiguous(), kv_cache[0], kv_cache[1], atten_mask=self.causal_mask(),
            actual_seq_lengths=state.query_ends, actual_seq_lengths_kv=state.seq_lens,
            block_table=meta.block_tables.to(torch.int32), num_heads=self.num_heads, scale=scale,
            input_layout="TND", num_key_value_heads=self.num_kv_heads, sparse_mode=3, block_size=self.block_size)
        return out
