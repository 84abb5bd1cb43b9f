"""Prefill and mixed steps through the backend's graph runner: captured once per padded token count, replayed.

An eager step of a few hundred new tokens costs the host more than the device: the model's launches are
enqueued one by one from Python (one H200, Llama-3.1-8B config, one 128-token prompt: 34.7 ms eager, 8.5 ms
replayed; docs/benchmarks/nvidia-h200x2-prefill-graphs.md). So a step that is not a pure decode (whole or
partial prompts, decodes beside them or not) of at most ``max_tokens`` new tokens replays the graph of the
smallest bucket that holds them. Its inputs land in static device buffers: three host-to-device copies from
pinned staging memory (token rows: ids, positions, cache slots; sequence rows: lengths, cached lengths,
query starts; the block tables). The graph ends with the hidden states of its token rows, copied into one
buffer that every bucket shares; the runner computes the sampling rows' logits eagerly after it, as for an
eager step.

Padding: the bucket's rows past the step's T tokens form one more sequence after the B real ones, made of
them alone (nothing cached before, cache slots -1, so the cache write skips them; its keys come from
whatever valid blocks its stale block-table row names, so its outputs are finite, and ignored). The
sequence slots after it hold no tokens. A bucket of T rows has min(max_seqs, T) + 1 sequence slots, and
its attention is planned with T as ``max_query_len`` and the model's context (the largest bucket, if
longer) as ``max_seq_len``: upper bounds, which an attention backend that sets ``captures_prefill``
(contract 1.16) accepts. Staging memory cycles through two sets, as the decode graphs' does (``graphs.py``).
"""

import logging
import time
from collections.abc import Callable

import torch

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata
from chitu_core.backend import GraphRunner
from chitu_core.engine.graphs import _pinned
from chitu_core.engine.scheduler import ScheduledBatch
from chitu_core.engine.step_inputs import host_step
from chitu_core.layers.context import StepContext

log = logging.getLogger(__name__)

IDS, POSITIONS, SLOTS = range(3)  # token rows
LENS, CONTEXT, STARTS = range(3)  # sequence rows (STARTS has one more entry than the others)
SMALLEST = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 192, 256, 384, 512, 768, 1024 (steps of 1.5x and 2x), then steps of 512 (so that a
    larger step pads by 1/3 at most, where its compute grows with its tokens), and ``max_tokens`` itself;
    empty below 16 tokens."""
    if max_tokens < SMALLEST:
        return []
    sizes, size = [], SMALLEST
    while size < min(max_tokens, 1024):
        sizes.append(size)
        if size >= 128 and size * 3 // 2 < min(max_tokens, 1024):
            sizes.append(size * 3 // 2)
        size *= 2
    while size < max_tokens:
        sizes.append(size)
        size += 512
    return sizes + [max_tokens]


class PrefillGraphs:
    def __init__(self, model, attention: AttentionBackend, kv_caches: list[torch.Tensor], runner: GraphRunner,
                 max_tokens: int, max_seqs: int, max_seq_len: int, device: torch.device, pin_memory: bool):
        self.model, self.attention, self.kv_caches, self.runner = model, attention, kv_caches, runner
        self.sizes = prefill_buckets(max_tokens)
        # The padding's sequence may be longer than the model's context (a step of several prompts).
        self.max_seqs, self.max_seq_len, self.block_size = max_seqs, max(max_seq_len, max_tokens), attention.block_size
        rows, slots, width = self.sizes[-1], self.seq_slots(self.sizes[-1]), -(-self.max_seq_len // self.block_size)
        self.tokens = torch.zeros((3, rows), dtype=torch.int64, device=device)
        self.tokens[SLOTS] = -1
        self.seq = torch.zeros((3, slots + 1), dtype=torch.int32, device=device)
        self.tables = torch.zeros((slots, width), dtype=torch.int32, device=device)
        self.tables_in = torch.zeros(slots * width, dtype=torch.int32, device=device)
        self.staging = []
        for _ in range(2):
            tok, seq = _pinned((3, rows), torch.int64, pin_memory), _pinned((3, slots + 1), torch.int32, pin_memory)
            tables = _pinned(slots * width, torch.int32, pin_memory)
            self.staging.append((tok, seq, tables, tok.numpy(), seq.numpy(), tables.numpy()))
        self._turn = 0
        self.out: torch.Tensor | None = None  # the graphs' one output buffer, so that they keep no output of their own
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}

    def seq_slots(self, size: int) -> int:
        """Sequence slots of the bucket of ``size`` token rows: its most real sequences, and the padding's."""
        return min(self.max_seqs, size) + 1

    def capture(self) -> None:
        """Capture every bucket, largest first (so that the smaller ones fit in its memory)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._all_padding(size)
            self.replays[size] = self.runner.capture(self._step_fn(size))
        log.info("captured prefill graphs for steps of up to %s new tokens in %.1f s", self.sizes,
                 time.perf_counter() - start)

    def _all_padding(self, size: int) -> None:
        """Static inputs of a step with no real sequence (what a capture runs on): every row is padding."""
        self.tokens[IDS:POSITIONS + 1] = 0
        self.tokens[SLOTS] = -1
        self.seq.zero_()
        self.seq[LENS, 0] = size
        self.seq[STARTS, 1:] = size

    def _step_fn(self, size: int) -> Callable[[], torch.Tensor]:
        slots = self.seq_slots(size)
        meta = AttentionMetadata(
            slot_mapping=self.tokens[SLOTS, :size], block_tables=self.tables[:slots], seq_lens=self.seq[LENS, :slots],
            context_lens=self.seq[CONTEXT, :slots], query_start_loc=self.seq[STARTS, : slots + 1],
            max_query_len=size, max_seq_len=self.max_seq_len, block_size=self.block_size,
        )
        meta.backend_state = self.attention.prepare(meta)
        step = StepContext(meta, self.kv_caches)
        ids, positions = self.tokens[IDS, :size], self.tokens[POSITIONS, :size]

        def fn() -> torch.Tensor:
            hidden = self.model(ids, positions, step)
            if self.out is None:  # made by the first run, the largest bucket's warm-up: every graph writes into it
                self.out = torch.empty((self.sizes[-1], *hidden.shape[1:]), dtype=hidden.dtype, device=hidden.device)
            return self.out[:size].copy_(hidden)

        return fn

    def bucket(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` new tokens runs in, or None if it is too large."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def run(self, batch: ScheduledBatch, size: int) -> torch.Tensor:
        """The hidden states [T, H] of ``batch``'s T new tokens, from the graph of ``size`` rows. They live
        in the graphs' memory: the next replay may overwrite them."""
        h = host_step(batch, self.block_size)
        t, b, slots = h.num_tokens, len(batch.seqs), self.seq_slots(size)
        tok, seq, tables, host_tok, host_seq, host_tables = self.staging[self._turn]
        self._turn = (self._turn + 1) % len(self.staging)
        host_tok[IDS, :t] = h.ids
        host_tok[POSITIONS, :t] = h.positions.numpy()
        host_tok[SLOTS, :t] = h.slots.numpy()
        host_tok[IDS:POSITIONS + 1, t:size] = 0
        host_tok[SLOTS, t:size] = -1
        host_seq[LENS, :b] = h.seq_lens.numpy()
        host_seq[CONTEXT, :b] = h.context.numpy()
        host_seq[STARTS, : b + 1] = h.query_start.numpy()
        host_seq[LENS, b] = size - t  # the padding's sequence: its own rows only
        host_seq[LENS, b + 1 : slots] = 0
        host_seq[CONTEXT, b:slots] = 0
        host_seq[STARTS, b + 1 : slots + 1] = size
        self.tokens.copy_(tok, non_blocking=True)
        self.seq.copy_(seq, non_blocking=True)
        width = h.tables.shape[1]
        host_tables[: b * width] = h.tables.numpy().reshape(-1)
        landed = self.tables_in[: b * width]
        landed.copy_(tables[: b * width], non_blocking=True)
        self.tables[:b, :width].copy_(landed.view(b, width))
        return self.replays[size]().narrow(0, 0, t)
