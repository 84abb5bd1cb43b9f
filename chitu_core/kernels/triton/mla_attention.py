"""Multi-head latent attention (``chitu_core.attention.mla``) on portable Triton kernels, and
``TritonMLAAttention``, the MLA backend a Triton-capable backend opts into.

Layout: [num_blocks, block_size, L + R], one latent row per token (L = kv_lora_rank, R =
rope_dim; 512 + 64 for DeepSeek), the row contiguous. Any block size works: keys are read
through the block table one position at a time.

``_write_latent_kernel``: one program per new token copies its latent to its slot; a negative
slot (a padding row of a decode graph) writes nothing.

``_mla_attention_kernel``: one program per (query block of one sequence, block of heads[,
split]). MLA is multi-query attention with one shared key "head" whose value is the key's first
L channels, so a program's BLOCK_M rows are BLOCK_M / HEAD_BLOCK consecutive query tokens times
HEAD_BLOCK heads, all against the same keys. The key width L + R is not a power of two; each
key tile is loaded as two parts, the latent [BLOCK_N, L] and the rotary [BLOCK_N, R], the
scores are the sum of two products (q_latent . k_latent^T + q_rope . k_rope^T), and the latent
part, already loaded, is the value tile. A flash-attention online softmax in float32 (exp2, the
scale folded into log2 units) walks the sequence's keys in tiles of BLOCK_N, masked causally and
past the sequence. Programs find their sequence by binary search over query_start_loc (as the
regular paged attention does), so the grid is the bound T // BLOCK_Q + B from shapes alone.

Split-KV (flash-decoding): in decode steps whose programs would leave the device under-filled,
a third grid axis splits each sequence's key tiles into ``num_splits`` ranges, computed in the
kernel from the sequence's length; each program stores its unnormalised accumulator, running
max and sum, and the regular paged attention's reduction combines them (a range with no keys
has max -inf and weight 0). ``plan`` picks tiles and the split count from host ints only.

An fp8 cache (contract 1.2, FP8; one scale per layer for the whole row): the write quantizes as
kv_cache.py does (``e4m3_bits`` into the cache's bytes); the attention loads key tiles as
float8_e4m3fn and upcasts them, exactly, to q's dtype, with the scale folded into the softmax
scale and into the accumulator after the loop.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.attention.contract import AttentionMetadata
from chitu_core.attention.fp8 import FP8_DTYPE, check_scale
from chitu_core.attention.mla import MLAAttentionBackend
from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.common import pow2
from chitu_core.kernels.triton.kv_cache import store_kv, store_target
from chitu_core.kernels.triton.paged_attention import (LOG2E, _reduce_splits_kernel, decode_splits, find_query_block,
                                                      split_workspace)
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options

Tensor = torch.Tensor

MAX_SPLITS = 32
"""Most key ranges a decode splits into: a batch of one on a device of ~130 compute units."""
MIN_SPLIT_KEYS = 256
"""Fewest keys a range of a batch's sequences gets: below that the reduction costs more than the
parallelism gains."""
MIN_SPLIT_KEYS_ALONE = 32
"""Fewest keys a range gets when one sequence decodes alone (one key tile of 16-bit latents). Batch 1,
16 heads, H100 (plugins/nvidia/scripts/dense_gemv_sweep.py, 27 layers' caches in a graph): the best
count gave ranges of 24-32 keys at contexts of 256-1024 (256 keys: 16.1 us whole, 7.3 us in 8 ranges;
1024: 63.1 -> 8.7 us in 32); 256-key ranges left a 384-key context whole (23 us). Batches keep the
256-key bound: DeepSeek-V2-Lite at batch 32 in graphs failed with an illegal address once its ranges were
32 keys (not reproduced by the kernel alone in a graph; not understood yet)."""
TILE_BYTES = 64 << 10
"""Bytes of one key tile in shared memory (pipelined two deep): 32 keys of 576 16-bit channels."""


@triton.jit
def _write_latent_kernel(cache, latent, slot_mapping, kv_scale, stride_lt, stride_ld, stride_c_blk, stride_c_tok,
                         width, BLOCK_SIZE: tl.constexpr, WIDTH_P: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    gdc_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, WIDTH_P)
        x = tl.load(latent + t * stride_lt + d * stride_ld, mask=d < width)
        dst = cache + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok
        store_kv(dst + d, x, d < width, kv_scale, FP8)


# Ints that change from step to step are not specialized on (see paged_attention.py).
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt"])
def _mla_attention_kernel(
    out, part_acc, part_max, part_sum,
    q, cache, block_tables, seq_lens, query_start_loc, kv_scale,
    scale_log2, num_seqs, num_heads, num_splits,
    stride_qt, stride_qh, stride_qd, stride_c_blk, stride_c_tok, stride_bt,
    LORA: tl.constexpr, ROPE: tl.constexpr, LORA_P: tl.constexpr, ROPE_P: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    gdc_enter(PDL)
    BLOCK_Q: tl.constexpr = BLOCK_M // HEAD_BLOCK
    pid = tl.program_id(0)
    seq, q_start, q_len, q_first = find_query_block(query_start_loc, pid, num_seqs, BLOCK_Q)
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_pos = q_first + rows // HEAD_BLOCK  # each row's token among the sequence's new tokens
    head = tl.program_id(1) * HEAD_BLOCK + rows % HEAD_BLOCK
    row_ok = (q_pos < q_len) & (head < num_heads)
    c = tl.arange(0, LORA_P)
    c_ok = c < LORA
    r = tl.arange(0, ROPE_P)
    r_ok = r < ROPE
    token = (q_start + q_pos).to(tl.int64)
    q_row = q + token[:, None] * stride_qt + head[:, None] * stride_qh
    q_lora = tl.load(q_row + c[None, :] * stride_qd, mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + (LORA + r[None, :]) * stride_qd, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    q_abs = context + q_pos
    kv_end = tl.minimum(seq_len, context + q_first + BLOCK_Q)  # no row sees a key past its last token
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if SPLIT:
        per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = tl.program_id(2) * per_split
        tile_hi = tl.minimum(num_tiles, tile_lo + per_split)
    else:
        tile_lo = 0
        tile_hi = num_tiles
    if FP8:
        scale_log2 = scale_log2 * tl.load(kv_scale)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LORA_P], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_end
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        key = cache + block * stride_c_blk + (k_pos % BLOCK_SIZE) * stride_c_tok
        k_lora = tl.load(key[:, None] + c[None, :], mask=k_ok[:, None] & c_ok[None, :], other=0.0)  # also V
        k_rope = tl.load(key[:, None] + LORA + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if FP8:
            k_lora, k_rope = k_lora.to(q_lora.dtype), k_rope.to(q_lora.dtype)
        s = tl.dot(q_lora, tl.trans(k_lora), input_precision=PRECISION, out_dtype=tl.float32)
        s = tl.dot(q_rope, tl.trans(k_rope), acc=s, input_precision=PRECISION, out_dtype=tl.float32) * scale_log2
        s = tl.where((k_pos[None, :] <= q_abs[:, None]) & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k_lora.dtype), k_lora, acc=acc * alpha[:, None], input_precision=PRECISION,
                     out_dtype=tl.float32)
        m_i = m_new
    if FP8:
        acc = acc * tl.load(kv_scale)

    if SPLIT:
        part = (token * num_heads + head) * num_splits + tl.program_id(2)
        tl.store(part_acc + part[:, None] * LORA_P + c[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max + part, m_i, mask=row_ok)
        tl.store(part_sum + part, l_i, mask=row_ok)
    else:
        result = acc / l_i[:, None]
        tl.store(out + (token * num_heads + head)[:, None] * LORA + c[None, :], result.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & c_ok[None, :])


@dataclass(frozen=True)
class MLAPlan:
    """Tile shapes and split count for one step (every layer of the step shares it)."""

    head_block: int  # heads per program
    block_m: int  # rows per program: block_m // head_block tokens times head_block heads
    block_n: int  # keys per tile
    num_splits: int  # 1: no split
    num_warps: int


def plan(num_heads: int, max_query_len: int, num_seqs: int, max_seq_len: int, num_compute_units: int,
         num_splits: int | None = None, dtype_bytes: int = 2, kv_lora_rank: int = 512,
         rope_dim: int = 64) -> MLAPlan:
    """Up to 32 heads per program (more would not fit the [rows, L] float32 accumulator in registers);
    16 rows when every sequence brings one token, else 32; key tiles of TILE_BYTES (32 keys of
    512 + 64 16-bit channels, 16 in float32). Split the keys only in pure decode steps whose
    programs (sequences times head blocks) would leave the device under-filled (fewer than 2 per
    compute unit) and whose contexts are long (>= 2 * MIN_SPLIT_KEYS), into at most MAX_SPLITS
    ranges of at least MIN_SPLIT_KEYS (MIN_SPLIT_KEYS_ALONE for a batch of one; ``decode_splits``).
    ``num_splits`` forces a count (tests, tuning)."""
    head_block = min(pow2(num_heads), 32)
    block_m = max(16 if max_query_len == 1 else 32, head_block)
    row_bytes = (pow2(kv_lora_rank, at_least=16) + pow2(rope_dim, at_least=16)) * dtype_bytes
    block_n = max(16, min(64, 1 << (max(1, TILE_BYTES // row_bytes).bit_length() - 1)))  # a power of two
    if num_splits is None:
        num_splits = decode_splits(num_seqs * -(-num_heads // head_block), num_compute_units, max_query_len, num_seqs,
                                   max_seq_len, MIN_SPLIT_KEYS, MIN_SPLIT_KEYS_ALONE, MAX_SPLITS)
    rows_x_lora = block_m * pow2(kv_lora_rank, at_least=16)
    return MLAPlan(head_block, block_m, block_n, num_splits, 4 if rows_x_lora <= 16 * 512 else 8)


def write_latent(kv_cache: Tensor, latent: Tensor, slot_mapping: Tensor, kv_scale: Tensor | None = None) -> None:
    """latent: [T, L + R] (any strides); stores row t at slot_mapping[t] unless it is negative (an fp8
    cache: quantized by the layer's ``kv_scale``, float32 [1])."""
    check_cache(kv_cache, latent.shape[1])
    t, width = latent.shape
    if t == 0:
        return
    target, scale, fp8 = store_target(kv_cache, kv_scale, 1)
    _write_latent_kernel[(t,)](target, latent, slot_mapping, scale, *latent.stride(), *kv_cache.stride()[:2], width,
                               BLOCK_SIZE=kv_cache.shape[1], WIDTH_P=pow2(width), FP8=fp8,
                               num_warps=1 if width <= 256 else 4, **pdl_options(latent.device))


def mla_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                  scale: float, kv_lora_rank: int, step: MLAPlan,
                  workspace: tuple[Tensor, Tensor, Tensor] | None = None, float32_precision: str = "ieee",
                  kv_scale: Tensor | None = None) -> Tensor:
    """q: [T, H, L + R] (any strides); kv_cache already holds this step's latents.

    Returns [T, H, L] in q's dtype: causal attention of each token over its sequence's cached
    latents, the value being their first L channels. ``workspace`` (``split_workspace(T, H, L,
    num_splits)``) is needed when ``step.num_splits`` > 1; ``float32_precision`` as in
    ``paged_attention.paged_attention``. An fp8 cache needs the layer's ``kv_scale`` (float32 [1]);
    the products then run in q's dtype."""
    t, num_heads, width = q.shape
    check_cache(kv_cache, width)
    out = torch.empty((t, num_heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    fp8 = kv_cache.dtype == FP8_DTYPE
    if fp8:
        check_scale(kv_cache, kv_scale, 1)
    elif q.dtype != kv_cache.dtype:
        q = q.to(kv_cache.dtype)
    rope_dim, lora_p = width - kv_lora_rank, pow2(kv_lora_rank, at_least=16)
    num_seqs = seq_lens.shape[0]
    split = step.num_splits > 1
    if split and workspace is None:
        workspace = split_workspace(t, num_heads, kv_lora_rank, step.num_splits, q.device)
    part_acc, part_max, part_sum = workspace if split else (out, out, out)
    grid = (t // (step.block_m // step.head_block) + num_seqs, -(-num_heads // step.head_block), step.num_splits)
    _mla_attention_kernel[grid](
        out, part_acc, part_max, part_sum, q, kv_cache, block_tables, seq_lens, query_start_loc,
        kv_scale if fp8 else seq_lens, scale * LOG2E, num_seqs, num_heads, step.num_splits,
        *q.stride(), *kv_cache.stride()[:2], block_tables.stride(0),
        LORA=kv_lora_rank, ROPE=rope_dim, LORA_P=lora_p, ROPE_P=pow2(rope_dim, at_least=16),
        HEAD_BLOCK=step.head_block, BLOCK_M=step.block_m, BLOCK_N=step.block_n, BLOCK_SIZE=kv_cache.shape[1],
        SPLIT=split, PRECISION=float32_precision if q.dtype == torch.float32 else "tf32",  # ignored for 16-bit
        FP8=fp8, num_warps=step.num_warps, num_stages=2, **pdl_options(q.device),
    )
    if split:
        _reduce_splits_kernel[(t, num_heads)](out, part_acc, part_max, part_sum, num_heads, step.num_splits,
                                              HEAD_DIM=kv_lora_rank, HEAD_P=lora_p, SPLITS_P=pow2(step.num_splits),
                                              num_warps=4 if step.num_splits * lora_p <= 4096 else 8,
                                              **pdl_options(q.device))
    return out


def check_cache(kv_cache: Tensor, width: int) -> None:
    if kv_cache.dim() != 3 or kv_cache.shape[2] != width or kv_cache.stride(-1) != 1:
        raise ValueError(f"expected a [num_blocks, block_size, {width}] latent cache with its rows contiguous, got "
                         f"shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")


@dataclass
class TritonMLAStepState:
    plan: MLAPlan
    workspace: tuple[Tensor, Tensor, Tensor] | None  # split-KV partials, shared by the step's layers


class TritonMLAAttention(MLAAttentionBackend):
    """The MLA contract on the kernels above; cache [num_blocks, block_size, L + R] (see the module).

    ``prepare`` plans the step from host ints and shapes only (max_query_len, max_seq_len, the
    batch and token counts), and allocates the split workspace there, so a decode graph captured
    after it replays with new tensor contents: the cache write skips padding slots on the device,
    and each program finds its sequence, length and key ranges on the device."""

    name = "triton-mla"
    block_sizes = (16, 1, 8, 32, 64, 128)
    supports_fp8_kv_cache = True
    force_num_splits: int | None = None
    """Set (tests, tuning) to force a split-KV count instead of the planner's choice."""
    float32_dot_precision: str = "ieee"
    """tl.dot's input_precision in a float32 cache (see ``TritonPagedAttention``)."""

    def __init__(self, num_heads, kv_lora_rank, rope_dim, block_size, dtype, device):
        super().__init__(num_heads, kv_lora_rank, rope_dim, block_size, dtype, device)
        self.num_compute_units = num_compute_units(torch.device(device))

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.latent_dim)

    def _plan(self, max_query_len: int, num_seqs: int, max_seq_len: int, num_splits: int | None) -> MLAPlan:
        return plan(self.num_heads, max_query_len, num_seqs, max_seq_len, self.num_compute_units, num_splits,
                    self.dtype.itemsize, self.kv_lora_rank, self.rope_dim)

    def prepare(self, meta: AttentionMetadata) -> TritonMLAStepState:
        step = self._plan(meta.max_query_len, meta.num_seqs, meta.max_seq_len, self.force_num_splits)
        workspace = None
        if step.num_splits > 1:
            workspace = split_workspace(meta.slot_mapping.shape[0], self.num_heads, self.kv_lora_rank,
                                        step.num_splits, meta.slot_mapping.device)
        return TritonMLAStepState(step, workspace)

    def warmup(self) -> None:
        """Compile the kernel variants steps use (prefill tiles; decode tiles, whole and split) and the
        cache write, on a one-block stand-in cache."""
        cache, kv_scale = self.allocate_kv_cache(1), self.new_kv_scale()
        q = torch.zeros((2, self.num_heads, self.latent_dim), dtype=self.dtype, device=self.device)
        tables = torch.zeros((2, 1), dtype=torch.int32, device=self.device)
        write_latent(cache, q[:, 0], torch.full((2,), -1, dtype=torch.int64, device=self.device), kv_scale)
        for query_len, splits in ((2, 1), (1, 1), (1, 2)):
            seqs = 2 // query_len
            step = self._plan(query_len, seqs, self.block_size, splits)
            qsl = torch.arange(seqs + 1, dtype=torch.int32, device=self.device) * query_len
            seq_lens = torch.full((seqs,), query_len, dtype=torch.int32, device=self.device)
            mla_attention(q, cache, tables[:seqs], seq_lens, qsl, 1.0, self.kv_lora_rank, step, None,
                          self.float32_dot_precision, kv_scale)

    def forward(self, q: Tensor, latent: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                kv_scale: Tensor | None = None) -> Tensor:
        state = meta.backend_state if isinstance(meta.backend_state, TritonMLAStepState) else self.prepare(meta)
        write_latent(kv_cache, latent, meta.slot_mapping, kv_scale)
        return mla_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                             self.kv_lora_rank, state.plan, state.workspace, self.float32_dot_precision, kv_scale)
