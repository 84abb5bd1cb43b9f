"""The model runner: builds a step's inputs once, runs the model through the paged KV cache,
samples on the device and brings the results to the host in one copy.

``launch`` queues a step's device work and returns at once with a ``PendingStep``:
its sampled tokens stay on the device (a following step can take them as input
before the host has seen them) while one asynchronous copy brings them to the
host; ``PendingStep.results`` waits for that copy."""

import time
from dataclasses import dataclass

import torch

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata
from chitu_core.distributed.parallel import Parallel
from chitu_core.distributed.pipeline import StageLink
from chitu_core.engine.graphs import DecodeGraphs
from chitu_core.engine.prefill_graphs import PrefillGraphs
from chitu_core.engine.scheduler import ScheduledBatch
from chitu_core.engine.step_inputs import host_step
from chitu_core.layers.context import StepContext
from chitu_core.sampling.grammar import Constraints
from chitu_core.sampling.sampler import Sampler, SamplingBatch


@dataclass
class StepResult:
    """What one sequence got from a step (only sequences that reached their last token sample)."""

    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


class PendingStep:
    """A launched step of ``batch``. ``tokens``: the sampled token of each sampling row, on the device.

    Under pipeline parallelism the tokens reach every rank by a broadcast from the last stage that is
    still in flight when ``launch`` returns (so that a stage can go on to another group's step):
    ``land`` (done by ``tokens`` and ``results``) orders the device after it and starts the host's copy."""

    def __init__(self, batch: ScheduledBatch, sampling: list[int], wanted: list[int | None], k: int,
                 tokens: torch.Tensor | None, host: torch.Tensor | None, event, landing=None):
        self.batch, self.sampling, self.wanted, self.k = batch, sampling, wanted, k
        self._tokens, self.host, self.event = tokens, host, event
        self._landing = landing  # (the broadcast in flight, the tensor it fills, the backend's completion_event)

    @property
    def tokens(self) -> torch.Tensor | None:
        self.land()
        return self._tokens

    def land(self) -> None:
        """Where a broadcast brings the tokens: wait for it (on a device with streams, the current
        stream waits; the host does not) and queue the copy to the host."""
        if self._landing is None:
            return
        transfer, packed, new_event = self._landing
        self._landing = None
        transfer.wait()
        self._tokens = packed[:, 0].long()
        self.host = packed.to("cpu", non_blocking=True)
        self.event = new_event()

    def results(self) -> list[StepResult | None]:
        """Per scheduled row, its new token, or None if it has not reached its last token yet (a
        partial prefill). Waits for the step's device-to-host copy."""
        results: list[StepResult | None] = [None] * len(self.batch.seqs)
        if not self.sampling:
            return results
        self.land()
        if self.event is not None:
            self.event.synchronize()
        host, k = self.host.tolist(), self.k
        for row, i in enumerate(self.sampling):
            vals = host[row]
            result = StepResult(int(vals[0]))
            wanted = self.wanted[row]
            if wanted is not None:
                result.logprob = vals[1]
                result.top_logprobs = {int(t): lp for t, lp in zip(vals[2 : 2 + wanted], vals[2 + k : 2 + k + wanted])}
            results[i] = result
        return results


class ModelRunner:
    def __init__(self, model, attention: AttentionBackend, kv_caches: list[torch.Tensor], sampler: Sampler,
                 device: torch.device, vocab_size: int, eos_token_ids: set[int], synchronize=None, new_event=None):
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.new_event = new_event or (lambda: None)  # the backend's completion_event
        self.sampler, self.device = sampler, device
        self.block_size = attention.block_size
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.synchronize = synchronize  # when set (profiling), called after the forward to time it
        self.last_forward_seconds = 0.0
        self.graphs: DecodeGraphs | None = None  # set by the engine where the backend captures graphs
        self.prefill_graphs: PrefillGraphs | None = None  # set by the engine where the attention allows them
        self.constraints: Constraints | None = None  # set by the engine with its first structured-output request
        self.parallel: Parallel | None = None  # set by the engine with ``link`` under pipeline parallelism
        self.link: StageLink | None = None  # this rank's ends of the pipeline; only the last stage samples
        self._forward_start: float | None = None  # when this step's first forward began (profiling)

    def graph_size(self, batch: ScheduledBatch) -> int | None:
        """The captured batch size this step replays, or None to run it eagerly: graphs serve
        steps in which every sequence brings exactly one token."""
        if self.graphs is None or any(n != 1 for n in batch.num_new_tokens):
            return None
        return self.graphs.bucket(len(batch.seqs))  # None past the largest

    def prefill_size(self, batch: ScheduledBatch, ids: torch.Tensor | None) -> int | None:
        """The captured token count a step that is not a pure decode replays (``prefill_graphs``), or
        None to run it eagerly: no prefill graphs, a continuation (its ids are on the device), or too many
        new tokens."""
        if self.prefill_graphs is None or ids is not None:
            return None
        return self.prefill_graphs.bucket(sum(batch.num_new_tokens))

    def _to_device(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch, ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """token_ids and positions [T], and the step's attention metadata, built vectorized.
        ``ids``: the token ids already on the device (a continuation, one token per sequence)."""
        h = host_step(batch, self.block_size, with_ids=ids is None)
        if ids is None:
            ids = self._to_device(h.ids, torch.int64)
        meta = AttentionMetadata(
            slot_mapping=h.slots.to(self.device, non_blocking=True),
            block_tables=h.tables.to(self.device, non_blocking=True),
            seq_lens=h.seq_lens.to(torch.int32).to(self.device, non_blocking=True),
            context_lens=h.context.to(torch.int32).to(self.device, non_blocking=True),
            query_start_loc=h.query_start.to(torch.int32).to(self.device, non_blocking=True),
            max_query_len=h.max_query_len,
            max_seq_len=int(h.seq_lens.max()),
            block_size=self.block_size,
        )
        meta.backend_state = self.attention.prepare(meta)
        return ids, h.positions.to(self.device, non_blocking=True), meta

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, ids: torch.Tensor | None = None, ahead: int = 0) -> PendingStep:
        """Queue one forward and sample. ``ids``: for a continuation, each sequence's input token on
        the device (the previous step's ``tokens``); ``ahead``: tokens each sequence has sampled that
        the host has not appended yet (they count for seeds and ``min_tokens``). A sequence with a
        grammar is never launched ahead: its mask needs its previous token accepted.

        Under pipeline parallelism this runs the stage's own part; the last stage samples and every
        rank takes its tokens (the engine keeps several groups' steps in flight, ``pipeline``)."""
        self._forward_start = None
        sampling, logits = self._forward(batch, ids, ahead)
        if self.synchronize is not None:
            self.synchronize()
            self.last_forward_seconds = time.perf_counter() - self._forward_start
        if not sampling:
            return PendingStep(batch, [], [], 0, None, None, None)
        seqs = [batch.seqs[i] for i in sampling]
        if not self.samples_here:
            return self._receive_sampled(batch, sampling, seqs)
        sbatch = SamplingBatch.build(
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [len(s.output_token_ids) + ahead for s in seqs],
            self.device,
            self.vocab_size,
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [self._banned(s, ahead) for s in seqs],
            ids if ahead else None,
            self.constraints.bitmask([s.seq_id for s in seqs]) if self.constraints is not None else None,
        )
        out = self.sampler(logits, sbatch)
        # One device-to-host copy for everything the host needs this step, not waited for here.
        tokens = out.tokens
        if out.logprobs is None:
            packed = out.tokens[:, None]
        else:
            packed = torch.cat([out.tokens.double()[:, None], out.logprobs.double()[:, None], out.top_ids.double(),
                                out.top_logprobs.double()], dim=1)
        wanted = [s.params.logprobs for s in seqs]
        if self.link is not None:  # every stage's scheduler needs them; the sampler rank's are the truth
            transfer = self.parallel.world.broadcast_async(packed, self.parallel.sampler_rank)
            return PendingStep(batch, sampling, wanted, sbatch.max_logprobs or 0, None, None, None,
                               (transfer, packed, self.new_event))
        host = packed.to("cpu", non_blocking=True)  # lands in page-locked memory where the copy is asynchronous
        return PendingStep(batch, sampling, wanted, sbatch.max_logprobs or 0, tokens, host, self.new_event())

    def _forward(self, batch: ScheduledBatch, ids: torch.Tensor | None, ahead: int
                 ) -> tuple[list[int], torch.Tensor | None]:
        """This stage's forward of ``batch``: the rows that sample (those reaching their last token)
        and, on the last stage, their logits. A stage after the first receives its input first; a
        stage before the last starts sending its output on."""
        link = self.link
        size = self.graph_size(batch)
        if size is not None:
            received = None if link is None or link.first else link.receive(len(batch.seqs))
            self._forward_start = self._forward_start or time.perf_counter()
            out = self.graphs.run(batch.seqs, size, ids, received)
            sampling = list(range(len(batch.seqs)))
            if link is not None and not link.last:
                link.send(out.clone(memory_format=torch.contiguous_format))  # the next replay reuses out
                return sampling, None
            return sampling, out
        if self.graphs is not None:
            self.graphs.invalidate()
        size = self.prefill_size(batch, ids)
        if size is not None:
            self._forward_start = self._forward_start or time.perf_counter()
            hidden = self.prefill_graphs.run(batch, size)
        else:
            token_ids, positions, meta = self.prepare(batch, ids)
            # A model outside a pipeline may take the contract's three arguments only.
            received = () if link is None or link.first else (link.receive(token_ids.shape[0]),)
            self._forward_start = self._forward_start or time.perf_counter()
            hidden = self.model(token_ids, positions, StepContext(meta, self.kv_caches), *received)
        ends = [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)]
        sampling = [i for i, (s, end) in enumerate(zip(batch.seqs, ends)) if end == s.num_tokens + ahead]
        if link is not None and not link.last:
            link.send(hidden)
            return sampling, None
        if not sampling:
            return sampling, None
        last_rows = torch.tensor(batch.num_new_tokens).cumsum(0)[sampling] - 1
        return sampling, self.model.compute_logits(hidden[last_rows.to(self.device)])

    @property
    def samples_here(self) -> bool:
        """Whether this rank computes logits and samples: every rank but those of earlier pipeline stages."""
        return self.link is None or self.link.last

    def _receive_sampled(self, batch: ScheduledBatch, sampling: list[int], seqs) -> PendingStep:
        """On an earlier pipeline stage: the last stage's sampled rows (as it packs them), by broadcast."""
        wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        k = max(wanted) if wanted else None
        shape, dtype = ((len(seqs), 1), torch.int64) if k is None else ((len(seqs), 2 + 2 * k), torch.float64)
        packed = torch.empty(shape, dtype=dtype, device=self.device)
        transfer = self.parallel.world.broadcast_async(packed, self.parallel.sampler_rank)
        return PendingStep(batch, sampling, [s.params.logprobs for s in seqs], k or 0, None, None, None,
                           (transfer, packed, self.new_event))

    def _banned(self, seq, ahead: int = 0) -> list[int]:
        """Tokens that may not be sampled yet: EOS and stop tokens before min_tokens are out."""
        p = seq.params
        if len(seq.output_token_ids) + ahead >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
