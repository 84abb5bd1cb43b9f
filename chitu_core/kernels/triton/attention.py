"""``TritonPagedAttention``: the attention contract on the portable Triton kernels.

A Triton-capable backend opts in by returning it from ``attention_backends()``.
Cache layout [2, num_blocks, block_size, num_kv_heads, head_dim] (kv_cache.py).
``prepare`` plans the step once (tile shapes, split-KV or not, the split
workspace) from host ints only, so it never waits on the device; every layer's
``forward`` then writes its keys and values and runs one attention launch (two
with split-KV). A model may instead call ``rotary_and_write_kv`` (RoPE fused
with the cache write) and then ``attend``, skipping the separate write.
It supports an fp8 cache (contract 1.2): every kernel above takes the layer's
``kv_scale``; the tile plan stays the one of the model dtype.
"""

from dataclasses import dataclass

import torch

from chitu_core.attention.contract import VARIANTS, AttentionBackend, AttentionMetadata
from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.kv_cache import write_kv
from chitu_core.kernels.triton.paged_attention import (
    DEFAULT_TILES,
    AttentionPlan,
    TileConfig,
    paged_attention,
    plan,
    split_workspace,
)
from chitu_core.kernels.triton.rotary import rotary_embedding_and_write_kv

Tensor = torch.Tensor


@dataclass
class TritonStepState:
    plan: AttentionPlan
    workspace: tuple[Tensor, Tensor, Tensor] | None  # split-KV partials, shared by the step's layers


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    block_sizes = (16, 1, 8, 32, 64, 128)
    fuses_rotary = True
    fuses_qk_norm = True
    captures_prefill = True  # contract 1.16: plans from host ints (bounds serve), reads the rest on the device
    supports_fp8_kv_cache = True
    variants = VARIANTS  # contract 1.6: the logit cap and the sliding window, in the kernel
    force_num_splits: int | None = None
    """Set (tests, tuning) to force a split-KV count instead of the planner's choice."""
    float32_dot_precision: str = "ieee"
    """tl.dot's input_precision in a float32 cache; a backend's subclass may pick a faster one of
    float32 accuracy its device offers."""
    tiles: TileConfig = DEFAULT_TILES
    """The device's tiling (``paged_attention.TileConfig``); a backend's subclass sets its own."""

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, dtype, device):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, dtype, device)
        self.num_compute_units = num_compute_units(torch.device(device))

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def prepare(self, meta: AttentionMetadata) -> TritonStepState:
        step = plan(self.num_heads, self.num_kv_heads, meta.max_query_len, meta.num_seqs, meta.max_seq_len,
                    self.num_compute_units, self.force_num_splits, self.dtype.itemsize, self.head_dim, self.tiles)
        workspace = None
        if step.num_splits > 1:
            workspace = split_workspace(meta.slot_mapping.shape[0], self.num_heads, self.head_dim, step.num_splits,
                                        meta.slot_mapping.device)
        return TritonStepState(step, workspace)

    def warmup(self) -> None:
        """Compile the kernel variants steps use (prefill tiles; decode tiles, whole and split) on a
        one-block stand-in cache."""
        cache, kv_scale = self.allocate_kv_cache(1), self.new_kv_scale()
        q = torch.zeros((2, self.num_heads, self.head_dim), dtype=self.dtype, device=self.device)
        tables = torch.zeros((2, 1), dtype=torch.int32, device=self.device)
        for query_len, splits in ((2, 1), (1, 1), (1, 2)):
            seqs = 2 // query_len
            step = plan(self.num_heads, self.num_kv_heads, 64 if query_len > 1 else 1, seqs, self.block_size,
                        self.num_compute_units, splits, self.dtype.itemsize, self.head_dim, self.tiles)
            qsl = torch.arange(seqs + 1, dtype=torch.int32, device=self.device) * query_len
            seq_lens = torch.full((seqs,), query_len, dtype=torch.int32, device=self.device)
            paged_attention(q, cache, tables[:seqs], seq_lens, qsl, 1.0, step, None, self.float32_dot_precision,
                            kv_scale)

    def _state(self, meta: AttentionMetadata) -> TritonStepState:
        return meta.backend_state if isinstance(meta.backend_state, TritonStepState) else self.prepare(meta)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                kv_scale: Tensor | None = None, softcap: float | None = None, window: int | None = None) -> Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping, kv_scale)
        return self.attend(q, kv_cache, meta, scale, kv_scale, softcap, window)

    def attend(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
               kv_scale: Tensor | None = None, softcap: float | None = None, window: int | None = None) -> Tensor:
        """``forward`` without the cache write: the step's keys and values are already in ``kv_cache``."""
        state = self._state(meta)
        return paged_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                               state.plan, state.workspace, self.float32_dot_precision, kv_scale, softcap, window)

    def rotary_and_write_kv(self, positions: Tensor, q: Tensor, k: Tensor, v: Tensor, cos_sin_cache: Tensor,
                            is_neox: bool, kv_cache: Tensor, meta: AttentionMetadata,
                            kv_scale: Tensor | None = None,
                            qk_norm: tuple[Tensor, Tensor, float] | None = None) -> tuple[Tensor, Tensor]:
        """The op ``rotary_embedding`` (returns the rotated q, k) fused with the cache write of the
        rotated k and of v, and with the per-head norms of q and k where given; follow it with ``attend``."""
        return rotary_embedding_and_write_kv(positions, q, k, v, cos_sin_cache, is_neox, kv_cache, meta.slot_mapping,
                                             kv_scale, qk_norm)
