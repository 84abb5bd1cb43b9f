"""The model runner: builds a step's inputs once, runs the model through the paged KV cache,
samples on the device and brings the results to the host in one copy."""

import time
from dataclasses import dataclass

import torch

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata
from chitu_core.engine.graphs import DecodeGraphs
from chitu_core.engine.scheduler import ScheduledBatch
from chitu_core.layers.context import StepContext
from chitu_core.sampling.sampler import Sampler, SamplingBatch


@dataclass
class StepResult:
    """What one sequence got from a step (only sequences that reached their last token sample)."""

    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


class ModelRunner:
    def __init__(self, model, attention: AttentionBackend, kv_caches: list[torch.Tensor], sampler: Sampler,
                 device: torch.device, vocab_size: int, eos_token_ids: set[int], synchronize=None):
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.sampler, self.device = sampler, device
        self.block_size = attention.block_size
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.synchronize = synchronize  # when set (profiling), called after the forward to time it
        self.last_forward_seconds = 0.0
        self.graphs: DecodeGraphs | None = None  # set by the engine where the backend captures graphs

    def graph_size(self, batch: ScheduledBatch) -> int | None:
        """The captured batch size this step replays, or None to run it eagerly: graphs serve
        steps in which every sequence brings exactly one token."""
        if self.graphs is None or any(n != 1 for n in batch.num_new_tokens):
            return None
        return self.graphs.bucket(len(batch.seqs))  # None past the largest

    def _to_device(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """token_ids and positions [T], and the step's attention metadata, built vectorized."""
        seqs, query_lens = batch.seqs, batch.num_new_tokens
        ids: list[int] = []
        for seq, n in zip(seqs, query_lens):
            ids.extend(seq.tokens(seq.num_computed_tokens, seq.num_computed_tokens + n))
        context = [s.num_computed_tokens for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        ctx = torch.tensor(context, dtype=torch.int64)
        seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        positions = torch.arange(len(ids)) - qsl[seq_idx] + ctx[seq_idx]
        slots = tables[seq_idx, positions // self.block_size].long() * self.block_size + positions % self.block_size
        seq_lens = ctx + q_lens
        meta = AttentionMetadata(
            slot_mapping=slots.to(self.device, non_blocking=True),
            block_tables=tables.to(self.device, non_blocking=True),
            seq_lens=seq_lens.to(torch.int32).to(self.device, non_blocking=True),
            context_lens=ctx.to(torch.int32).to(self.device, non_blocking=True),
            query_start_loc=qsl.to(torch.int32).to(self.device, non_blocking=True),
            max_query_len=max(query_lens),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
        )
        meta.backend_state = self.attention.prepare(meta)
        token_ids = self._to_device(ids, torch.int64)
        return token_ids, positions.to(self.device, non_blocking=True), meta

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[StepResult | None]:
        """One forward and sample. Returns, per scheduled sequence, its new token or None if it
        has not reached its last token yet (a partial prefill)."""
        size = self.graph_size(batch)
        if size is not None:
            start = time.perf_counter()
            logits = self.graphs.run(batch.seqs, size)
            sampling = list(range(len(batch.seqs)))
        else:
            if self.graphs is not None:
                self.graphs.invalidate()
            token_ids, positions, meta = self.prepare(batch)
            start = time.perf_counter()
            hidden = self.model(token_ids, positions, StepContext(meta, self.kv_caches))
            ends = [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)]
            sampling = [i for i, (s, end) in enumerate(zip(batch.seqs, ends)) if end == s.num_tokens]
            logits = None
            if sampling:
                last_rows = torch.tensor(batch.num_new_tokens).cumsum(0)[sampling] - 1
                logits = self.model.compute_logits(hidden[last_rows.to(self.device)])
        if self.synchronize is not None:
            self.synchronize()
            self.last_forward_seconds = time.perf_counter() - start
        if not sampling:
            return [None] * len(batch.seqs)
        seqs = [batch.seqs[i] for i in sampling]
        sbatch = SamplingBatch.build(
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [len(s.output_token_ids) for s in seqs],
            self.device,
            self.vocab_size,
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [self._banned(s) for s in seqs],
        )
        out = self.sampler(logits, sbatch)
        # One device-to-host copy for everything the host needs this step.
        if out.logprobs is None:
            host = out.tokens[:, None].tolist()
        else:
            parts = [out.tokens.double()[:, None], out.logprobs.double()[:, None], out.top_ids.double(),
                     out.top_logprobs.double()]
            host = torch.cat(parts, dim=1).tolist()
        results: list[StepResult | None] = [None] * len(batch.seqs)
        k = sbatch.max_logprobs or 0
        for row, i in enumerate(sampling):
            vals = host[row]
            result = StepResult(int(vals[0]))
            wanted = seqs[row].params.logprobs
            if wanted is not None:
                result.logprob = vals[1]
                result.top_logprobs = {int(t): lp for t, lp in zip(vals[2 : 2 + wanted], vals[2 + k : 2 + k + wanted])}
            results[i] = result
        return results

    def _banned(self, seq) -> list[int]:
        """Tokens that may not be sampled yet: EOS and stop tokens before min_tokens are out."""
        p = seq.params
        if len(seq.output_token_ids) >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
