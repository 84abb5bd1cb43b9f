"""The scheduler: which sequences run this step, and how many new tokens each computes.

There is no prefill phase and no decode phase: every sequence has
``num_computed_tokens`` and ``num_tokens``, and a step computes part or all of
the difference for the sequences it picks, within a token budget
(``max_num_batched_tokens``), so long prompts are prefilled in chunks beside
running decodes.

Order is (priority, arrival): lower priority values first, first come first
served within a level. Running sequences are served first. When the cache has
no blocks for one, the running sequence last in that order (the newest of the
lowest priority) is preempted: its blocks are freed and it goes back to waiting,
to be recomputed (cheaply, if its prefix is still cached). A step that preempts
admits nobody. Otherwise waiting sequences are admitted in order while the
budget, ``max_num_seqs`` and the free blocks allow; a sample of an n > 1
request waits while a sibling is still computing the prompt's full blocks, so
that it finds them in the prefix cache.
"""

from bisect import insort
from dataclasses import dataclass

from chitu_core.engine.block_manager import BlockManager
from chitu_core.engine.sequence import Sequence, Status


def _key(seq: Sequence):
    return seq.sort_key


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]

    def __len__(self) -> int:
        return len(self.seqs)

    def part(self, rows: range) -> "ScheduledBatch":
        """The batch of ``rows`` (itself when they are all of it)."""
        if len(rows) == len(self.seqs):
            return self
        return ScheduledBatch(self.seqs[rows.start:rows.stop], self.num_new_tokens[rows.start:rows.stop])


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        needed = -(-(seq.num_tokens + seq.params.max_tokens) // self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise ValueError(
                f"{seq.num_tokens} prompt tokens plus max_tokens={seq.params.max_tokens} need {needed} KV blocks of "
                f"{self.blocks.block_size} tokens, but the cache has {self.blocks.num_blocks}; shorten the prompt or "
                f"max_tokens, or give the KV cache more memory"
            )
        seq.status = Status.WAITING
        insort(self.waiting, seq, key=_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens, seq.status = 0, Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        insort(self.waiting, seq, key=_key)

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        if not self.blocks.enable_prefix_caching:
            return False
        full = len(seq.prompt_token_ids) // self.blocks.block_size * self.blocks.block_size
        return any(s is not seq and s.status is Status.RUNNING and s.num_computed_tokens < full for s in seq.request.seqs)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        queue = list(self.running)
        preempted = False
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_new_tokens, budget)
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.blocks.allocate(seq, seq.num_computed_tokens + n)
                seqs.append(seq)
                counts.append(n)
                budget -= n
        j = 0
        while not preempted and j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            if self._sibling_prefilling(seq):
                j += 1
                continue
            if not seq.block_table:
                self.blocks.match_prefix(seq)
            n = min(seq.num_new_tokens, budget)
            if not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                self.blocks.unmatch(seq)
                break
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            del self.waiting[j]
            seq.status = Status.RUNNING
            insort(self.running, seq, key=_key)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (finished or aborted), wherever it is, and release its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.blocks.free(seq)
