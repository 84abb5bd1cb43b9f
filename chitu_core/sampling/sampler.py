"""The batched sampler: one call per step for every sequence that emits a token, all on the device.

Greedy rows take ``greedy_sample``; the others go through temperature, top-k/top-p,
min-p and ``random_sample`` with counter-based noise (``noise``), so that a seeded
request samples the same tokens in any batch. Filters that no row uses are skipped.
"""

from dataclasses import dataclass

import torch

from chitu_core.ops.table import Ops
from chitu_core.sampling.noise import exponential_noise
from chitu_core.sampling.params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors, plus host flags to skip unused work."""

    temperature: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B]
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    seeds: torch.Tensor  # int64 [B]
    counters: torch.Tensor  # int64 [B], the number of tokens each row has sampled so far
    all_greedy: bool
    use_top_k_top_p: bool
    use_min_p: bool
    max_logprobs: int | None

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], counters: list[int], device: torch.device) -> "SamplingBatch":
        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=t([p.temperature for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.int64),
            top_p=t([p.top_p for p in params], torch.float32),
            min_p=t([p.min_p for p in params], torch.float32),
            seeds=t(seeds, torch.int64),
            counters=t(counters, torch.int64),
            all_greedy=all(p.greedy for p in params),
            use_top_k_top_p=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
            use_min_p=any(not p.greedy and p.min_p > 0 for p in params),
            max_logprobs=max(wanted) if wanted else None,
        )


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None  # float32 [B], the sampled tokens' log-probabilities
    top_ids: torch.Tensor | None  # int64 [B, K]
    top_logprobs: torch.Tensor | None  # float32 [B, K]


class Sampler:
    def __init__(self, ops: Ops):
        self.ops = ops

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: float32 [B, V] -> one token per row."""
        tokens = self.ops.greedy_sample(logits)
        if not batch.all_greedy:
            x = self.ops.apply_temperature(logits, batch.temperature)
            if batch.use_top_k_top_p:
                x = self.ops.apply_top_k_top_p(x, batch.top_k, batch.top_p)
            if batch.use_min_p:
                x = self.ops.apply_min_p(x, batch.min_p)
            noise = exponential_noise(batch.seeds, batch.counters, logits.shape[-1])
            sampled = self.ops.random_sample(x.softmax(dim=-1), noise)
            tokens = torch.where(batch.temperature > 0, sampled, tokens)
        if batch.max_logprobs is None:
            return SamplerOutput(tokens, None, None, None)
        logp = self.ops.log_softmax(logits)
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        top_lp, top_ids = logp.topk(batch.max_logprobs, dim=-1) if batch.max_logprobs else (logp[:, :0], tokens[:, None][:, :0])
        return SamplerOutput(tokens, chosen, top_ids, top_lp)
