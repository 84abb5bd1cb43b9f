"""Sequences and requests. A request holds its n samples, each a Sequence with its own tokens and blocks."""

import enum
import time
from dataclasses import dataclass, field

from chitu_core.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not field equality: sequences are mutable entities
class Sequence:
    """One sample of a request: prompt and output tokens, cache progress, blocks.

    ``num_computed_tokens`` tokens have their keys and values in the cache; the
    rest (``num_new_tokens``) are what the next steps compute. Prefill and decode
    are not states: a fresh prompt just has many new tokens, a decoding sequence one.
    """

    seq_id: int
    request: "Request"
    index: int  # which of the request's n samples
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks (memo)
    num_cached_blocks: int = 0  # leading blocks already entered in the prefix cache
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    detokenizer: object = None
    num_preemptions: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority (lower first), then arrival, then sample index."""
        return (self.request.priority, self.request.arrival, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt followed by output."""
        prompt = self.request.prompt_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return prompt[start:] + self.output_token_ids[: end - n]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic) of a request's milestones, and its counts."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0  # prompt tokens the model computed (not found in the prefix cache)
    num_output_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (per sample, over all samples' tokens)."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens <= 1:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int  # arrival order, for FCFS
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
