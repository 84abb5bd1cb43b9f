"""Sizing the KV cache from a profiled largest step (``gpu_memory_utilization``).

Before the cache exists, the engine runs the largest step it will ever schedule
(``max_num_batched_tokens`` new tokens, in sequences no longer than the model's
context, and the logits of as many rows as a step samples) against a one-block
stand-in cache whose writes are skipped (slot -1). The backend reports the
peak memory the process held meanwhile; the cache gets the rest of the share.
"""

import torch

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata
from chitu_core.distributed.pipeline import StageLink
from chitu_core.layers.context import StepContext


@torch.inference_mode()
def largest_step(model, attention: AttentionBackend, num_layers: int, num_tokens: int, max_seq_len: int,
                 num_rows: int, device: torch.device, link: StageLink | None = None) -> None:
    """One forward of ``num_tokens`` tokens in sequences of at most ``max_seq_len``, then the logits
    of ``num_rows`` rows. Touches no real cache: every sequence reads block 0 of a stand-in.
    ``num_layers``: the whole model's. A pipeline stage runs its own part alone, on zeros where it
    would receive from the previous stage; only the last computes logits."""
    lens = [max_seq_len] * (num_tokens // max_seq_len) + ([num_tokens % max_seq_len] if num_tokens % max_seq_len else [])
    bs = attention.block_size
    width = -(-max(lens) // bs)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(seq_lens, 0, out=qsl[1:])
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros((len(lens), width), dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(device), context_lens=torch.zeros(len(lens), dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device), max_query_len=max(lens), max_seq_len=max(lens), block_size=bs,
    )
    meta.backend_state = attention.prepare(meta)
    stand_in = attention.allocate_kv_cache(1)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    token_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    received = () if link is None or link.first else (
        torch.zeros((2, num_tokens, link.hidden_size), dtype=link.dtype, device=device),)
    hidden = model(token_ids, positions, StepContext(meta, [stand_in] * num_layers), *received)
    if link is not None and not link.last:
        return
    rows = torch.arange(min(num_rows, num_tokens), device=device)
    model.compute_logits(hidden[rows]).float().softmax(dim=-1)  # as a sampling step upcasts them


def added_peak(backend, index: int, fn) -> int:
    """What running ``fn`` adds to the device memory held at rest (``Backend.measure_peak_memory`` of ``fn``
    less that of nothing), or 0 where the backend cannot measure it."""
    idle = backend.measure_peak_memory(lambda: None, index)
    peak = None if idle is None else backend.measure_peak_memory(fn, index)
    return 0 if peak is None else max(0, peak - idle)


def kv_budget_from_profile(total_bytes: int, utilization: float, peak_bytes: int, reserve_bytes: int) -> int:
    """What is left for the KV cache of ``utilization`` of ``total_bytes`` after the profiled peak
    and a reserve (decode graphs, sampling tables); may be negative (the caller says why)."""
    return int(total_bytes * utilization) - peak_bytes - reserve_bytes
