"""A step's inputs on the host, built vectorized once: the eager path moves them to the device as they
are, the prefill graphs copy them into their static buffers."""

from dataclasses import dataclass

import torch

from chitu_core.engine.scheduler import ScheduledBatch


@dataclass
class HostStep:
    """B sequences bringing T new tokens in all, in batch order."""

    ids: list[int] | None  # [T] the new tokens (None: the caller has them on the device)
    positions: torch.Tensor  # int64 [T] each token's position in its sequence
    slots: torch.Tensor  # int64 [T] each token's cache slot, block_id * block_size + offset
    tables: torch.Tensor  # int32 [B, w] block tables, zero-padded to the longest
    context: torch.Tensor  # int64 [B] tokens cached before the step
    query_start: torch.Tensor  # int64 [B + 1] where each sequence's tokens start among the T
    seq_lens: torch.Tensor  # int64 [B] tokens cached after the step
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def host_step(batch: ScheduledBatch, block_size: int, with_ids: bool = True) -> HostStep:
    """The inputs of ``batch``; ``with_ids`` False leaves out the token ids (a continuation has them)."""
    seqs, query_lens = batch.seqs, batch.num_new_tokens
    ids = None
    if with_ids:
        ids = []
        for seq, n in zip(seqs, query_lens):
            ids.extend(seq.tokens(seq.num_computed_tokens, seq.num_computed_tokens + n))
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=qsl[1:])
    ctx = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.int64)
    seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
    positions = torch.arange(int(qsl[-1])) - qsl[seq_idx] + ctx[seq_idx]
    slots = tables[seq_idx, positions // block_size].long() * block_size + positions % block_size
    return HostStep(ids, positions, slots, tables, ctx, qsl, ctx + q_lens, max(query_lens))
