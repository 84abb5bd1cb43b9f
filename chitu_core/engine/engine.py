"""LLMEngine: loads a model onto a backend, owns the KV cache, and steps requests to completion.

It is driven by ``LLM`` in-process and by ``AsyncLLM`` from a thread of its own;
either way its whole interface is add_request / abort_request / step.
"""

import itertools
import logging
import os
import random
import time
from collections import deque

import torch

from chitu_core.attention.build import build_attention
from chitu_core.backend import return_free_host_memory
from chitu_core.config import EngineConfig
from chitu_core.distributed.parallel import Parallel
from chitu_core.distributed.pipeline import StageLink, micro_batches
from chitu_core.engine.block_manager import BlockManager
from chitu_core.engine.detokenizer import IncrementalDetokenizer
from chitu_core.engine.graphs import DecodeGraphs
from chitu_core.engine.memory import added_peak, kv_budget_from_profile, largest_step
from chitu_core.engine.model_runner import ModelRunner, PendingStep, StepResult
from chitu_core.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from chitu_core.engine.prefill_graphs import PrefillGraphs, prefill_buckets
from chitu_core.engine.scheduler import ScheduledBatch, Scheduler
from chitu_core.engine.sequence import Request, Sequence
from chitu_core.errors import ChituError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.cpu_experts import cpu_experts_for
from chitu_core.layers.layout import pack_linear_layers, store_linear_weights_transposed
from chitu_core.layers.stage import stage_layers
from chitu_core.loader.dummy import fill_dummy_weights
from chitu_core.loader.gguf import resolve_model
from chitu_core.loader.hf import eos_token_ids, open_model_dir
from chitu_core.ops.table import with_checks_if_asked
from chitu_core.plugins.discovery import backend_ops, get_backend, load_model_class
from chitu_core.quantization.kv_scales import load_kv_scales, resolve_kv_cache_dtype
from chitu_core.quantization.select import apply_layer_choices, select_quantization
from chitu_core.sampling.grammar import Constraints, GrammarCache
from chitu_core.sampling.params import SamplingParams
from chitu_core.sampling.sampler import Sampler

log = logging.getLogger(__name__)


def _resolve_dtype(requested: str, checkpoint: torch.dtype | None, supported: tuple[torch.dtype, ...], backend: str) -> torch.dtype:
    if requested != "auto":
        dtype = getattr(torch, requested)
        if dtype not in supported:
            names = ", ".join(str(d).removeprefix("torch.") for d in supported)
            raise ChituError(f"backend {backend!r} does not support dtype {requested}; it supports {names}")
        return dtype
    return checkpoint if checkpoint in supported else supported[0]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.backend = get_backend(config.device)
        self.backend.set_num_threads(config.num_threads)
        # Under torchrun each process takes the device of its local rank, before joining the group.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device_index = local_rank % max(1, self.backend.device_count())
        self.device = self.backend.device(self.device_index)
        self.backend.set_device(self.device_index)
        self.ops = with_checks_if_asked(backend_ops(self.backend))  # CHITU_CHECK_OPS=1: each op checked
        # A GGUF file stays quantized where the backend runs GGUF blocks, else it is dequantized once.
        keep_gguf = "gguf" in self.backend.quant_methods()
        model_dir = open_model_dir(resolve_model(config.model, keep_quantized=keep_gguf),
                                   require_weights=config.load_format == "auto")
        hf_config = model_dir.config
        model_cls = load_model_class(model_dir.architecture)
        self.dtype = _resolve_dtype(config.dtype, model_dir.config_dtype(), self.backend.supported_dtypes(), self.backend.name)
        self.parallel = Parallel.from_env(self.backend.process_group_backend(), config.tensor_parallel_size,
                                          config.pipeline_parallel_size)
        self.comm = self.parallel.tp
        self.comm.use_fast_all_reduce(self.backend)
        if config.load_format == "auto":  # a directory pre-sharded by convert --tp: this rank's files
            model_dir = model_dir.for_rank(self.comm.rank, self.comm.world_size)

        geometry = model_cls.kv_geometry(hf_config, self.comm.world_size)
        self.attention = build_attention(self.backend, geometry, config.block_size, self.dtype, self.device,
                                         resolve_kv_cache_dtype(config.kv_cache_dtype, hf_config))
        block_size = self.attention.block_size
        self.quant = select_quantization(hf_config, config.quantization, self.backend)
        ctx = BuildContext(self.ops, self.attention, self.comm, self.dtype, self.device, self.quant, self.parallel,
                           config.enable_expert_parallel,
                           cpu_experts_for(config.cpu_experts, hf_config.num_hidden_layers, self.backend),
                           self.backend.side_queue(self.device_index), self.backend.fusion_max_tokens())
        self.model = model_cls(hf_config, ctx)
        unfused: dict[str, tuple[str, ...]] = {}
        for fused, part, _ in getattr(self.model, "stacked_params", ()):  # spelled ".qkv_proj.", ".q_proj."
            unfused[fused.strip(".")] = unfused.get(fused.strip("."), ()) + (part.strip("."),)
        apply_layer_choices(self.model, self.quant, unfused)
        if config.load_format == "dummy":
            fill_dummy_weights(self.model, config.seed)
        else:
            weights = load_kv_scales(self.model, model_dir.iter_weights(progress=config.load_progress))
            if model_dir.presharded:  # asked only then, so a model plugin's own load_weights(weights) keeps working
                self.model.load_weights(weights, presharded=True)
            else:
                self.model.load_weights(weights)
        self.model.eval()
        return_free_host_memory()  # what reading the checkpoint freed
        if self.backend.transposed_linear_weights():
            store_linear_weights_transposed(self.model)
        if config.pack_linear:
            pack_linear_layers(self.model, self.backend)
            return_free_host_memory()  # the tensors packing replaced

        self.max_model_len = min(config.max_model_len or 1 << 62, model_cls.max_model_len(hf_config))
        self.max_num_batched_tokens = config.max_num_batched_tokens or self.backend.step_token_budget() or 8192
        self.vocab_size = hf_config.vocab_size
        # Decode graphs cannot hold the host work of CPU experts (cpu_experts_for logged that it runs eagerly).
        self.graph_runner = None if config.enforce_eager or ctx.cpu_experts else self.backend.graph_runner()
        self.max_graph_batch = min(config.max_num_seqs, config.max_graph_batch_size)
        # A pipeline stage caches its own layers only; the others' entries stay empty.
        self.link = StageLink(self.parallel, hf_config.hidden_size, self.dtype, self.device) if self.parallel.pp_size > 1 else None
        # Steps of prompts replay graphs of up to this many new tokens (0: none, as below the smallest bucket;
        # not under pipeline parallelism).
        self.prefill_graph_tokens = 0
        if self.graph_runner is not None and self.link is None and self.attention.captures_prefill:
            tokens = min(config.max_prefill_graph_tokens, self.max_num_batched_tokens)
            self.prefill_graph_tokens = tokens if prefill_buckets(tokens) else 0
        self.num_layers = geometry.num_layers
        local = stage_layers(geometry.num_layers, self.parallel.pp_size, self.parallel.pp_rank)
        num_blocks = self._num_blocks(len(local), block_size)
        kv_caches = [self.attention.allocate_kv_cache(num_blocks) if i in local else torch.empty(0, device=self.device)
                     for i in range(geometry.num_layers)]
        self.attention.warmup()
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching,
                                          reuse_first=type(self.attention).commits_on_write)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens)
        self.tokenizer = model_dir.tokenizer()
        self.eos_token_ids = eos_token_ids(model_dir.path, hf_config, self.tokenizer)
        sync = (lambda: self.backend.synchronize(self.device_index)) if config.profile_steps else None
        self.runner = ModelRunner(self.model, self.attention, kv_caches, Sampler(self.ops), self.device,
                                  self.vocab_size, self.eos_token_ids, sync, self.backend.completion_event)
        self.runner.parallel, self.runner.link = self.parallel, self.link
        if self.graph_runner is not None:
            self._capture_graphs(kv_caches)
        self.requests: dict[str, Request] = {}
        # Launched steps whose tokens the host has not processed yet, oldest first: one, or under
        # pipeline parallelism one for each group of a decode batch (``pipeline``).
        self._in_flight: deque[PendingStep] = deque()
        # Timing each forward (profile_steps) waits for the device, which leaves nothing to overlap.
        self.async_scheduling = config.async_scheduling and not config.profile_steps
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(config.seed)
        if config.compile_forward:
            self._compile_forward()
        log.info("loaded %s on %s (%s), %d KV blocks of %d tokens", model_dir.architecture, self.backend.name, self.dtype, num_blocks, block_size)

    def _compile_forward(self) -> None:
        """Run the forward through the backend's compiler, and compile now: one short request makes a
        prefill step and decode steps (a compiler that specialises on one token a sequence compiles both)."""
        if self.parallel.world.world_size > 1:
            raise ChituError("compile_forward runs on one rank only for now; leave it off under torchrun")
        start = time.perf_counter()
        self.model.forward = self.backend.compile_forward(self.model.forward)
        self.add_request("compile-warm-up", [0, 1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        while self.has_unfinished():
            self.step()
        self.stats = EngineStats()
        log.info("compiled the forward in %.1f s", time.perf_counter() - start)

    def _capture_graphs(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture the prefill graphs (their activations are the largest), then the decode graphs."""
        self.runner.graphs = DecodeGraphs(self.model, self.attention, kv_caches, self.graph_runner, self.max_graph_batch,
                                          self.max_model_len, self.device, self.backend.pin_memory(), self.link)
        with torch.inference_mode():
            if self.prefill_graph_tokens:
                graphs = PrefillGraphs(self.model, self.attention, kv_caches, self.graph_runner, self.prefill_graph_tokens,
                                       self.config.max_num_seqs, self.max_model_len, self.device, self.backend.pin_memory())
                try:
                    graphs.capture()
                except Exception as exc:
                    raise ChituError(f"capturing the prefill graphs failed ({type(exc).__name__}: {exc}); set "
                                     "max_prefill_graph_tokens=0 (--max-prefill-graph-tokens 0) to run those steps "
                                     "eagerly") from exc
                self.runner.prefill_graphs = graphs
            self.runner.graphs.capture()

    def _kv_budget(self) -> int:
        """Bytes for the KV cache: kv_cache_memory if set; else, with gpu_memory_utilization, that share
        of the device less a profiled largest step and the graphs' reserve; else the backend's budget."""
        config = self.config
        if config.kv_cache_memory:
            return config.kv_cache_memory
        if config.gpu_memory_utilization is None:
            return max(0, self.backend.kv_cache_budget(self.device_index) - self._prefill_graph_reserve())
        step = lambda: largest_step(self.model, self.attention, self.num_layers, self.max_num_batched_tokens,  # noqa: E731
                                    self.max_model_len, config.max_num_seqs, self.device, self.link)
        peak = self.backend.measure_peak_memory(step, self.device_index)
        if peak is None:
            raise ChituError(f"backend {self.backend.name!r} cannot measure device memory, so gpu_memory_utilization "
                             "cannot be applied; set kv_cache_memory (bytes) instead")
        total = self.backend.memory_info(self.device_index).total_bytes
        # Decode graphs keep their logits, plus some activations, for good (sampling upcasts them); prefill graphs
        # their activations.
        reserve = 0 if self.graph_runner is None else self.max_graph_batch * self.vocab_size * 8 + (256 << 20)
        reserve += self._prefill_graph_reserve()
        budget = kv_budget_from_profile(total, config.gpu_memory_utilization, peak, reserve)
        log.info("memory: %.2f GiB total, peak of the largest step %.2f GiB, graph reserve %.2f GiB -> KV cache %.2f GiB",
                 total / 2**30, peak / 2**30, reserve / 2**30, budget / 2**30)
        if budget <= 0:
            raise ChituError(
                f"gpu_memory_utilization={config.gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves nothing for the "
                f"KV cache: the largest step peaks at {peak / 2**30:.2f} GiB (weights included) and graphs reserve "
                f"{reserve / 2**30:.2f} GiB; raise it, or lower max_num_batched_tokens / max_num_seqs / max_prefill_graph_tokens")
        return budget

    def _prefill_graph_reserve(self) -> int:
        """What a step of the largest prefill graph adds to the memory at rest (its graphs keep it for good)."""
        if not self.prefill_graph_tokens:
            return 0
        return added_peak(self.backend, self.device_index, lambda: largest_step(
            self.model, self.attention, self.num_layers, self.prefill_graph_tokens, self.max_model_len, 1, self.device,
            self.link))

    def _num_blocks(self, num_layers: int, block_size: int) -> int:
        """KV blocks for ``num_layers`` layers (this pipeline stage's), the same on every rank."""
        config = self.config
        budget = self._kv_budget()
        per_block = self.attention.bytes_per_block() * num_layers
        # Never more than the configured limits can use: max_num_seqs sequences of max_model_len.
        useful = config.max_num_seqs * -(-self.max_model_len // block_size)
        num_blocks = min(budget // per_block, useful)
        if self.parallel.control is not None:  # ranks schedule alike only with as many blocks each
            agreed = torch.tensor([num_blocks], dtype=torch.int64)
            torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN, group=self.parallel.control)
            num_blocks = int(agreed)
        if num_blocks < 1:
            raise ChituError(f"the KV cache budget of {budget} bytes is less than one KV block ({per_block} bytes); "
                             "give it more with kv_cache_memory or gpu_memory_utilization")
        if num_blocks * block_size < self.max_model_len:
            if config.max_model_len:
                raise ChituError(
                    f"the KV cache ({budget} bytes: {num_blocks} blocks of {block_size} tokens) cannot hold one "
                    f"sequence of max_model_len={self.max_model_len}; give it more memory (kv_cache_memory) or lower max_model_len"
                )
            log.warning("capping max_model_len at %d tokens, what the KV cache holds", num_blocks * block_size)
            self.max_model_len = num_blocks * block_size
        return num_blocks

    # --- the interface ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0) -> Request:
        """Queue a request (its n samples). Raises ValueError, saying why, for a request that can never run."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
        if bad:
            raise ValueError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        constraints = self._constraints() if params.structured_output is not None else None
        if constraints is not None:  # compiled (or found in the cache) before anything is queued
            constraints.grammars.compile(params.structured_output)
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens and max_tokens={params.max_tokens}: together "
                f"{len(prompt_token_ids) + params.max_tokens}, more than max_model_len={self.max_model_len}"
            )
        request = Request(request_id, prompt, list(prompt_token_ids), params, priority, next(self._arrivals))
        request.metrics.num_prompt_tokens = len(prompt_token_ids)
        base_seed = params.seed if params.seed is not None else None
        for i in range(params.n):
            if base_seed is None:
                seed = self._seed_rng.getrandbits(63)
            else:
                seed = base_seed if i == 0 else hash((base_seed, i)) & ((1 << 63) - 1)
            seq = Sequence(next(self._seq_ids), request, i, seed)
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                         params.skip_special_tokens, params.stop)
            request.seqs.append(seq)
        for seq in request.seqs:
            self.scheduler.add(seq)  # validates the size; the first failure leaves nothing queued
        if constraints is not None:
            for seq in request.seqs:
                constraints.add(seq.seq_id, params.structured_output)
        self.requests[request_id] = request
        return request

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Returns False if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self._drop_constraint(seq)
        request.metrics.finished_time = time.monotonic()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step. Returns a delta RequestOutput for each request that progressed;
        finished requests leave the engine (read them whole with ``final_output`` first).

        With ``async_scheduling`` a decode step is launched before the host has the previous
        step's tokens (they go in from the device), so the host's bookkeeping for step N runs
        while the device computes step N+1. A sequence that turns out to have finished at N
        wastes its row of N+1; its blocks are freed, and any later writer of them queues behind.

        Under pipeline parallelism a decode batch runs as groups, one step of each in flight, each
        call processing the oldest and launching that group's next step (``pipeline``)."""
        if not self._in_flight:
            batch = self.scheduler.schedule()
            if not batch.seqs:
                if self.scheduler.waiting and not self.scheduler.running:
                    raise ChituError("no request could be scheduled: the KV cache is too small for the waiting requests")
                return []
            decode = all(n == 1 for n in batch.num_new_tokens)
            self._in_flight.extend(self._launch(batch.part(rows))
                                   for rows in micro_batches(len(batch.seqs), self.parallel.pp_size, decode))
        current = self._in_flight.popleft()
        following = self._continuation(current) if self.async_scheduling else []
        self._in_flight.extend(following)
        outputs = self._process(current)
        for pending in following:  # processing ``current`` finishes sequences of its own group only
            if all(s.is_finished for s in pending.batch.seqs):
                self._in_flight.remove(pending)  # nothing left to read from it
                pending.land()  # its transfer is still met on every rank
        return outputs

    def final_output(self, request: Request) -> RequestOutput:
        """The whole result of a request so far (all samples, full text and tokens)."""
        outputs = []
        for seq in request.seqs:
            logprobs = seq.output_logprobs if seq.params.logprobs is not None else None
            cumulative = sum(lp[t] for lp, t in zip(logprobs, seq.output_token_ids)) if logprobs else None
            text = seq.detokenizer.text if seq.detokenizer is not None else ""
            outputs.append(CompletionOutput(seq.index, text, list(seq.output_token_ids), seq.finish_reason,
                                            seq.stop_reason, logprobs, cumulative))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.finished, delta=False, metrics=request.metrics)

    # --- internals ----------------------------------------------------------------------------

    def _launch(self, batch: ScheduledBatch, ids: torch.Tensor | None = None, ahead: int = 0) -> PendingStep:
        now = time.monotonic()
        pending = self.runner.launch(batch, ids, ahead)
        self.stats.num_steps += 1
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            prompt_part = max(0, min(n, len(seq.prompt_token_ids) - seq.num_computed_tokens))
            metrics.num_computed_prompt_tokens += prompt_part
            self.stats.num_prompt_tokens_computed += prompt_part
            seq.num_computed_tokens += n
        return pending

    def _continuation(self, current: PendingStep) -> list[PendingStep]:
        """Launch the decode step that follows ``current`` without waiting for its tokens (as groups,
        under pipeline parallelism, where ``current`` was the only step in flight), or nothing where
        the next step needs the scheduler: requests wait, a row had no token (partial prefill), the
        KV cache needs a preemption, or a sequence has a grammar."""
        batch = current.batch
        if self.scheduler.waiting or len(current.sampling) != len(batch.seqs):
            return []
        if any(s.params.structured_output is not None for s in batch.seqs):
            return []  # a grammar's next mask needs this step's token: its rows wait for the host
        rows, seqs = [], []
        for row, seq in enumerate(batch.seqs):
            if seq.is_finished:
                continue
            p = seq.params
            if len(seq.output_token_ids) + 1 >= p.max_tokens or seq.num_tokens + 1 >= self.max_model_len:
                continue  # its pending token is its last
            rows.append(row)
            seqs.append(seq)
        blocks = self.block_manager
        if not seqs or sum(blocks.blocks_needed(s, s.num_computed_tokens + 1) for s in seqs) > blocks.num_free:
            return []
        for seq in seqs:
            blocks.allocate(seq, seq.num_computed_tokens + 1)
        ids = current.tokens
        if len(rows) < len(batch.seqs):
            ids = ids[torch.tensor(rows).to(self.device, non_blocking=True)]
        # A batch that was the only one in flight splits into groups where a pipeline has stages to fill.
        following = ScheduledBatch(seqs, [1] * len(seqs))
        parts = micro_batches(len(seqs), 1 if self._in_flight else self.parallel.pp_size, decode=True)
        return [self._launch(following.part(r), ids[r.start:r.stop], ahead=1) for r in parts]

    def _process(self, launched: PendingStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and record them; the deltas of the requests that progressed."""
        results = launched.results()
        progressed: dict[str, dict[int, CompletionOutput]] = {}
        for seq, result in zip(launched.batch.seqs, results):
            if seq.is_finished:
                continue  # aborted, or finished by the step before (this token is surplus)
            if result is None:
                self.block_manager.cache_full_blocks(seq)
            else:
                progressed.setdefault(seq.request.request_id, {})[seq.index] = self._append(seq, result)
        self._update_stats()
        return [self._delta_output(self.requests[rid], deltas) for rid, deltas in progressed.items()]

    def _append(self, seq: Sequence, result: StepResult) -> CompletionOutput:
        """Record a sampled token; detokenize; finish the sequence if it is done. Returns its delta."""
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = time.monotonic()
        metrics.num_output_tokens += 1
        self.stats.num_generated_tokens += 1
        token = result.token
        seq.output_token_ids.append(token)
        complete = self.runner.constraints is not None and self.runner.constraints.accept(seq.seq_id, token)
        self.block_manager.cache_full_blocks(seq)  # every computed token is known now
        lps = None
        if result.logprob is not None:
            lps = {token: result.logprob, **result.top_logprobs}
            seq.output_logprobs.append(lps)
        text = ""
        if seq.detokenizer is not None:
            text = seq.detokenizer.step([token])
            if seq.detokenizer.finished:
                seq.stop_reason = seq.detokenizer.stop_reason
                self._finish(seq, "stop")
        if not seq.is_finished:
            reason = "stop" if complete else self._finish_reason(seq, token)
            if reason:
                if seq.detokenizer is not None:
                    text += seq.detokenizer.flush()
                self._finish(seq, reason)
        return CompletionOutput(seq.index, text, [token], seq.finish_reason, seq.stop_reason,
                                [lps] if lps is not None else None)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._drop_constraint(seq)
        request = seq.request
        if request.finished:
            request.metrics.finished_time = time.monotonic()
            request.metrics.num_preemptions = sum(s.num_preemptions for s in request.seqs)

    def _constraints(self) -> Constraints:
        """The grammar matchers, made with the first structured-output request (it loads xgrammar
        and builds the tokenizer's tables, once)."""
        if self.runner.constraints is None:
            self.runner.constraints = Constraints(GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids))
        return self.runner.constraints

    def _drop_constraint(self, seq: Sequence) -> None:
        if self.runner.constraints is not None:
            self.runner.constraints.remove(seq.seq_id)

    def _delta_output(self, request: Request, deltas: dict[int, CompletionOutput]) -> RequestOutput:
        out = RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                            [deltas[i] for i in sorted(deltas)], request.finished, delta=True, metrics=request.metrics)
        if request.finished:
            del self.requests[request.request_id]
        return out

    def _update_stats(self) -> None:
        s, bm = self.stats, self.block_manager
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries, s.prefix_cache_hits = bm.prefix_queries, bm.prefix_hits
        s.num_waiting, s.num_running = len(self.scheduler.waiting), len(self.scheduler.running)
        s.kv_usage = bm.usage
