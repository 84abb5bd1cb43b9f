"""The batched sampler: one call per step for every sequence that emits a token, all on the device.

Each row's logit_bias is added first; then banned tokens (EOS and stop tokens before
``min_tokens``) and the tokens a row's grammar does not allow (structured output, a packed
bitmask from ``grammar``) are set to -inf; then the repetition/frequency/presence penalties
apply, to greedy rows too (as vLLM). Greedy rows then
take ``greedy_sample``; the others go through temperature, top-k/top-p, min-p and
``random_sample`` with counter-based noise (``noise``), so that a seeded request samples the same
tokens in any batch. Work that no row needs is skipped on host flags.
"""

from dataclasses import dataclass
from itertools import chain

import torch

from chitu_core.ops.table import Ops
from chitu_core.sampling.grammar import unpack_bitmask
from chitu_core.sampling.noise import exponential_noise
from chitu_core.sampling.params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors, plus host flags to skip unused work.

    The penalty tensors are None unless some row uses a penalty, ``banned`` unless some row
    has banned tokens; their [B, V] tables are built on the device in a few vectorized ops.
    """

    all_greedy: bool
    use_top_k_top_p: bool
    use_min_p: bool
    max_logprobs: int | None
    temperature: torch.Tensor | None = None  # float32 [B]; these six are None when all rows are greedy
    top_k: torch.Tensor | None = None  # int64 [B]
    top_p: torch.Tensor | None = None  # float32 [B]
    min_p: torch.Tensor | None = None  # float32 [B]
    seeds: torch.Tensor | None = None  # int64 [B]
    counters: torch.Tensor | None = None  # int64 [B], the number of tokens each row has sampled so far
    repetition: torch.Tensor | None = None  # float32 [B]
    frequency: torch.Tensor | None = None  # float32 [B]
    presence: torch.Tensor | None = None  # float32 [B]
    prompt_mask: torch.Tensor | None = None  # bool [B, V]: the token is in the row's prompt
    output_counts: torch.Tensor | None = None  # int32 [B, V]: its occurrences in the row's output
    banned: torch.Tensor | None = None  # bool [B, V]: the row must not sample the token this step
    bias: torch.Tensor | None = None  # float32 [B, V]: logit_bias, added to the logits
    allowed: torch.Tensor | None = None  # int32 [B, ceil(V / 32)]: grammar bitmask, bit set = allowed

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        counters: list[int],
        device: torch.device,
        vocab_size: int,
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        banned_ids: list[list[int]],
        pending: torch.Tensor | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> "SamplingBatch":
        """One row per entry of ``params``. prompt_ids / output_ids: each row's prompt and output
        tokens so far (read only for rows that use a penalty), ids in [0, vocab_size);
        banned_ids: the tokens each row may not sample this step (ids outside the vocabulary
        cannot be sampled anyway and are ignored); pending: int64 [rows] on the device, a token
        each row has sampled that is not in ``output_ids`` yet (async scheduling), or None;
        bitmask: the rows' grammar bitmask on the host (``grammar.Constraints.bitmask``), or None
        when no row is constrained: one copy to the device."""

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        rows = len(params)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(p.greedy for p in params)
        batch = cls(
            all_greedy=all_greedy,
            use_top_k_top_p=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
            use_min_p=any(not p.greedy and p.min_p > 0 for p in params),
            max_logprobs=max(wanted) if wanted else None,
        )
        if not all_greedy:  # greedy rows read none of these: an all-greedy step copies nothing
            batch.temperature = t([p.temperature for p in params], torch.float32)
            batch.top_k = t([p.top_k for p in params], torch.int64)
            batch.top_p = t([p.top_p for p in params], torch.float32)
            batch.min_p = t([p.min_p for p in params], torch.float32)
            batch.seeds = t(seeds, torch.int64)
            batch.counters = t(counters, torch.int64)
        penalized = [i for i, p in enumerate(params) if p.uses_penalties]
        if penalized:  # rows without penalties keep empty tables: their penalties are neutral
            batch.repetition = t([p.repetition_penalty for p in params], torch.float32)
            batch.frequency = t([p.frequency_penalty for p in params], torch.float32)
            batch.presence = t([p.presence_penalty for p in params], torch.float32)
            batch.prompt_mask = _token_table(prompt_ids, penalized, rows, vocab_size, device, "prompt_ids")
            batch.output_counts = _token_table(output_ids, penalized, rows, vocab_size, device, "output_ids", count=True)
            if pending is not None:  # rows without penalties count it too, to no effect
                batch.output_counts.scatter_add_(1, pending[:, None], torch.ones_like(pending[:, None], dtype=torch.int32))
        banning = [i for i, ids in enumerate(banned_ids) if ids]
        if banning:
            batch.banned = _token_table(banned_ids, banning, rows, vocab_size, device, None)
        if any(p.logit_bias for p in params):
            batch.bias = _bias_table(params, rows, vocab_size, device)
        if bitmask is not None:
            batch.allowed = bitmask.to(device, non_blocking=True)
        return batch


def _bias_table(params: list[SamplingParams], rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """float32 [rows, vocab_size] on the device: each row's logit_bias, zero elsewhere (ids
    outside the vocabulary are ignored: the engine refuses them when the request is added)."""
    entries = [(r * vocab_size + t, b) for r, p in enumerate(params) for t, b in p.logit_bias.items() if t < vocab_size]
    index = torch.tensor([i for i, _ in entries], dtype=torch.int64).to(device, non_blocking=True)
    values = torch.tensor([b for _, b in entries], dtype=torch.float32).to(device, non_blocking=True)
    return torch.zeros(rows * vocab_size, dtype=torch.float32, device=device).index_put_((index,), values).view(rows, vocab_size)


def _token_table(ids: list[list[int]], read: list[int], rows: int, vocab_size: int, device: torch.device,
                 name: str | None, count: bool = False) -> torch.Tensor:
    """[rows, vocab_size] on the device: bool, True where ``ids[row]`` holds the token, or with
    ``count`` int32, how many times. Only rows in ``read`` are read; the others stay empty. A token
    outside [0, vocab_size) is an error naming ``name``, or ignored if ``name`` is None."""
    # One flat index (row * vocab_size + token) built on the host, one copy, one scatter.
    lengths = torch.tensor([len(ids[r]) for r in read], dtype=torch.int64)
    tokens = torch.tensor(list(chain.from_iterable(ids[r] for r in read)), dtype=torch.int64)
    starts = torch.repeat_interleave(torch.tensor(read, dtype=torch.int64) * vocab_size, lengths)
    inside = (tokens >= 0) & (tokens < vocab_size)
    if not bool(inside.all()):
        if name is not None:
            raise ValueError(f"{name} holds a token id outside [0, {vocab_size})")
        starts, tokens = starts[inside], tokens[inside]
    index = (starts + tokens).to(device, non_blocking=True)
    if count:
        table = torch.zeros(rows * vocab_size, dtype=torch.int32, device=device)
        table.index_add_(0, index, torch.ones(index.shape, dtype=torch.int32, device=device))
    else:
        table = torch.zeros(rows * vocab_size, dtype=torch.bool, device=device).index_fill_(0, index, True)
    return table.view(rows, vocab_size)


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
        """logits: [B, V], float32 or 16-bit -> one token per row.

        Log-probabilities (``logprobs``, ``top_logprobs``) are those of the raw logits: before
        logit_bias, bans, the grammar's mask, penalties, temperature and filters. Everything but a plain greedy pick runs in
        float32 (the upcast is exact, so greedy tokens are the same either way)."""
        plain_greedy = (batch.all_greedy and batch.banned is None and batch.prompt_mask is None
                        and batch.max_logprobs is None and batch.bias is None and batch.allowed is None)
        if not plain_greedy:
            logits = logits.float()
        x = logits
        if batch.bias is not None:
            x = x + batch.bias
        if batch.banned is not None:
            x = x.masked_fill(batch.banned, float("-inf"))
        if batch.allowed is not None:
            x = x.masked_fill(~unpack_bitmask(batch.allowed, x.shape[-1]), float("-inf"))
        if batch.prompt_mask is not None:
            x = self.ops.apply_penalties(
                x, batch.prompt_mask, batch.output_counts, batch.repetition, batch.frequency, batch.presence
            )
        tokens = self.ops.greedy_sample(x)
        if not batch.all_greedy:
            x = self.ops.apply_temperature(x, batch.temperature)
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
