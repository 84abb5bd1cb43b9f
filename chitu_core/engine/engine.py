"""LLMEngine: loads a model onto a backend, owns the KV cache, and steps requests to completion."""

import itertools
import logging
import random

import torch

from chitu_core.attention.reference import ReferenceAttention
from chitu_core.config import EngineConfig
from chitu_core.distributed.communicator import Communicator
from chitu_core.engine.block_manager import BlockManager
from chitu_core.engine.model_runner import ModelRunner
from chitu_core.engine.scheduler import Scheduler
from chitu_core.engine.sequence import Sequence
from chitu_core.errors import ChituError
from chitu_core.layers.context import BuildContext
from chitu_core.loader.hf import open_model_dir
from chitu_core.plugins.discovery import backend_ops, get_backend, load_model_class
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
        self.device = self.backend.device()
        self.ops = backend_ops(self.backend)
        model_dir = open_model_dir(config.model)
        hf_config = model_dir.config
        model_cls = load_model_class(model_dir.architecture)
        self.dtype = _resolve_dtype(config.dtype, model_dir.config_dtype(), self.backend.supported_dtypes(), self.backend.name)
        self.comm = Communicator.from_env(self.backend.process_group_backend())

        geometry = model_cls.kv_geometry(hf_config, self.comm.world_size)
        attention_cls = next(iter(self.backend.attention_backends().values()), ReferenceAttention)
        block_size = config.block_size or attention_cls.block_sizes[0]
        self.attention = attention_cls(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, block_size, self.dtype, self.device)
        ctx = BuildContext(self.ops, self.attention, self.comm, self.dtype, self.device)
        self.model = model_cls(hf_config, ctx)
        self.model.load_weights(model_dir.iter_weights(progress=config.load_progress))
        self.model.eval()

        self.max_model_len = min(config.max_model_len or 1 << 62, model_cls.max_model_len(hf_config))
        budget = config.kv_cache_memory or self.backend.kv_cache_budget()
        per_block = self.attention.bytes_per_block() * geometry.num_layers
        # Never more than the configured limits can use: max_num_seqs sequences of max_model_len.
        useful = config.max_num_seqs * -(-self.max_model_len // block_size)
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 1:
            raise ChituError(f"kv_cache_memory={budget} bytes is less than one KV block ({per_block} bytes)")
        if num_blocks * block_size < self.max_model_len:
            if config.max_model_len:
                raise ChituError(
                    f"the KV cache ({budget} bytes: {num_blocks} blocks of {block_size} tokens) cannot hold one "
                    f"sequence of max_model_len={self.max_model_len}; give it more memory (kv_cache_memory) or lower max_model_len"
                )
            log.warning("capping max_model_len at %d tokens, what the KV cache holds", num_blocks * block_size)
            self.max_model_len = num_blocks * block_size
        kv_caches = [self.attention.allocate_kv_cache(num_blocks) for _ in range(geometry.num_layers)]
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.attention, kv_caches, Sampler(self.ops), self.device)
        self.tokenizer = model_dir.tokenizer()
        self.eos_token_ids = self._eos_ids(model_dir, hf_config)
        self.vocab_size = hf_config.vocab_size
        self._ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        log.info("loaded %s on %s (%s), %d KV blocks of %d tokens", model_dir.architecture, self.backend.name, self.dtype, num_blocks, block_size)

    def _eos_ids(self, model_dir, hf_config) -> set[int]:
        ids = getattr(hf_config, "eos_token_id", None)
        try:
            from transformers import GenerationConfig

            ids = GenerationConfig.from_pretrained(model_dir.path).eos_token_id or ids
        except OSError:
            pass  # no generation_config.json
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        return set(ids if isinstance(ids, list) else [] if ids is None else [ids])

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Sequence:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens and max_tokens={params.max_tokens}: together "
                f"{len(prompt_token_ids) + params.max_tokens}, more than max_model_len={self.max_model_len}"
            )
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(next(self._ids), list(prompt_token_ids), params, seed, prompt)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that finished in it."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise ChituError("no request could be scheduled: the KV cache is too small for the waiting requests")
        results = self.runner.run(batch)
        finished = []
        for seq, n, result in zip(batch.seqs, batch.num_new_tokens, results):
            seq.num_computed_tokens += n
            if result is None:
                continue
            seq.output_token_ids.append(result.token)
            if result.logprob is not None:
                seq.output_logprobs.append({result.token: result.logprob, **result.top_logprobs})
            reason = self._finish_reason(seq, result.token)
            if reason:
                self.scheduler.finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
