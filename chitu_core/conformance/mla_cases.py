"""Latent-attention (MLA) cases: each MLA backend a backend declares (the reference, as a fallback, if it
declares none) against dense causal attention in float64 over the raw latents, value = their first L
channels (``chitu_core.attention.mla``).

As for paged attention (``attention_cases``): step 1 writes every sequence's context through
``prepare`` and ``forward`` (prefills, in chunks of at most ``CHUNK`` tokens); step 2 is the case's
batch (prefills, decodes, chunked prefills, a mix) after those contexts. Blocks come from a shuffled
pool, tables are padded with other sequences' ids, last blocks are partly filled, the cache is
guarded (only the blocks of a step's new tokens may change) and so are the operands and metadata.
A case may end its step-2 batch with padding rows as decode graphs send them: slot -1 (nothing may
be written), one token, sequence length 1; their outputs are ignored but must be finite.
Geometries: DeepSeek-V2-Lite (16 heads, L = 512, R = 64) and a small one (4 heads, L = 32, R = 8).

FP8 cache (contract 1.2), rows ``mla_attention/NAME/fp8-kv``: as for paged attention
(``attention_cases``), the oracle attends over the latents the reference's fp8 cache reads back,
with the plan's one scale for the whole row (a guarded operand).
"""

import math
from dataclasses import dataclass
from functools import partial

import torch

from chitu_core.attention.contract import AttentionMetadata
from chitu_core.attention.mla import MLAAttentionBackend, ReferenceMLAAttention
from chitu_core.conformance.attention_cases import (
    CHECKED_CONTEXT,
    CHUNK,
    allocate_blocks,
    fp8_declined,
    fp8_row,
    metadata,
    read_back,
)
from chitu_core.conformance.case import Case, Outcome, Perf, Target, randn, raised, time_call
from chitu_core.conformance.compare import Verdict, check_tensor, compare, worst
from chitu_core.conformance.guards import GuardedCache, guard

Tensor = torch.Tensor


@dataclass(frozen=True)
class Plan:
    """One case: heads, latent parts (L, R), per sequence (context tokens already cached, new tokens
    this step), and how many padding rows end the step-2 batch."""

    kind: str
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    seqs: tuple[tuple[int, int], ...]
    padding: int = 0
    scale: float | None = None  # None: 1/sqrt(L + R)
    layout: str = "padded"  # of q and the latents: slices of a fused projection, or contiguous
    kv_scale: float | None = None  # an fp8 cache's scale; None: the model dtype


PLANS = [
    Plan("prefill", 4, 32, 8, ((0, 1), (0, 17), (0, 33), (0, 5)), layout="contiguous"),
    Plan("decode", 4, 32, 8, ((1, 1), (15, 1), (16, 1), (17, 1), (100, 1), (257, 1))),
    Plan("mixed", 4, 32, 8, ((0, 23), (1, 1), (300, 37), (16, 16), (5, 1), (0, 1), (63, 9))),
    Plan("padded decode", 4, 32, 8, ((33, 1), (2, 1), (70, 1)), padding=3),
    Plan("long decode", 4, 32, 8, ((4093, 1), (2, 1))),
    Plan("long chunked", 4, 32, 8, ((2047, 64), (0, 3))),
    Plan("prefill", 16, 512, 64, ((0, 40), (0, 7))),
    Plan("decode", 16, 512, 64, ((1, 1), (64, 1), (513, 1)), layout="contiguous"),
    Plan("mixed", 16, 512, 64, ((0, 19), (130, 1), (65, 12), (3, 1)), scale=192**-0.5),  # DeepSeek's q.k scale
    Plan("chunked", 16, 512, 64, ((300, 45), (0, 1))),
    Plan("padded decode", 16, 512, 64, ((90, 1), (17, 1)), padding=2),
]
SWEEPS = [  # run at every other block size a backend declares (the second: at 64 only, FlashMLA's page size)
    (Plan("mixed", 4, 32, 8, ((0, 11), (20, 1), (37, 5)), padding=1), None),
    (Plan("mixed", 16, 512, 64, ((0, 9), (70, 1), (33, 4))), 64),
]
FP8_PLANS = [  # at the default block size only
    Plan("mixed", 4, 32, 8, ((0, 11), (20, 1), (37, 5)), padding=1, kv_scale=0.0075),  # beyond 3.36 saturates
    Plan("decode", 4, 32, 8, ((1, 1), (70, 1), (16, 1)), kv_scale=1.0),
    Plan("mixed", 16, 512, 64, ((0, 9), (70, 1), (33, 4)), scale=192**-0.5, kv_scale=0.02),
]


def dense_mla(q: Tensor, latents: Tensor, context: int, scale: float, kv_lora_rank: int) -> Tensor:
    """float64 causal attention of q [n, H, L + R] (positions context..context+n-1) over the latents
    [S, L + R] (positions 0..S-1), value = their first L channels."""
    scores = torch.einsum("qhd,kd->hqk", q.double(), latents.double()) * scale
    visible = torch.arange(latents.shape[0])[None, :] <= (context + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,kd->qhd", probs, latents[:, :kv_lora_rank].double())


class Step:
    """One guarded forward call: operands, metadata (padding rows last) and the cache it writes."""

    def __init__(self, case: Case, plan: Plan, attn: MLAAttentionBackend, cache: GuardedCache, tables: Tensor,
                 contexts: list[int], news: list[int], padding: int, gen: torch.Generator, device: torch.device):
        total, width = sum(news) + padding, plan.kv_lora_rank + plan.rope_dim
        self.host = (randn(gen, total, plan.num_heads, width, dtype=case.dtype),
                     randn(gen, total, width, dtype=case.dtype))
        self.operands = [guard(t, device, plan.layout) for t in self.host]
        meta = metadata(tables, contexts + [0] * padding, news + [1] * padding, attn.block_size)
        meta.slot_mapping[sum(news):] = -1
        self.meta_guards = [guard(getattr(meta, f), device) for f in ("slot_mapping", "block_tables", "seq_lens",
                                                                      "context_lens", "query_start_loc")]
        self.meta = AttentionMetadata(*(g.view for g in self.meta_guards), meta.max_query_len, meta.max_seq_len,
                                      meta.block_size)
        if plan.kv_scale is not None:
            self.meta_guards.append(guard(torch.tensor([plan.kv_scale], dtype=torch.float32), device))
        self.slots = meta.slot_mapping[meta.slot_mapping >= 0]
        self.bounds, self.real = meta.query_start_loc.tolist(), sum(news)
        self.attn, self.cache, self.scale = attn, cache, plan.scale or 1 / math.sqrt(width)
        self.kv_scale = plan.kv_scale

    def call(self) -> Tensor:
        q, latent = (g.view for g in self.operands)
        if self.kv_scale is None:
            return self.attn.forward(q, latent, self.cache.cache, self.meta, self.scale)
        return self.attn.forward(q, latent, self.cache.cache, self.meta, self.scale, kv_scale=self.meta_guards[-1].view)

    def run(self) -> tuple[Tensor | None, str]:
        """(output, problem): prepare and forward, then the guards."""
        before = self.cache.snapshot()
        try:
            self.meta.backend_state = self.attn.prepare(self.meta)
            out = self.call()
        except Exception as exc:  # the backend's own failure is the case's result
            return None, raised(exc, "MLA attention").verdict.detail
        for name, g in zip(("q", "latent", "slot_mapping", "block_tables", "seq_lens", "context_lens",
                            "query_start_loc", "kv_scale"), self.operands + self.meta_guards):
            if problem := g.changed():
                return None, f"MLA attention wrote into its operand `{name}`: {problem}"
        if problem := self.cache.check_writes(before, self.slots, self.attn.block_size):
            return None, problem
        q = self.host[0]
        shape = (q.shape[0], q.shape[1], self.attn.kv_lora_rank)
        if problem := check_tensor(out, shape, q.dtype, self.operands[0].view.device, "output"):
            return None, problem
        if not bool(out[self.real :].isfinite().all()):
            return None, f"padding rows (slot -1, sequence length 1) gave non-finite outputs: {out[self.real :]}"
        return out, ""

    def per_sequence(self, i: int) -> tuple[Tensor, Tensor]:
        """Sequence i's queries, and its latents as the cache gives them back."""
        a, b = self.bounds[i], self.bounds[i + 1]
        return self.host[0][a:b], read_back(self.host[1][a:b], self.kv_scale)


def run_mla_case(attn_cls: type[MLAAttentionBackend], source: str, plan: Plan, block_size: int, case: Case,
                 target: Target) -> Outcome:
    gen, device, dtype = case.generator(), target.device, case.dtype
    contexts, news = [c for c, _ in plan.seqs], [n for _, n in plan.seqs]
    try:
        attn = attn_cls(plan.num_heads, plan.kv_lora_rank, plan.rope_dim, block_size, dtype, device)
        attn.set_kv_cache_dtype("auto" if plan.kv_scale is None else "fp8")
        tables, num_blocks = allocate_blocks(gen, [c + n for c, n in plan.seqs] + [1] * plan.padding, block_size)
        cache = GuardedCache.allocate(attn, num_blocks)
    except Exception as exc:  # construction is part of what the backend declared it supports
        return Outcome(raised(exc, f"{attn_cls.__name__} construction").verdict, source)
    threshold, lora = target.threshold(case), plan.kv_lora_rank
    verdicts: list[Verdict] = []
    written: dict[int, list[Tensor]] = {b: [] for b in range(len(plan.seqs))}
    # Step 1, in chunks: every context, as prefills (several sequences per call).
    done = [0] * len(plan.seqs)
    while any(done[b] < c for b, c in enumerate(contexts)):
        rows = [b for b, c in enumerate(contexts) if done[b] < c]
        sub = [min(CHUNK, contexts[b] - done[b]) for b in rows]
        step = Step(case, plan, attn, cache, tables[rows], [done[b] for b in rows], sub, 0, gen, device)
        out, problem = step.run()
        if problem:
            return Outcome(Verdict.fail(f"step 1 (writing the contexts): {problem}"), source)
        for i, b in enumerate(rows):
            q, latent = step.per_sequence(i)
            written[b].append(latent)
            got = out[step.bounds[i] : step.bounds[i + 1]]
            if contexts[b] <= CHECKED_CONTEXT:
                want = dense_mla(q, torch.cat(written[b]), done[b], step.scale, lora)
                verdicts.append(compare(got, want, threshold, f"step 1 sequence {b}"))
            elif got.isnan().any():
                return Outcome(Verdict.fail(f"step 1 sequence {b}: NaN in the output"), source)
            done[b] += sub[i]
    # Step 2: the case's batch, padding rows last.
    step = Step(case, plan, attn, cache, tables, contexts, news, plan.padding, gen, device)
    out, problem = step.run()
    if problem:
        return Outcome(Verdict.fail(f"step 2 ({plan.kind} batch): {problem}"), source)
    for b in range(len(plan.seqs)):
        q, latent = step.per_sequence(b)
        want = dense_mla(q, torch.cat(written[b] + [latent]), contexts[b], step.scale, lora)
        verdicts.append(compare(out[step.bounds[b] : step.bounds[b + 1]], want, threshold, f"step 2 sequence {b}"))
    perf = _time(target, step, plan, dtype, cache.cache.element_size()) if target.perf is not None else None
    return Outcome(worst(verdicts), source, perf)


def _time(target: Target, step: Step, plan: Plan, dtype: torch.dtype, cache_item: int) -> Perf:
    h, lora, width = plan.num_heads, plan.kv_lora_rank, plan.kv_lora_rank + plan.rope_dim
    item = torch.empty((), dtype=dtype).element_size()
    tokens = sum(n for _, n in plan.seqs) + plan.padding
    keys = sum(c + n for c, n in plan.seqs) + plan.padding
    moved = item * tokens * (h * (width + lora) + width) + cache_item * keys * width
    flops = sum(2 * n * (c + (n + 1) / 2) * h * (width + lora) for c, n in plan.seqs)
    return time_call(target, step.call, moved, int(flops))


def mla_cases(backend, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    declared = dict(backend.mla_attention_backends())
    source = "native" if declared else "fallback"
    backends = declared or {ReferenceMLAAttention.name: ReferenceMLAAttention}
    cases = []
    for name, cls in backends.items():
        default = cls.block_sizes[0]
        plans = ([(p, default) for p in PLANS] + [(p, bs) for p, only in SWEEPS for bs in cls.block_sizes[1:]
                                                  if only in (None, bs)] + [(p, default) for p in FP8_PLANS])
        for dtype in dtypes:
            for plan, bs in plans:
                params = {"backend": name, "num_heads": plan.num_heads, "kv_lora_rank": plan.kv_lora_rank,
                          "rope_dim": plan.rope_dim, "block_size": bs, "kind": plan.kind,
                          "max_seq_len": max(c + n for c, n in plan.seqs),
                          "max_query_len": max(n for _, n in plan.seqs)}
                lens = ",".join(f"{c}+{n}" for c, n in plan.seqs) + (f",pad*{plan.padding}" if plan.padding else "")
                label = (f"{plan.kind} H={plan.num_heads} L={plan.kv_lora_rank} R={plan.rope_dim} bs={bs} "
                         f"ctx+new={lens}" + (f" scale={plan.scale:.4g}" if plan.scale else ""))
                row, label = fp8_row(plan, f"mla_attention/{name}", label, params)
                cases.append(Case(row, "mla_attention", "attention", dtype, params, label,
                                  partial(run_mla_case, cls, source, plan, bs), declined=fp8_declined(cls, plan)))
    return cases
