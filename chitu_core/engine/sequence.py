"""A sequence: prompt and generated tokens, how many are in the KV cache, and its blocks."""

import enum
from dataclasses import dataclass, field

from chitu_core.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens not yet in the cache (the whole prompt, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt followed by output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
