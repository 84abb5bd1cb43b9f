"""Paged-attention cases: each attention backend a backend declares (the reference, as a fallback, if it
declares none) against dense causal attention in float64, computed from the raw queries, keys and values.

A case runs two steps through ``prepare`` and ``forward``, as the engine does. Step 1 writes every
sequence's context (prefills, in chunks of at most ``CHUNK`` tokens); step 2 is the case's batch:
prefills, decodes, chunked prefills, or a mix, after those contexts. Blocks come from a shuffled
pool, block tables are padded with other sequences' block ids, last blocks are partly filled, and
the cache is guarded (``guards.GuardedCache``): after every step only the blocks of that step's new
tokens may have changed. Queries, keys, values and metadata are guarded operands.

Padding (``Plan.padding``): the step-2 batch of some plans ends with padding rows, run eagerly (no
graph), as the engine sends them outside graphs too (its memory profile step pads every row): slot -1,
one token, sequence length 1. Nothing of theirs may be written (a write at slot -1 that wraps to the
cache's last slot fails the cache guard); their outputs are ignored but must be finite.

FP8 cache (contract 1.2), rows ``attention/NAME/fp8-kv``: the backend's cache in float8_e4m3fn with
the plan's scales (a guarded operand too), against the same dense attention over the keys and
values the reference's fp8 cache reads back (``chitu_core.attention.fp8``: quantized on the host,
dequantized in float64), so that both sides carry the same rounding. Scales below 1 make some keys
saturate. A backend class that does not set ``supports_fp8_kv_cache`` has these cases declined.

16-bit cache (contract 1.15), rows ``attention/NAME/f16-kv`` and ``/bf16-kv``, float32 only: the cache
in float16 or bfloat16, against dense attention over the keys and values rounded to it (to nearest even).
A class that does not set ``supports_16bit_kv_cache`` has them declined.

Prefill graphs (contract 1.16), rows ``attention/NAME/graph-prefill``: step 2 as the engine's prefill graphs
lay it out (``chitu_core.engine.prefill_graphs``): the padding rows form one sequence of their own (nothing
cached, slots -1), sequence slots with no tokens follow, ``max_query_len`` / ``max_seq_len`` are bounds
above the real maxima, and the block tables are as wide as the ``max_seq_len`` bound's blocks. A class
that does not set ``captures_prefill`` has them declined.

Variants (contract 1.6), rows ``attention/NAME/softcap``, ``/window`` and ``/softcap+window``: the
same steps with the logits capped and a sliding window narrower than the contexts (decodes, chunked
prefills and prefills cross it); a backend class whose ``variants`` lacks one has its cases declined.
"""

import math
from dataclasses import dataclass
from functools import partial

import torch

from chitu_core.attention import fp8
from chitu_core.attention.contract import AttentionBackend, AttentionMetadata
from chitu_core.attention.reference import ReferenceAttention
from chitu_core.conformance.case import Case, Outcome, Perf, Target, randn, raised, time_call
from chitu_core.conformance.compare import Verdict, check_tensor, compare, worst
from chitu_core.conformance.guards import GuardedCache, guard

Tensor = torch.Tensor
CHUNK = 1024  # longest prefill chunk of step 1
CHECKED_CONTEXT = 1024  # step-1 outputs are compared with the oracle up to this many context tokens


@dataclass(frozen=True)
class Plan:
    """One case: head geometry, and per sequence (context tokens already cached, new tokens this step)."""

    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seqs: tuple[tuple[int, int], ...]
    scale: float | None = None  # None: 1/sqrt(head_dim)
    layout: str = "padded"  # of q, k and v: slices of a fused projection, or contiguous
    kv_scale: tuple[float, float] | None = None  # an fp8 cache's (key, value) scales; None: the model dtype
    cache_dtype: str | None = None  # a float32 model's 16-bit cache (contract 1.15), "float16" or "bfloat16"
    padding: int = 0  # padding rows (slot -1) ending the step-2 batch
    softcap: float | None = None  # contract 1.6 variants
    window: int | None = None
    graph: int = 0  # contract 1.16, with ``graph_layout``: empty sequence slots after the padding's sequence

    @property
    def graph_layout(self) -> bool:
        """Whether step 2 is laid out as a prefill graph lays it out (contract 1.16)."""
        return self.kind.startswith("graph")

    @property
    def variant(self) -> dict:
        return {k: v for k, v in (("softcap", self.softcap), ("window", self.window)) if v is not None}


PLANS = [
    Plan("prefill", 4, 4, 64, ((0, 1), (0, 17), (0, 33), (0, 5)), layout="contiguous"),
    Plan("decode", 8, 2, 128, ((1, 1), (15, 1), (16, 1), (17, 1), (100, 1), (257, 1))),
    Plan("mixed", 8, 1, 64, ((0, 23), (1, 1), (300, 37), (16, 16), (5, 1), (0, 1), (63, 9))),
    Plan("mixed", 16, 2, 128, ((0, 9), (40, 1), (129, 7))),
    Plan("mixed", 4, 4, 128, ((20, 3), (0, 12), (7, 1))),
    Plan("decode", 8, 2, 64, ((33, 1), (2, 1)), layout="contiguous"),
    Plan("mixed", 6, 3, 96, ((10, 5), (0, 7), (31, 1))),
    Plan("decode", 2, 1, 256, ((50, 1), (3, 1))),
    Plan("mixed", 4, 2, 80, ((0, 13), (19, 2))),
    Plan("prefill", 4, 2, 32, ((0, 40),)),
    Plan("mixed", 4, 2, 64, ((0, 11), (20, 1), (37, 5)), scale=0.3),
    Plan("long decode", 4, 1, 64, ((4093, 1), (2, 1))),
    Plan("long chunked", 8, 2, 128, ((2047, 64), (0, 3))),
    Plan("padded mixed", 8, 2, 64, ((0, 11), (20, 1), (37, 5)), padding=3),
    Plan("padded prefill", 4, 4, 64, ((0, 17), (0, 16)), layout="contiguous", padding=1),
    Plan("decode alone", 8, 2, 128, ((300, 1),)),  # one sequence: a backend may split its keys finely
]
VARIANT_PLANS = [  # at the default block size only
    Plan("mixed", 8, 2, 64, ((0, 11), (20, 1), (37, 5)), softcap=2.0),
    Plan("mixed", 8, 2, 64, ((0, 23), (1, 1), (40, 9), (16, 16), (5, 1)), window=8),
    Plan("decode", 4, 1, 128, ((33, 1), (130, 1), (2, 1)), window=32),
    Plan("decode alone", 4, 1, 128, ((130, 1),), window=32),  # one sequence's fast paths keep the window
    Plan("padded mixed", 4, 2, 64, ((0, 19), (20, 1), (37, 5)), softcap=1.5, window=16, padding=2),
]
SWEEP = Plan("mixed", 4, 2, 64, ((0, 11), (20, 1), (37, 5)))  # run at every other block size a backend declares
FP8_PLANS = [  # at the default block size only
    Plan("mixed", 8, 2, 64, ((0, 11), (20, 1), (37, 5)), kv_scale=(0.0075, 0.02)),  # keys beyond 3.36 saturate
    Plan("decode", 8, 1, 128, ((33, 1), (130, 1), (2, 1)), kv_scale=(1.0, 1.0)),
    Plan("prefill", 4, 4, 64, ((0, 17), (0, 5)), layout="contiguous", kv_scale=(0.3, 0.05)),
    Plan("padded mixed", 4, 2, 64, ((0, 9), (16, 1)), kv_scale=(0.3, 0.05), padding=2),
]
HALF_PLANS = [  # float32 cases at the default block size only
    Plan("mixed", 8, 2, 64, ((0, 11), (20, 1), (37, 5)), cache_dtype="float16"),
    Plan("decode", 8, 1, 128, ((33, 1), (130, 1), (2, 1)), cache_dtype="float16"),
    Plan("padded mixed", 4, 2, 64, ((0, 9), (16, 1)), cache_dtype="float16", padding=2),
    Plan("mixed", 8, 2, 64, ((0, 11), (20, 1), (37, 5)), cache_dtype="bfloat16"),
    Plan("decode", 8, 1, 128, ((33, 1), (130, 1), (2, 1)), cache_dtype="bfloat16"),
]
HALF_ROWS = {"float16": "f16-kv", "bfloat16": "bf16-kv"}
GRAPH_PLANS = [  # at the default block size only; step 2's bounds: 32 new tokens, a context of 4096
    Plan("graph mixed", 8, 2, 64, ((0, 11), (20, 1), (37, 5)), padding=15, graph=3),
    Plan("graph prefill", 4, 4, 64, ((0, 19), (0, 1)), layout="contiguous", padding=12, graph=1),
    Plan("graph decode", 8, 1, 128, ((33, 1), (130, 1)), padding=30, graph=0),
]
GRAPH_MAX_SEQ_LEN = 4096


def read_back(x: Tensor, kv_scale: float | None, cache_dtype: str | None = None) -> Tensor:
    """What a cache of the plan's kind gives back for x: x itself, x rounded to a 16-bit cache dtype, or
    (fp8) x quantized and dequantized by the reference, in float64."""
    if cache_dtype is not None:
        return x.to(getattr(torch, cache_dtype)).double()
    if kv_scale is None:
        return x
    scale = torch.tensor(kv_scale, dtype=torch.float32)
    return fp8.dequantize(fp8.quantize(x, scale), scale, torch.float64)


def fp8_row(plan, row: str, label: str, params: dict) -> tuple[str, str]:
    """An fp8- or 16-bit-cache plan's row and label, its params saying its kv_cache_dtype; other plans' as
    they are."""
    if getattr(plan, "cache_dtype", None) is not None:  # (latent attention's plans have none)
        params["kv_cache_dtype"] = plan.cache_dtype
        return f"{row}/{HALF_ROWS[plan.cache_dtype]}", f"{label} cache={plan.cache_dtype}"
    if plan.kv_scale is None:
        return row, label
    params["kv_cache_dtype"] = "fp8"
    return f"{row}/fp8-kv", f"{label} kv_scale={plan.kv_scale}"


def fp8_declined(attn_cls: type, plan) -> str:
    """Why an fp8- or 16-bit-cache plan is not run on ``attn_cls`` ("" where it runs)."""
    if getattr(plan, "cache_dtype", None) is not None and not attn_cls.supports_16bit_kv_cache:
        return f"{attn_cls.__name__} does not set supports_16bit_kv_cache (contract 1.15)"
    if plan.kv_scale is None or attn_cls.supports_fp8_kv_cache:
        return ""
    return f"{attn_cls.__name__} does not set supports_fp8_kv_cache (contract 1.2)"


def graph_declined(attn_cls: type, plan) -> str:
    if plan.graph_layout and not getattr(attn_cls, "captures_prefill", False):
        return f"{attn_cls.__name__} does not set captures_prefill (contract 1.16)"
    return ""


def variant_declined(attn_cls: type, plan) -> str:
    """Why a class that lacks a plan's contract 1.6 variant declines it, else ""."""
    needed = {"softcap": "softcap", "window": "sliding_window"}
    missing = sorted(needed[k] for k in plan.variant if needed[k] not in attn_cls.supported_variants())
    return f"{attn_cls.__name__} does not declare the variant(s) {', '.join(missing)}" if missing else ""


def allocate_blocks(gen: torch.Generator, lens: list[int], block_size: int, spare: int = 3) -> tuple[Tensor, int]:
    """int32 block tables from a shuffled pool; entries past a sequence's blocks hold other sequences' ids."""
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + spare
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(lens), max(needed) + 2), generator=gen)
    start = 0
    for row, n in zip(tables, needed):
        row[:n] = pool[start : start + n]
        start += n
    return tables.to(torch.int32), num_blocks


def metadata(tables: Tensor, context_lens: list[int], query_lens: list[int], block_size: int) -> AttentionMetadata:
    """Host metadata for a step where sequence b has context_lens[b] cached and query_lens[b] new tokens."""
    slots = []
    for row, c, n in zip(tables.long(), context_lens, query_lens):
        pos = torch.arange(c, c + n)
        slots.append(row[pos // block_size] * block_size + pos % block_size)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    return AttentionMetadata(torch.cat(slots), tables, torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(context_lens, dtype=torch.int32), qsl, max(query_lens), max(seq_lens),
                             block_size)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, context: int, scale: float, softcap: float | None = None,
                    window: int | None = None) -> Tensor:
    """float64 causal attention of q (positions context..context+n-1) over k, v (positions 0..L-1),
    with the logit cap and sliding window of contract 1.6 where given."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos, q_pos = torch.arange(k.shape[0])[None, :], (context + torch.arange(q.shape[0]))[:, None]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window if window is not None else True)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)


class Step:
    """One guarded forward call: operands, metadata (padding rows last) and the cache it writes."""

    def __init__(self, case: Case, plan: Plan, attn: AttentionBackend, cache: GuardedCache, tables: Tensor,
                 contexts: list[int], news: list[int], gen: torch.Generator, device: torch.device, padding: int = 0):
        hq, hk, d, dtype = plan.num_heads, plan.num_kv_heads, plan.head_dim, case.dtype
        total = sum(news) + padding
        self.host = (randn(gen, total, hq, d, dtype=dtype), randn(gen, total, hk, d, dtype=dtype),
                     randn(gen, total, hk, d, dtype=dtype))
        self.operands = [guard(t, device, plan.layout) for t in self.host]
        if padding and plan.graph_layout:  # the padding's own sequence, then empty sequence slots, and
            width = -(-GRAPH_MAX_SEQ_LEN // attn.block_size)  # tables as wide as the bound's blocks
            tables = torch.cat([tables, tables[:, :1].expand(-1, max(0, width - tables.shape[1]))], 1)
            meta = metadata(tables, contexts + [0] * (1 + plan.graph), news + [padding] + [0] * plan.graph,
                            attn.block_size)
            meta.max_query_len, meta.max_seq_len = total, GRAPH_MAX_SEQ_LEN
        else:
            meta = metadata(tables, contexts + [0] * padding, news + [1] * padding, attn.block_size)
        meta.slot_mapping[sum(news):] = -1
        self.meta_guards = [guard(getattr(meta, f), device) for f in ("slot_mapping", "block_tables", "seq_lens",
                                                                      "context_lens", "query_start_loc")]
        self.meta = AttentionMetadata(*(g.view for g in self.meta_guards), meta.max_query_len, meta.max_seq_len,
                                      meta.block_size)
        if plan.kv_scale is not None:
            self.meta_guards.append(guard(torch.tensor(plan.kv_scale, dtype=torch.float32), device))
        self.slots = meta.slot_mapping[meta.slot_mapping >= 0]
        self.bounds, self.real = meta.query_start_loc.tolist(), sum(news)
        self.attn, self.cache, self.scale = attn, cache, plan.scale or 1 / math.sqrt(d)
        self.kv_scale, self.variant, self.cache_dtype = plan.kv_scale, plan.variant, plan.cache_dtype

    def call(self) -> Tensor:
        q, k, v = (g.view for g in self.operands)
        if self.kv_scale is None:
            return self.attn.forward(q, k, v, self.cache.cache, self.meta, self.scale, **self.variant)
        return self.attn.forward(q, k, v, self.cache.cache, self.meta, self.scale, kv_scale=self.meta_guards[-1].view,
                                 **self.variant)

    def run(self) -> tuple[Tensor | None, str]:
        """(output, problem): prepare and forward, then the guards."""
        before = self.cache.snapshot()
        try:
            self.meta.backend_state = self.attn.prepare(self.meta)
            out = self.call()
        except Exception as exc:  # the backend's own failure is the case's result
            return None, raised(exc, "attention").verdict.detail
        for name, g in zip(("q", "k", "v", "slot_mapping", "block_tables", "seq_lens", "context_lens",
                            "query_start_loc", "kv_scale"), self.operands + self.meta_guards):
            if problem := g.changed():
                return None, f"attention wrote into its operand `{name}`: {problem}"
        if problem := self.cache.check_writes(before, self.slots, self.attn.block_size):
            return None, problem
        shape = tuple(self.host[0].shape)
        if problem := check_tensor(out, shape, self.host[0].dtype, self.operands[0].view.device, "output"):
            return None, problem
        if not bool(out[self.real :].isfinite().all()):
            return None, "padding rows (slot -1, a sequence of their own) gave non-finite outputs"
        return out, ""

    def per_sequence(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """Sequence i's queries, and its keys and values as the cache gives them back."""
        a, b = self.bounds[i], self.bounds[i + 1]
        q, k, v = (t[a:b] for t in self.host)
        if self.kv_scale is None and self.cache_dtype is None:
            return q, k, v
        scales = self.kv_scale or (None, None)
        return q, read_back(k, scales[0], self.cache_dtype), read_back(v, scales[1], self.cache_dtype)


def run_attention_case(attn_cls: type[AttentionBackend], source: str, plan: Plan, block_size: int,
                       case: Case, target: Target) -> Outcome:
    gen, device, dtype = case.generator(), target.device, case.dtype
    try:
        attn = attn_cls(plan.num_heads, plan.num_kv_heads, plan.head_dim, block_size, dtype, device)
        attn.set_kv_cache_dtype(plan.cache_dtype or ("auto" if plan.kv_scale is None else "fp8"))
        contexts, news = [c for c, _ in plan.seqs], [n for _, n in plan.seqs]
        padding = [plan.padding] + [1] * plan.graph if plan.graph_layout else [1] * plan.padding
        tables, num_blocks = allocate_blocks(gen, [c + n for c, n in plan.seqs] + padding, block_size)
        cache = GuardedCache.allocate(attn, num_blocks + 1)  # no table names the last block: slot -1 wraps there
    except Exception as exc:  # construction is part of what the backend declared it supports
        return Outcome(raised(exc, f"{attn_cls.__name__} construction").verdict, source)
    threshold = target.threshold(case)
    verdicts: list[Verdict] = []
    written: dict[int, tuple[list[Tensor], list[Tensor]]] = {b: ([], []) for b in range(len(plan.seqs))}
    # Step 1, in chunks: every context, as prefills (several sequences per call).
    done = [0] * len(plan.seqs)
    while any(done[b] < c for b, c in enumerate(contexts)):
        rows = [b for b, c in enumerate(contexts) if done[b] < c]
        sub = [min(CHUNK, contexts[b] - done[b]) for b in rows]
        step = Step(case, plan, attn, cache, tables[rows], [done[b] for b in rows], sub, gen, device)
        out, problem = step.run()
        if problem:
            return Outcome(Verdict.fail(f"step 1 (writing the contexts): {problem}"), source)
        for i, b in enumerate(rows):
            q, k, v = step.per_sequence(i)
            keys, values = written[b]
            keys.append(k)
            values.append(v)
            got = out[step.bounds[i] : step.bounds[i + 1]]
            if contexts[b] <= CHECKED_CONTEXT:
                want = dense_attention(q, torch.cat(keys), torch.cat(values), done[b], step.scale, plan.softcap, plan.window)
                verdicts.append(compare(got, want, threshold, f"step 1 sequence {b}"))
            elif got.isnan().any():
                return Outcome(Verdict.fail(f"step 1 sequence {b}: NaN in the output"), source)
            done[b] += sub[i]
    # Step 2: the case's batch, padding rows last.
    step = Step(case, plan, attn, cache, tables, contexts, news, gen, device, plan.padding)
    out, problem = step.run()
    if problem:
        return Outcome(Verdict.fail(f"step 2 ({plan.kind} batch): {problem}"), source)
    for b in range(len(plan.seqs)):
        q, k, v = step.per_sequence(b)
        keys, values = written[b]
        want = dense_attention(q, torch.cat(keys + [k]), torch.cat(values + [v]), contexts[b], step.scale,
                               plan.softcap, plan.window)
        verdicts.append(compare(out[step.bounds[b] : step.bounds[b + 1]], want, threshold, f"step 2 sequence {b}"))
    perf = None
    if target.perf is not None:
        perf = _time(target, step, plan, dtype, cache.cache.element_size())
    return Outcome(worst(verdicts), source, perf)


def _time(target: Target, step: Step, plan: Plan, dtype: torch.dtype, cache_item: int) -> Perf:
    hq, hk, d = plan.num_heads, plan.num_kv_heads, plan.head_dim
    item = torch.empty((), dtype=dtype).element_size()
    tokens = sum(n for _, n in plan.seqs)
    keys = sum(c + n for c, n in plan.seqs)
    moved = item * tokens * (2 * hq + 2 * hk) * d + cache_item * keys * 2 * hk * d
    flops = sum(4 * n * (c + (n + 1) / 2) * hq * d for c, n in plan.seqs)
    return time_call(target, step.call, moved, int(flops))


def attention_cases(backend, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    declared = dict(backend.attention_backends())
    source = "native" if declared else "fallback"
    backends = declared or {ReferenceAttention.name: ReferenceAttention}
    cases = []
    for name, cls in backends.items():
        default = cls.block_sizes[0]
        plans = ([(p, default) for p in PLANS] + [(SWEEP, bs) for bs in cls.block_sizes[1:]]
                 + [(p, default) for p in FP8_PLANS] + [(p, default) for p in VARIANT_PLANS]
                 + [(p, default) for p in HALF_PLANS] + [(p, default) for p in GRAPH_PLANS])
        for dtype in dtypes:
            for plan, bs in plans:
                if plan.cache_dtype is not None and dtype != torch.float32:
                    continue
                params = {"backend": name, "num_heads": plan.num_heads, "num_kv_heads": plan.num_kv_heads,
                          "head_dim": plan.head_dim, "block_size": bs, "kind": plan.kind,
                          "max_seq_len": max(c + n for c, n in plan.seqs),
                          "max_query_len": max(n for _, n in plan.seqs)}
                lens = ",".join(f"{c}+{n}" for c, n in plan.seqs) + (f",pad*{plan.padding}" if plan.padding else "")
                label = (f"{plan.kind} Hq={plan.num_heads} Hk={plan.num_kv_heads} D={plan.head_dim} bs={bs} "
                         f"ctx+new={lens}" + (f" scale={plan.scale}" if plan.scale else ""))
                row, label = fp8_row(plan, f"attention/{name}", label, params)
                if plan.graph_layout:
                    row, label = f"{row}/graph-prefill", label + f" empty*{plan.graph} bounds"
                if plan.variant:
                    row = f"{row}/{'+'.join(sorted(plan.variant))}"
                    label += "".join(f" {k}={v}" for k, v in plan.variant.items())
                    params.update(plan.variant)
                cases.append(Case(row, "attention", "attention", dtype, params, label,
                                  partial(run_attention_case, cls, source, plan, bs),
                                  declined=fp8_declined(cls, plan) or variant_declined(cls, plan)
                                  or graph_declined(cls, plan)))
    return cases
