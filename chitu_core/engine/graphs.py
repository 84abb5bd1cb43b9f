"""Decode steps through the backend's graph runner: captured once per padded batch size, replayed.

A decode step (every scheduled sequence brings one token) of B sequences runs the
graph captured for the smallest bucket >= B. The graphs read static device
buffers that each step refills with two host-to-device copies from pinned
staging memory: one packed int64 block (token ids, positions, cache slots,
sequence lengths) and the block tables. A continuation step takes its token ids
from the previous step's sampled tokens on the device instead. Staging memory
cycles through two sets (two per pipeline stage, whose groups' steps are in flight together), so
that filling step N+1's never overwrites what step N's copy, perhaps still queued, has yet to read
(the engine waits for step N before it launches step N+2 of the same group). Rows past B are padding: slot -1 (the
cache write skips it) and sequence length 1 (attention reads one real key), so
their outputs are finite and ignored. The graph ends with the logits of all its
rows; sampling runs eagerly on the first B.

Under pipeline parallelism a graph holds its stage's own computation only: a stage after the first
reads the previous stage's output from one more static buffer (the runner receives it and ``run``
copies it in), and a stage before the last ends with what the next stage takes, [2, size, H], which
the runner sends. No transfer between stages is captured.
"""

import logging
import time
from collections.abc import Callable

import torch

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata
from chitu_core.backend import GraphRunner
from chitu_core.distributed.pipeline import StageLink
from chitu_core.layers.context import StepContext

log = logging.getLogger(__name__)

IDS, POSITIONS, SLOTS, SEQ_LENS = range(4)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, then ``max_batch`` itself."""
    return [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]


def _pinned(shape, dtype, pin: bool) -> torch.Tensor:
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if pin else t


class DecodeGraphs:
    def __init__(self, model, attention: AttentionBackend, kv_caches: list[torch.Tensor], runner: GraphRunner,
                 max_batch: int, max_seq_len: int, device: torch.device, pin_memory: bool,
                 link: StageLink | None = None):
        self.model, self.attention, self.kv_caches, self.runner = model, attention, kv_caches, runner
        self.sizes = bucket_sizes(max_batch)
        self.max_seq_len, self.block_size = max_seq_len, attention.block_size
        rows, width = self.sizes[-1], -(-max_seq_len // attention.block_size)
        self.packed = torch.zeros((4, rows), dtype=torch.int64, device=device)
        self.packed[SLOTS] = -1
        self.packed[SEQ_LENS] = 1
        self.tables = torch.zeros((rows, width), dtype=torch.int32, device=device)
        self.tables_in = torch.zeros(rows * width, dtype=torch.int32, device=device)  # compact [B, w] landing
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)
        # The previous pipeline stage's output, [2, rows, H], on every stage but the first.
        self.intermediate = None if link is None or link.first else torch.zeros(
            (2, rows, link.hidden_size), dtype=link.dtype, device=device)
        self.last_stage = link is None or link.last
        # Sets of (packed, tables) pinned tensors with their numpy views, used in turn.
        self.staging = []
        for _ in range(2 * (1 if link is None else link.parallel.pp_size)):
            packed, tables = _pinned((4, rows), torch.int64, pin_memory), _pinned(rows * width, torch.int32, pin_memory)
            self.staging.append((packed, tables, packed.numpy(), tables.numpy()))
        self._turn = 0
        self._tables_key = None
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every bucket, largest first (so that the smaller ones fit in its memory)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self.replays[size] = self.runner.capture(self._step_fn(size))
        log.info("captured decode graphs for batch sizes %s in %.1f s", self.sizes, time.perf_counter() - start)

    def _step_fn(self, size: int) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(
            slot_mapping=self.packed[SLOTS, :size], block_tables=self.tables[:size], seq_lens=self.seq_lens[:size],
            context_lens=self.context_lens[:size], query_start_loc=self.query_start[: size + 1],
            max_query_len=1, max_seq_len=self.max_seq_len, block_size=self.block_size,
        )
        meta.backend_state = self.attention.prepare(meta)  # planned for the longest sequence
        step = StepContext(meta, self.kv_caches)
        packed, seq_lens, context_lens = self.packed, self.seq_lens, self.context_lens
        received = () if self.intermediate is None else (self.intermediate[:, :size],)

        def fn() -> torch.Tensor:
            seq_lens[:size].copy_(packed[SEQ_LENS, :size])
            torch.sub(packed[SEQ_LENS, :size], 1, out=context_lens[:size])
            hidden = self.model(packed[IDS, :size], packed[POSITIONS, :size], step, *received)
            return self.model.compute_logits(hidden) if self.last_stage else hidden

        return fn

    def bucket(self, batch_size: int) -> int | None:
        """The captured size a batch of ``batch_size`` decodes runs in, or None if it is too large."""
        return next((s for s in self.sizes if s >= batch_size), None)

    def invalidate(self) -> None:
        """Forget which block tables the device holds (an eager step may have changed any)."""
        self._tables_key = None

    def run(self, seqs, size: int, ids: torch.Tensor | None = None, intermediate: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Decode one token for each of ``seqs`` in the graph of ``size`` rows: their logits [B, V]
        (before the last pipeline stage: the next stage's input, [2, B, H]). ``ids``: the input
        tokens on the device (a continuation); else read from the sequences. ``intermediate``: the
        previous stage's output, [2, B, H] (every stage but the first).

        The result lives in the graphs' memory: the next replay may overwrite it. Several runs may
        be queued before the first is done (a pipeline's groups): each takes its own staging set, and
        the device copies into the static inputs are ordered after the previous replay."""
        b, bs = len(seqs), self.block_size
        positions = [s.num_computed_tokens for s in seqs]
        host_packed, host_tables, host, host_tables_np = self.staging[self._turn]
        self._turn = (self._turn + 1) % len(self.staging)
        if ids is None:
            host[IDS, :b] = [s.tokens(p, p + 1)[0] for s, p in zip(seqs, positions)]
        host[POSITIONS, :b] = positions
        host[SLOTS, :b] = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        host[SEQ_LENS, :b] = host[POSITIONS, :b] + 1
        host[IDS:POSITIONS + 1, b:size] = 0
        host[SLOTS, b:size] = -1
        host[SEQ_LENS, b:size] = 1
        self.packed.copy_(host_packed, non_blocking=True)
        if ids is not None:
            self.packed[IDS, :b].copy_(ids)
        if intermediate is not None:
            self.intermediate[:, :b].copy_(intermediate)
        # Tables only grow (a block appended) between eager steps: copy them when one did.
        key = tuple((s.seq_id, len(s.block_table), s.block_table[-1]) for s in seqs)
        if key != self._tables_key:
            width = max(len(s.block_table) for s in seqs)
            tables = host_tables_np[: b * width].reshape(b, width)
            tables[:] = 0
            for row, s in zip(tables, seqs):
                row[: len(s.block_table)] = s.block_table
            landed = self.tables_in[: b * width]
            landed.copy_(host_tables[: b * width], non_blocking=True)
            self.tables[:b, :width].copy_(landed.view(b, width))
            self._tables_key = key
        return self.replays[size]().narrow(-2, 0, b)
