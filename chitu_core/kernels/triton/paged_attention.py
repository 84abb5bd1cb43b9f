"""Paged attention of the attention contract (``chitu_core.attention.contract``): one Triton kernel
family for prefill, decode and mixed batches, with a split-KV variant for long decodes.

Layout: [2, num_blocks, block_size, num_kv_heads, head_dim] (kv_cache.py), read
through each sequence's block table one key at a time, so any block size works.

``_attention_kernel``: one program per (query block of one sequence, kv head[,
split]). Its BLOCK_M rows are BLOCK_M / GROUP_P consecutive query tokens times
the GROUP query heads that share the kv head (GQA: keys and values are loaded
once for the whole group). It walks the sequence's keys in tiles of BLOCK_N
with a flash-attention online softmax in float32 (exp2, the scale folded into
log2 units), masking keys after each token's position (causal) and past the
sequence. Programs find their sequence by binary search over query_start_loc,
so the grid is the bound T // BLOCK_Q + B and needs no host-side index. A pure
decode step (one token a sequence, ``AttentionPlan.decode``) takes a grid of B
programs a kv head instead, each its sequence's by index: no search, and its
first loads (the sequence's length, its block table) depend on nothing but the
program id; each key tile's values are loaded with its keys. Launched dependent (``pdl``), a decode program
reads its sequence's length and block table and asks for its first two key tiles (keys and values) to be
brought into L2 before it waits for the kernel before it (rotary, which writes q and the new key):
on an H200, Llama-3.1-8B batch 1 decodes 1-2% faster with this and rotary's early reads
(docs/benchmarks/nvidia-h200-pdl-prologue.md).

Split-KV (decode with few sequences and long contexts): a third grid axis splits
each sequence's key tiles into ``num_splits`` ranges; each program writes its
unnormalised accumulator, running max and sum, and ``_reduce_splits_kernel``
combines them. ``plan`` picks the tile shapes and the split count from host ints.

An fp8 cache (contract 1.2, FP8): key and value tiles are loaded as float8_e4m3fn
(half the bytes) and upcast, exactly, to q's dtype for the products; the layer's key
scale is folded into the softmax scale and its value scale into the accumulator
after the loop, so the tiles are never multiplied element by element.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.attention.fp8 import FP8_DTYPE, check_scale
from chitu_core.kernels.triton.common import pow2
from chitu_core.kernels.triton.pdl import gdc_enter, l2_prefetch, pdl_options

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 256
"""Fewest keys a key range of a batch's sequences gets: below that the reduction costs more than the
parallelism gains."""
MIN_SPLIT_KEYS_ALONE = int(os.environ.get("CHITU_SPLIT_KEYS_ALONE", 64))
"""Fewest keys a range gets when one sequence decodes alone (one 16 KB key tile of 128 16-bit channels):
its few (kv head) programs would otherwise walk the whole context each, one tile after another.
CHITU_SPLIT_KEYS_ALONE sets another (256: as batches)."""
DECODE_GRID = os.environ.get("CHITU_DECODE_GRID", "1") != "0"
"""Pure decode steps take the kernel's decode grid (``AttentionPlan.decode``); CHITU_DECODE_GRID=0 leaves them
to the general one (to compare). On an H200 at Llama-3.1-8B's heads and 256-token contexts the kernel took
6.34 us against 6.63 at batch 1 (4 ranges), 25.0 against 25.5 at batch 64
(docs/benchmarks/nvidia-h200-decode-grid.md)."""


def decode_splits(programs: int, num_compute_units: int, max_query_len: int, num_seqs: int, max_seq_len: int,
                  least: int, least_alone: int, most: int, fill: int = 2) -> int:
    """Key ranges for a step's attention (regular and latent): one, unless it is a pure decode step whose
    ``programs`` would leave the device under-filled (fewer than 2 per compute unit) and whose contexts
    hold two ranges of ``least`` keys (``least_alone`` for a sequence decoding alone); then as many as
    keep the programs at most ``fill`` per compute unit, at most ``most`` and no range shorter than that
    bound. At most, not at least: one range more can cost more than the rest gain (on an H200, 32
    sequences of 8,000 tokens at Qwen3-1.7B's heads took 323 us in 3 ranges against 247 in 2;
    docs/benchmarks/nvidia-h200-decode-fill.md)."""
    keys = least_alone if num_seqs == 1 else least
    if max_query_len != 1 or programs >= 2 * num_compute_units or max_seq_len < 2 * keys:
        return 1
    return max(1, min(most, fill * num_compute_units // programs, max_seq_len // keys))


@triton.jit
def find_query_block(query_start_loc, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Program pid's sequence (the last b whose first query block, query_start_loc[b] // BLOCK_Q + b, is <= pid:
    a binary search), that sequence's first new token and count of new tokens, and the program's first token
    among them (past the count: a program of the grid's bound with nothing to do)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    return seq, q_start, q_len, (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q


@triton.jit
def prefetch_kv(kv, table, tile_lo, tile_hi, kv_end, stride_c_kv, stride_c_blk, stride_c_tok, BLOCK_N: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, ROW_LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    """L2 prefetch of the keys and values of a program's first two key tiles (from tile_lo, below tile_hi and
    kv_end): ROW_LINES lines of LINE elements a key. The step's own key, which the kernel before may still be
    writing, is asked for too: harmless, its write lands in L2."""
    k_pos = tile_lo * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
    ok = (k_pos < kv_end) & (k_pos < tile_hi * BLOCK_N)
    block = tl.load(table + k_pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    row = block * stride_c_blk + (k_pos % BLOCK_SIZE) * stride_c_tok
    off = tl.where(ok[:, None], row[:, None] + tl.arange(0, ROW_LINES)[None, :] * LINE, 0)
    l2_prefetch(kv + off, PDL)
    l2_prefetch(kv + stride_c_kv + off, PDL)


# Ints that change from step to step are not specialized on (Triton would compile a variant for a
# value of 1 and for multiples of 16): a server's arbitrary batches must not wait on the compiler.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt"])
def _attention_kernel(
    out, part_acc, part_max, part_sum,
    q, cache, block_tables, seq_lens, query_start_loc, kv_scale,
    scale_log2, softcap_log2, window, num_seqs, num_heads, num_splits,
    stride_qt, stride_qh, stride_qd, stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr,
    DECODE: tl.constexpr, ROW_LINES: tl.constexpr, KV_LINE: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:  # one token a sequence: query_start_loc[b] = b
        seq = pid
        q_start = pid
        q_len = 1
        q_first = 0
    else:
        gdc_enter(PDL)
        seq, q_start, q_len, q_first = find_query_block(query_start_loc, pid, num_seqs, BLOCK_Q)
        if q_first >= q_len:
            return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_pos = q_first + rows // GROUP_P  # each row's token among the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (q_pos < q_len) & (rows % GROUP_P < GROUP)
    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD_DIM
    token = (q_start + q_pos).to(tl.int64)
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
        if WINDOW:  # tiles wholly before the first row's window hold nothing any row sees
            tile_lo = tl.maximum(context + q_first - window + 1, 0) // BLOCK_N
    kv = cache + kv_head * stride_c_head
    table = block_tables + seq.to(tl.int64) * stride_bt
    if DECODE:  # the step's lengths and tables are engine inputs no kernel of the step writes: read before the wait
        if PDL:
            prefetch_kv(kv, table, tile_lo, tile_hi, kv_end, stride_c_kv, stride_c_blk, stride_c_tok, BLOCK_N,
                        BLOCK_SIZE, ROW_LINES, KV_LINE, PDL)
        gdc_enter(PDL)
    q_tile = tl.load(q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8:
        scale_log2 = scale_log2 * tl.load(kv_scale)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_end
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = block * stride_c_blk + (k_pos % BLOCK_SIZE) * stride_c_tok
        k_tile = tl.load(kv + slot[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        if DECODE:  # issued beside the keys', so a tile waits on memory once
            v_tile = tl.load(kv + stride_c_kv + slot[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                             other=0.0)
        if FP8:
            k_tile = k_tile.to(q_tile.dtype)
        s = tl.dot(q_tile, k_tile, input_precision=PRECISION, out_dtype=tl.float32) * scale_log2
        if SOFTCAP:  # softcap * tanh(x / softcap), in the log2 domain the scores live in; tanh(y) = 1 - 2 / (e^2y + 1)
            s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap_log2) + 1.0))
        visible = (k_pos[None, :] <= q_abs[:, None]) & k_ok[None, :]
        if WINDOW:
            visible = visible & (k_pos[None, :] > q_abs[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not DECODE:
            v_tile = tl.load(kv + stride_c_kv + slot[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                             other=0.0)
        if FP8:
            v_tile = v_tile.to(q_tile.dtype)
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc=acc * alpha[:, None], input_precision=PRECISION,
                     out_dtype=tl.float32)
        m_i = m_new
    if FP8:
        acc = acc * tl.load(kv_scale + 1)

    if SPLIT:
        part = (token * num_heads + head) * num_splits + tl.program_id(2)
        tl.store(part_acc + part[:, None] * HEAD_P + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max + part, m_i, mask=row_ok)
        tl.store(part_sum + part, l_i, mask=row_ok)
    else:
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a padding row may see nothing in a window
        tl.store(out + (token * num_heads + head)[:, None] * HEAD_DIM + d[None, :],
                 result.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(out, part_acc, part_max, part_sum, num_heads, num_splits,
                          HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr, SPLITS_P: tl.constexpr,
                          PDL: tl.constexpr):
    gdc_enter(PDL)
    row = tl.program_id(0).to(tl.int64) * num_heads + tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    s_ok = s < num_splits
    m = tl.load(part_max + row * num_splits + s, mask=s_ok, other=float("-inf"))
    weight = tl.where(s_ok, tl.exp2(m - tl.max(m, axis=0)), 0.0)  # an empty split has m = -inf: weight 0
    total = tl.sum(tl.load(part_sum + row * num_splits + s, mask=s_ok, other=0.0) * weight, axis=0)
    d = tl.arange(0, HEAD_P)
    acc = tl.load(part_acc + (row * num_splits + s)[:, None] * HEAD_P + d[None, :], mask=s_ok[:, None], other=0.0)
    result = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out + row * HEAD_DIM + d, result.to(out.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass(frozen=True)
class TileConfig:
    """A device's tiling of the attention kernel: bytes of one key tile (what one pipeline stage of K
    and of V holds in shared memory), and the warps of a program of up to 64 query rows and of a wider
    one. A device of 64-wide wavefronts (a DCU) gets the same threads from half the warps."""

    key_tile_bytes: int = 16 << 10
    warps: int = 4
    wide_warps: int = 8
    decode_stages: int | None = None  # pipeline stages of the key loop in decode-sized plans (None: Triton's default)
    decode_fill: int = 2  # most programs per compute unit a split decode makes (``decode_splits``' fill)


DEFAULT_TILES = TileConfig()


@dataclass(frozen=True)
class AttentionPlan:
    """Tile shapes and split count for one step (every layer of the step shares it)."""

    block_m: int
    block_n: int
    num_splits: int  # 1: no split
    num_warps: int
    num_stages: int | None = None
    decode: bool = False  # every sequence brings one token (max_query_len 1): the kernel's decode grid


def plan(num_heads: int, num_kv_heads: int, max_query_len: int, num_seqs: int, max_seq_len: int,
         num_compute_units: int, num_splits: int | None = None, dtype_bytes: int = 2,
         head_dim: int = 128, tiles: TileConfig = DEFAULT_TILES) -> AttentionPlan:
    """Decode-sized query blocks (16 rows) when every sequence brings few tokens, else 64 rows; key
    tiles of 16 KB (64 keys of 128 16-bit channels; fewer keys for wider rows, since pipelined
    K and V tiles must fit in shared memory), and query blocks of at most 32 rows when a row
    takes more than 512 bytes (head_dim 256 in float32). Split
    the keys only in pure decode steps whose (sequence, kv head) programs would leave the device
    under-filled (fewer than 2 per compute unit) and whose contexts are long (at least two ranges),
    into as many ranges as keep at most ``tiles.decode_fill`` programs per compute unit, at most 16 of
    at least ``MIN_SPLIT_KEYS`` keys (``MIN_SPLIT_KEYS_ALONE`` for a batch of one). ``num_splits`` forces
    a count (tests, tuning); ``tiles`` is the device's configuration (the defaults: 16 KB key tiles, 4 or 8
    warps of 32 threads, a fill of 2)."""
    group_p = pow2(num_heads // num_kv_heads)
    small = max_query_len * group_p <= 16
    row_bytes = pow2(head_dim, at_least=16) * dtype_bytes
    block_m = max(16 if small else (64 if row_bytes <= 512 else 32), group_p)
    block_n = max(16, min(64, tiles.key_tile_bytes // row_bytes))
    if num_splits is None:
        num_splits = decode_splits(num_seqs * num_kv_heads, num_compute_units, max_query_len, num_seqs, max_seq_len,
                                   MIN_SPLIT_KEYS, MIN_SPLIT_KEYS_ALONE, 16, tiles.decode_fill)
    return AttentionPlan(block_m, block_n, num_splits, tiles.warps if block_m <= 64 else tiles.wide_warps,
                         tiles.decode_stages if small else None, DECODE_GRID and max_query_len == 1)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, step: AttentionPlan,
                    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    float32_precision: str = "ieee", kv_scale: torch.Tensor | None = None,
                    softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D] (any strides); kv_cache already holds this step's keys and values.

    Returns [T, Hq, D] in q's dtype: causal attention of each token over its sequence's cached
    keys. ``workspace`` (see ``split_workspace``) is needed when ``step.num_splits`` > 1.
    ``float32_precision`` is tl.dot's input_precision for float32 operands: "ieee" everywhere;
    a device may offer faster ones of float32 accuracy (NVIDIA: "tf32x3"). An fp8 cache needs
    the layer's ``kv_scale`` (float32 [2]); the products then run in q's dtype. ``softcap`` and
    ``window``: the attention variants of contract 1.6 (``chitu_core.attention.contract``)."""
    t, num_heads, dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty((t, num_heads, dim), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    fp8 = kv_cache.dtype == FP8_DTYPE
    if fp8:
        check_scale(kv_cache, kv_scale, 2)
    elif q.dtype != kv_cache.dtype:
        q = q.to(kv_cache.dtype)
    group = num_heads // num_kv_heads
    group_p, head_p = pow2(group), pow2(dim, at_least=16)
    num_seqs = seq_lens.shape[0]
    split = step.num_splits > 1
    if split and workspace is None:
        workspace = split_workspace(t, num_heads, dim, step.num_splits, q.device)
    part_acc, part_max, part_sum = workspace if split else (out, out, out)
    decode = step.decode and t == num_seqs  # with max_query_len 1, one token each
    grid = (num_seqs if decode else t // (step.block_m // group_p) + num_seqs, num_kv_heads, step.num_splits)
    _attention_kernel[grid](
        out, part_acc, part_max, part_sum, q, kv_cache, block_tables, seq_lens, query_start_loc,
        kv_scale if fp8 else seq_lens, scale * LOG2E, (softcap or 1.0) * LOG2E, window or 0, num_seqs, num_heads,
        step.num_splits,
        *q.stride(), *kv_cache.stride()[:4], block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_M=step.block_m, BLOCK_N=step.block_n, HEAD_DIM=dim, HEAD_P=head_p,
        BLOCK_SIZE=kv_cache.shape[2], SPLIT=split,
        PRECISION=float32_precision if q.dtype == torch.float32 else "tf32",  # ignored for 16-bit inputs
        FP8=fp8, SOFTCAP=softcap is not None, WINDOW=window is not None, DECODE=decode,
        ROW_LINES=pow2(-(-dim * kv_cache.element_size() // 128)), KV_LINE=128 // kv_cache.element_size(),
        num_warps=step.num_warps,
        **({} if step.num_stages is None else {"num_stages": step.num_stages}), **pdl_options(q.device),
    )
    if split:
        _reduce_splits_kernel[(t, num_heads)](out, part_acc, part_max, part_sum, num_heads, step.num_splits,
                                              HEAD_DIM=dim, HEAD_P=head_p, SPLITS_P=pow2(step.num_splits),
                                              num_warps=4, **pdl_options(q.device))
    return out


def split_workspace(num_tokens: int, num_heads: int, head_dim: int, num_splits: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 buffers for split partials: accumulators [T, Hq, S, HEAD_P], maxima and sums [T, Hq, S]."""
    shape = (num_tokens, num_heads, num_splits)
    return (torch.empty((*shape, pow2(head_dim, at_least=16)), dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device))
