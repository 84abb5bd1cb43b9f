"""The "moe align" of ``fused_experts``: token slots sorted by expert, each expert's run padded to BLOCK_M rows.

A slot is one (token, k) pair, numbered ``t * top_k + j`` over the S = T * top_k slots. ``align`` returns

  sorted_slots  int32 [P]: slot numbers grouped by expert (ascending slot number within an expert), each
                expert's run padded with the value S up to a multiple of BLOCK_M; rows past the last run
                are never read. Slots of negative ids (routed to no expert held here) appear nowhere.
  block_expert  int32 [P // BLOCK_M]: the expert of each BLOCK_M-row block, -1 past the last run.

P = ``padded_size(S, E, BLOCK_M)``, the bound S + min(E, S) * (BLOCK_M - 1) rounded up to BLOCK_M:
every size comes from T, top_k, E and BLOCK_M, so no value on the device decides a shape, nothing is
copied to the host, and the launch sequence can be captured in a device graph. A counting sort in
four kernels, deterministic (no atomics): per chunk of CHUNK slots, a histogram of its experts
(``_count_kernel``); per expert, an exclusive scan of those counts over the chunks
(``_scan_kernel``); one program for each expert's padded start, its padding rows and the block ->
expert table (``_starts_kernel``); per chunk, each slot's row (``_place_kernel``).
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import pow2

ONE_HOT = 16384  # elements of a chunk's [CHUNK, E] one-hot matrix, the register budget of a program


def padded_size(slots: int, experts: int, block_m: int) -> int:
    """Rows of ``sorted_slots``: at most min(E, S) experts are hit, each padded by fewer than BLOCK_M rows."""
    return triton.cdiv(slots + min(experts, slots) * (block_m - 1), block_m) * block_m


@triton.jit
def _one_hot(ids_ptr, chunk, slots, stride_t, stride_k, top_k, CHUNK: tl.constexpr, EXPERTS_P: tl.constexpr):
    """The chunk's slot numbers and their [CHUNK, EXPERTS_P] one-hot expert matrix (no row for slots out of
    range or of negative ids)."""
    slot = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = slot < slots
    ids = tl.load(ids_ptr + (slot // top_k).to(tl.int64) * stride_t + (slot % top_k) * stride_k, mask=ok, other=-1)
    return slot, ids[:, None] == tl.arange(0, EXPERTS_P)[None, :]


@triton.jit(do_not_specialize=["slots"])
def _count_kernel(counts, ids_ptr, slots, stride_t, stride_k, top_k,
                  CHUNK: tl.constexpr, EXPERTS_P: tl.constexpr):
    chunk = tl.program_id(0)
    _, hot = _one_hot(ids_ptr, chunk, slots, stride_t, stride_k, top_k, CHUNK, EXPERTS_P)
    tl.store(counts + chunk * EXPERTS_P + tl.arange(0, EXPERTS_P), tl.sum(hot.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["num_chunks"])
def _scan_kernel(counts, totals, num_chunks, EXPERTS_P: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """counts[c, e] becomes the number of slots of expert e in chunks before c; totals[e] the sum."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        ptrs = counts + chunks[:, None] * EXPERTS_P + experts[None, :]
        ok = (chunks[:, None] < num_chunks) & (experts[None, :] < EXPERTS_P)
        tile = tl.load(ptrs, mask=ok, other=0)
        inclusive = tl.cumsum(tile, axis=0)
        tl.store(ptrs, inclusive - tile + running[None, :], mask=ok)
        running += tl.sum(tile, axis=0)
    tl.store(totals + experts, running)


@triton.jit(do_not_specialize=["slots", "num_blocks"])
def _starts_kernel(starts, totals, sorted_slots, block_expert, slots, num_experts, num_blocks,
                   EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    experts = tl.arange(0, EXPERTS_P)
    count = tl.load(totals + experts)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    start = ends - padded
    tl.store(starts + experts, start)
    pad = tl.arange(0, BLOCK_M)  # padding rows of each run, filled with the slot count S
    tl.store(sorted_slots + (start + count)[:, None] + pad[None, :], tl.zeros((EXPERTS_P, BLOCK_M), tl.int32) + slots,
             mask=(count[:, None] + pad[None, :]) < padded[:, None])
    ends = tl.where(experts < num_experts, ends, 2147483647)
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert + blocks, tl.where(expert < num_experts, expert, -1), mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["slots"])
def _place_kernel(sorted_slots, counts, starts, ids_ptr, slots, stride_t, stride_k, top_k,
                  CHUNK: tl.constexpr, EXPERTS_P: tl.constexpr):
    chunk = tl.program_id(0)
    slot, hot = _one_hot(ids_ptr, chunk, slots, stride_t, stride_k, top_k, CHUNK, EXPERTS_P)
    hot = hot.to(tl.int32)
    experts = tl.arange(0, EXPERTS_P)
    base = tl.load(starts + experts) + tl.load(counts + chunk * EXPERTS_P + experts)
    # A slot's row: its expert's base for this chunk plus the slots of that expert before it in the chunk.
    row = tl.sum(hot * (base[None, :] + tl.cumsum(hot, axis=0) - 1), axis=1)
    tl.store(sorted_slots + row, slot, mask=tl.sum(hot, axis=1) > 0)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids: int [T, top_k] (any strides) -> (sorted_slots int32 [P], block_expert int32 [P // block_m])."""
    num_tokens, top_k = topk_ids.shape
    slots, device = num_tokens * top_k, topk_ids.device
    experts_p = pow2(num_experts)
    chunk = max(16, min(1024, ONE_HOT // experts_p))
    num_chunks = triton.cdiv(slots, chunk)
    size = padded_size(slots, num_experts, block_m)
    sorted_slots = torch.empty(size, dtype=torch.int32, device=device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=device)
    if slots == 0:
        return sorted_slots, block_expert
    counts = torch.empty((num_chunks, experts_p), dtype=torch.int32, device=device)
    totals = torch.empty(experts_p, dtype=torch.int32, device=device)
    starts = torch.empty(experts_p, dtype=torch.int32, device=device)
    strides = (topk_ids.stride(0), topk_ids.stride(1), top_k)
    _count_kernel[(num_chunks,)](counts, topk_ids, slots, *strides, CHUNK=chunk, EXPERTS_P=experts_p)
    block_e = min(experts_p, 32)
    _scan_kernel[(experts_p // block_e,)](counts, totals, num_chunks, EXPERTS_P=experts_p, BLOCK_E=block_e,
                                          BLOCK_C=min(64, pow2(num_chunks)))
    _starts_kernel[(1,)](starts, totals, sorted_slots, block_expert, slots, num_experts, size // block_m,
                         EXPERTS_P=experts_p, BLOCK_M=block_m, BLOCK_B=max(16, min(256, 16384 // experts_p)))
    _place_kernel[(num_chunks,)](sorted_slots, counts, starts, topk_ids, slots, *strides, CHUNK=chunk,
                                 EXPERTS_P=experts_p)
    return sorted_slots, block_expert
