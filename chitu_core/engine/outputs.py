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


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta holding what ``first`` and then ``later`` (two deltas of one request) hold: texts,
    token ids and logprobs joined per sample; finish state, stop reason and metrics from ``later``."""
    merged = {c.index: CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                        list(c.logprobs) if c.logprobs is not None else None, c.cumulative_logprob)
              for c in first.outputs}
    for c in later.outputs:
        m = merged.get(c.index)
        if m is None:
            merged[c.index] = c
            continue
        m.text += c.text
        m.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            m.logprobs = (m.logprobs or []) + c.logprobs
        m.finish_reason, m.stop_reason, m.cumulative_logprob = c.finish_reason, c.stop_reason, c.cumulative_logprob
    return RequestOutput(later.request_id, later.prompt, later.prompt_token_ids, [merged[i] for i in sorted(merged)],
                         later.finished, True, later.metrics)


@dataclass
class EngineStats:
    """Counters since the engine started, and the state now."""

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model (prefix-cache hits excluded)
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
