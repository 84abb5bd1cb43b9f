"""Results returned to callers, in the shape vLLM users know.

The engine's ``step`` returns deltas (``RequestOutput.delta`` is True: text,
token ids and logprobs are only what is new since the last step); finished
requests are then available whole from ``LLMEngine.final_output``.
"""

from dataclasses import dataclass, field

from chitu_core.engine.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string), "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: token id -> log-probability
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    delta: bool = False
    metrics: RequestMetrics | None = None
