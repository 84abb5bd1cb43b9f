"""The scheduler: which sequences run this step, and how many new tokens each computes.

There is no prefill phase and decode phase: every sequence has
``num_computed_tokens`` and ``num_tokens``, and a step computes the difference
for the sequences it picks. Running sequences go first, oldest first; when
the cache has no room for one, the newest running sequence is preempted (its
blocks are freed and it is recomputed later). Then waiting sequences are
admitted first-come first-served while the token budget, the sequence limit
and the free blocks allow.
"""

from collections import deque
from dataclasses import dataclass

from chitu_core.engine.block_manager import BlockManager
from chitu_core.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        needed = -(-(seq.num_tokens + seq.params.max_tokens) // self.blocks.block_size)
        if seq.num_tokens > self.max_num_batched_tokens or needed > self.blocks.num_blocks:
            raise ValueError(
                f"request {seq.seq_id}: {seq.num_tokens} prompt tokens plus max_tokens={seq.params.max_tokens} cannot fit "
                f"(token budget per step {self.max_num_batched_tokens}, KV cache {self.blocks.num_blocks} blocks of "
                f"{self.blocks.block_size}); shorten the prompt or max_tokens, or give the KV cache more memory"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens, seq.status = 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        seqs: list[Sequence] = []
        budget = self.max_num_batched_tokens
        running = list(self.running)
        while running:
            seq = running.pop(0)
            while not self.blocks.can_allocate(seq, seq.num_tokens):
                victim = running.pop() if running else seq
                self.running.remove(victim)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.allocate(seq, seq.num_tokens)
                seqs.append(seq)
                budget -= seq.num_new_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_new_tokens > budget or not self.blocks.can_allocate(seq, seq.num_tokens):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            budget -= seq.num_new_tokens
        return ScheduledBatch(seqs, [s.num_new_tokens for s in seqs])

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)
        self.blocks.free(seq)
