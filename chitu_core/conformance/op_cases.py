"""Cases for every op of the op contract (``chitu_core.ops.spec``), judged against the reference in float64.

Operands are fresh random values in the case's dtype, never zeros: sizes of 1, odd sizes, sizes on
both sides of common kernel dispatch points (16, 1024, 4096 and their neighbours), and every
tensor handed over in a guarded buffer (``guards``), contiguous or not. The sampling filters'
cases keep every top-p and min-p boundary far from rounding, so that their masks are exact. The
mixture-of-experts ops' cases (FP8 experts too) live in ``moe_cases``, the quantized linears' in ``quant_op_cases``.
"""

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from chitu_core.conformance.case import Case, Outcome, Target, nbytes, randn, raised, time_call
from chitu_core.conformance.compare import Verdict, check_tensor, compare, compare_argmax, worst
from chitu_core.conformance.fused_cases import linear_add, mla_inputs, rms_norm_linear  # noqa: F401
from chitu_core.conformance.guards import guard, poison_allocator
from chitu_core.conformance.moe_cases import (  # noqa: F401
    by_expert_id,
    fused_experts,
    fused_experts_fp8,
    fused_experts_full_size,
    moe_route,
)
from chitu_core.conformance.norm_cases import fused_add_offset_rms_norm, layer_norm, offset_rms_norm  # noqa: F401
from chitu_core.conformance.quant_op_cases import (  # noqa: F401
    fp8_linear, gguf_linear, int4_linear, int4_linear_add, int4_rms_norm_linear, int8_linear)
from chitu_core.conformance.thresholds import OP_FAMILY
from chitu_core.ops import reference
from chitu_core.ops.spec import OP_NAMES, OpSet

Tensor = torch.Tensor
NINF = float("-inf")

FLOAT32_ONLY = frozenset({"apply_top_k_top_p", "apply_min_p", "apply_penalties", "random_sample"})
"""Ops whose contract takes float32 operands: they have cases in the float32 column only."""
FLOAT32_OUT = frozenset({"apply_temperature", "apply_top_k_top_p", "apply_min_p", "apply_penalties", "log_softmax",
                         "linear_float32"})
INDEX_OUT = frozenset({"greedy_sample", "random_sample"})
OUT_DTYPES = {"moe_route": (torch.float32, torch.int64)}
"""Ops whose outputs differ in dtype: one per output."""
OUTPUT_NAMES = {"fused_add_rms_norm": ("out", "residual"), "fused_add_offset_rms_norm": ("out", "residual"),
                "rotary_embedding": ("q", "k"),
                "moe_route": ("weights", "ids")}
SCORES = {"greedy_sample": lambda logits: logits, "random_sample": lambda probs, exponentials: probs / exponentials}
CANONICAL = {"moe_route": by_expert_id}
"""Ops whose outputs have free parts (an order) the contract does not fix: both sides are put in one form first."""


@dataclass
class In:
    """A tensor argument and the memory layout it is handed over in."""

    value: Tensor
    layout: str = "contiguous"


@dataclass
class Spec:
    label: str
    params: dict
    make: Callable[[torch.Generator], tuple[list, dict]]  # -> (positional args, keyword args)
    flops: Callable[[list], int] | None = None


def _upcast(a):
    """Operands for the float64 reference: floating tensors in float64, but FP8 weights as they are (the
    reference dequantizes them exactly; a float64 copy of full-size experts would take gigabytes)."""
    return a.to(torch.float64) if isinstance(a, Tensor) and a.is_floating_point() and a.element_size() > 1 else a


def run_op_case(op: str, spec: Spec, case: Case, target: Target) -> Outcome:
    source = target.ops.sources[op].kind
    args, kwargs = spec.make(case.generator())
    host = [a.value if isinstance(a, In) else a for a in args]
    want = getattr(reference, op)(*map(_upcast, host), **kwargs)
    wants = want if isinstance(want, tuple) else (want,)
    out_dtypes = OUT_DTYPES.get(op) or (torch.int64 if op in INDEX_OUT else torch.float32 if op in FLOAT32_OUT
                                        else case.dtype,) * len(wants)
    guarded = [guard(a.value, target.device, a.layout) if isinstance(a, In) else None for a in args]
    call_args = [g.view if g is not None else a for g, a in zip(guarded, args)]
    impl = getattr(target.ops, op)
    poison_allocator(target.device, [(w.numel(), d) for w, d in zip(wants, out_dtypes)])
    try:
        got = impl(*call_args, **kwargs)
    except Exception as exc:  # the backend's own failure is the case's result
        return Outcome(raised(exc, op).verdict, source)
    names = list(inspect.signature(getattr(OpSet, op)).parameters)[1:]
    for name, g in zip(names, guarded):
        if g is not None and (problem := g.changed()):
            return Outcome(Verdict.fail(f"{op} wrote into its operand `{name}`: {problem}"), source)
    gots = got if isinstance(want, tuple) else (got,)
    if isinstance(want, tuple) and not (isinstance(got, tuple) and len(got) == len(want)):
        return Outcome(Verdict.fail(f"{op} returned {type(got).__name__}, the contract gives a tuple of {len(want)}"), source)
    output_names = OUTPUT_NAMES.get(op, ("output",))
    for g, w, dtype, name in zip(gots, wants, out_dtypes, output_names):
        if problem := check_tensor(g, tuple(w.shape), dtype, target.device, name):
            return Outcome(Verdict.fail(problem), source)
    if op in CANONICAL:
        gots, wants = CANONICAL[op](*gots), CANONICAL[op](*wants)
    threshold = target.threshold(case)
    verdicts = []
    for g, w, name in zip(gots, wants, output_names):
        if op in SCORES:
            verdicts.append(compare_argmax(g, SCORES[op](*map(_upcast, host)), threshold, name))
        else:
            verdicts.append(compare(g, w, threshold, name))
    perf = None
    if target.perf is not None:
        perf = time_call(target, lambda: impl(*call_args, **kwargs), nbytes(call_args, gots),
                         spec.flops(host) if spec.flops else None)
    return Outcome(worst(verdicts), source, perf)


# ----- operands, op by op (dtype: the case's activation dtype) -----


def rms_norm(dtype) -> Iterator[Spec]:
    for shape, layout, scale, eps in [((1, 1), "contiguous", 3.0, 1e-6), ((7, 96), "padded", 3.0, 1e-6),
                                      ((3, 5, 33), "transposed", 3.0, 1e-6), ((17, 1024), "contiguous", 1.0, 1e-6),
                                      ((2, 1025), "strided", 1.0, 1e-5), ((4, 4096), "contiguous", 1.0, 1e-6),
                                      ((3, 4097), "padded", 1.0, 1e-6), ((4, 9), "contiguous", 1e-3, 1e-3)]:
        def make(gen, shape=shape, layout=layout, scale=scale, eps=eps):
            x = randn(gen, *shape, dtype=dtype, scale=scale)
            return [In(x, layout), In(randn(gen, shape[-1], dtype=dtype, scale=0.3, offset=1.0), "strided"), eps], {}
        yield Spec(f"{'x'.join(map(str, shape))} {layout} eps={eps:g}", {"shape": list(shape), "eps": eps}, make)


def fused_add_rms_norm(dtype) -> Iterator[Spec]:
    for shape, lx, lr in [((1, 1), "contiguous", "strided"), ((7, 96), "padded", "transposed"),
                          ((3, 5, 33), "transposed", "padded"), ((65, 2048), "contiguous", "contiguous"),
                          ((2, 4097), "strided", "contiguous")]:
        def make(gen, shape=shape, lx=lx, lr=lr):
            x, residual = randn(gen, *shape, dtype=dtype), randn(gen, *shape, dtype=dtype, scale=2.0)
            return [In(x, lx), In(residual, lr), In(randn(gen, shape[-1], dtype=dtype, scale=0.3, offset=1.0)), 1e-5], {}
        yield Spec(f"{'x'.join(map(str, shape))} x {lx}, residual {lr}", {"shape": list(shape), "eps": 1e-5}, make)


def _cos_sin_cache(gen, positions: int, rot: int) -> Tensor:
    angles = torch.rand(positions, rot // 2, generator=gen, dtype=torch.float64) * 100.0
    return torch.cat((angles.cos(), angles.sin()), -1).float()


def rotary_embedding(dtype) -> Iterator[Spec]:
    for is_neox in (True, False):
        for t, hq, hk, d, rot, max_pos, layout in [(1, 1, 1, 2, 2, 8, "contiguous"), (7, 4, 2, 64, 64, 64, "padded"),
                                                   (5, 3, 1, 40, 24, 64, "padded"),
                                                   (33, 32, 8, 128, 128, 8192, "padded"),
                                                   (17, 8, 1, 128, 64, 4096, "contiguous")]:
            def make(gen, t=t, hq=hq, hk=hk, d=d, rot=rot, max_pos=max_pos, layout=layout, is_neox=is_neox):
                positions = torch.randint(0, max_pos, (t,), generator=gen)
                positions[0] = max_pos - 1
                q, k = randn(gen, t, hq, d, dtype=dtype), randn(gen, t, hk, d, dtype=dtype)
                cache = _cos_sin_cache(gen, max_pos, rot)
                return [In(positions, layout), In(q, layout), In(k, layout), In(cache), is_neox], {}
            params = {"tokens": t, "num_heads": hq, "num_kv_heads": hk, "head_dim": d, "rotary_dim": rot,
                      "is_neox": is_neox}
            yield Spec(f"{'neox' if is_neox else 'interleaved'} T={t} Hq={hq} Hk={hk} D={d} R={rot} {layout}",
                       params, make)


def _gated(dtype, shapes, approximate=None) -> Iterator[Spec]:
    for shape, layout in shapes:
        def make(gen, shape=shape, layout=layout):
            return [In(randn(gen, *shape, dtype=dtype, scale=2.0), layout)], ({} if approximate is None
                                                                               else {"approximate": approximate})
        params = {"shape": list(shape)} | ({} if approximate is None else {"approximate": approximate})
        yield Spec(f"{'x'.join(map(str, shape))} {layout}" + (f" {approximate}" if approximate else ""), params, make)


GATED_SHAPES = [((1, 2), "contiguous"), ((7, 26), "transposed"), ((2, 3, 14), "padded"),
                ((17, 2048), "contiguous"), ((5, 2050), "strided"), ((64, 5632), "contiguous")]


def silu_and_mul(dtype) -> Iterator[Spec]:
    yield from _gated(dtype, GATED_SHAPES)


def gelu_and_mul(dtype) -> Iterator[Spec]:
    for approximate in ("none", "tanh"):
        yield from _gated(dtype, GATED_SHAPES[:5], approximate)


LINEAR_SHAPES = [  # (leading dims of x, K, N, bias, x layout, weight layout): GEMV, GEMM, both sides of 16
    ((1,), 1, 1, True, "contiguous", "contiguous"), ((7,), 33, 5, True, "transposed", "transposed"),
    ((2, 3), 64, 17, False, "padded", "contiguous"), ((5,), 31, 129, False, "contiguous", "strided"),
    ((1,), 4096, 256, False, "contiguous", "contiguous"), ((16,), 512, 511, True, "contiguous", "contiguous"),
    ((17,), 512, 513, True, "padded", "contiguous"), ((64,), 1024, 1024, False, "contiguous", "contiguous"),
    ((65,), 257, 384, True, "contiguous", "transposed"),
]


def linear(dtype) -> Iterator[Spec]:
    for m, k, n, bias, lx, lw in LINEAR_SHAPES:
        def make(gen, m=m, k=k, n=n, bias=bias, lx=lx, lw=lw):
            x, w = randn(gen, *m, k, dtype=dtype), randn(gen, n, k, dtype=dtype, scale=k**-0.5)
            return [In(x, lx), In(w, lw), In(randn(gen, n, dtype=dtype), "strided") if bias else None], {}
        rows = 1
        for s in m:
            rows *= s
        yield Spec(f"M={'x'.join(map(str, m))} K={k} N={n}{' bias' if bias else ''} x {lx}, weight {lw}",
                   {"m": rows, "k": k, "n": n, "bias": bias}, make, flops=lambda host, r=rows, k=k, n=n: 2 * r * k * n)


LINEAR_FLOAT32_SHAPES = [  # (leading dims of x, K, N, x layout, weight layout): DeepSeek-V2-Lite's and V3's routers,
    ((1,), 2048, 64, "contiguous", "contiguous"), ((1,), 7168, 256, "padded", "contiguous"),  # odd sizes, batches
    ((5,), 33, 7, "transposed", "transposed"), ((2, 3), 130, 160, "contiguous", "strided"),
    ((32,), 2048, 64, "contiguous", "contiguous"),
]


def linear_float32(dtype) -> Iterator[Spec]:  # contract 1.11: x in the case's dtype, the weight float32
    for m, k, n, lx, lw in LINEAR_FLOAT32_SHAPES:
        def make(gen, m=m, k=k, n=n, lx=lx, lw=lw):
            x, w = randn(gen, *m, k, dtype=dtype), randn(gen, n, k, dtype=torch.float32, scale=k**-0.5)
            return [In(x, lx), In(w, lw)], {}
        rows = 1
        for s in m:
            rows *= s
        yield Spec(f"M={'x'.join(map(str, m))} K={k} N={n} x {lx}, float32 weight {lw}",
                   {"m": rows, "k": k, "n": n}, make, flops=lambda host, r=rows, k=k, n=n: 2 * r * k * n)


def embedding(dtype) -> Iterator[Spec]:
    for vocab, hidden, ids_shape, lids, lw in [(11, 6, (1,), "contiguous", "contiguous"),
                                               (11, 6, (3, 5), "padded", "transposed"),
                                               (11, 1, (4,), "contiguous", "strided"),
                                               (4099, 128, (37,), "contiguous", "contiguous")]:
        def make(gen, vocab=vocab, hidden=hidden, ids_shape=ids_shape, lids=lids, lw=lw):
            ids = torch.randint(0, vocab, ids_shape, generator=gen)
            ids.view(-1)[0], ids.view(-1)[-1] = vocab - 1, 0  # both ends of the table
            return [In(ids, lids), In(randn(gen, vocab, hidden, dtype=dtype), lw)], {}
        yield Spec(f"V={vocab} H={hidden} ids {'x'.join(map(str, ids_shape))} {lids}, weight {lw}",
                   {"vocab": vocab, "hidden": hidden, "ids": list(ids_shape)}, make)


def greedy_sample(dtype) -> Iterator[Spec]:
    for rows, vocab, layout, kind in [(1, 1, "contiguous", "random"), (5, 1000, "transposed", "random"),
                                      (3, 17, "padded", "random"), (4, 32000, "contiguous", "random"),
                                      (4, 10, "contiguous", "ties"), (6, 129, "strided", "integers")]:
        def make(gen, rows=rows, vocab=vocab, layout=layout, kind=kind):
            if kind == "integers":  # many ties at the maximum
                logits = torch.randint(-3, 4, (rows, vocab), generator=gen).to(dtype)
            else:
                logits = randn(gen, rows, vocab, dtype=dtype)
            if kind == "ties":
                logits[0, [2, 7]] = logits[1, [0, 9]] = logits[2, [9, 3, 5]] = 9.0
                logits[3] = 1.5
            return [In(logits, layout)], {}
        yield Spec(f"{rows}x{vocab} {kind} {layout}", {"rows": rows, "vocab": vocab}, make)


def apply_temperature(dtype) -> Iterator[Spec]:
    for rows, vocab, layout in [(5, 33, "transposed"), (1, 1, "contiguous"), (8, 4099, "padded")]:
        def make(gen, rows=rows, vocab=vocab, layout=layout):
            t = torch.tensor([0.5, 0.0, 1.0, 1.7, 1e-3, 0.3, 2.5, 0.0])[:rows] if rows > 1 else torch.tensor([0.3])
            return [In(randn(gen, rows, vocab, dtype=dtype, scale=3.0), layout), In(t, "strided")], {}
        yield Spec(f"{rows}x{vocab} {layout}", {"rows": rows, "vocab": vocab}, make)


def _mid_gaps(sorted_desc: Tensor, picks: Tensor, min_gap: float) -> Tensor:
    """Per row, a value halfway between two neighbours of the descending ``sorted_desc`` at least ``min_gap``
    apart, the pair chosen near position ``picks``; boundaries placed there are far from any rounding."""
    out = []
    for row, j in zip(sorted_desc, picks.tolist()):
        gaps = row[:-1] - row[1:]
        good = (gaps > min_gap).nonzero().flatten()
        i = int(good[(good - j).abs().argmin()]) if good.numel() else 0
        out.append((row[i] + row[i + 1]) / 2 if good.numel() else row[0] + 1.0)
    return torch.stack(out)


def apply_top_k_top_p(dtype) -> Iterator[Spec]:
    for rows, vocab, kind in [(6, 101, "random"), (1, 1, "random"), (16, 4099, "random"), (8, 40, "ties")]:
        def make(gen, rows=rows, vocab=vocab, kind=kind):
            if kind == "ties":
                logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float()
            else:
                logits = randn(gen, rows, vocab, scale=3.0)
            top_k = torch.randint(0, vocab + 3, (rows,), generator=gen)
            top_k[: min(rows, 4)] = torch.tensor([0, 1, vocab, -1])[: min(rows, 4)]
            k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
            ranked = logits.double().sort(-1, descending=True).values
            kept = ranked.masked_fill(ranked < ranked.gather(1, (k - 1)[:, None]), NINF)
            cum = kept.softmax(-1).cumsum(-1)  # descending order: cumulative mass after each token
            picks = torch.randint(0, max(vocab - 1, 1), (rows,), generator=gen)
            top_p = (1.0 - _mid_gaps(1.0 - cum, picks, 1e-3)).clamp(1e-4, 1.0).float()
            top_p[::3] = 1.0
            if kind == "ties":
                top_p[:] = 1.0  # every tie at the k-th value is kept: exact whatever the rounding
            return [In(logits, "transposed"), In(top_k), In(top_p, "strided")], {}
        yield Spec(f"{rows}x{vocab} {kind}", {"rows": rows, "vocab": vocab}, make)


def apply_min_p(dtype) -> Iterator[Spec]:
    for rows, vocab in [(4, 101), (1, 1), (8, 4099)]:
        def make(gen, rows=rows, vocab=vocab):
            logits = randn(gen, rows, vocab, scale=3.0)
            probs = logits.double().softmax(-1)
            ratio = (probs / probs.amax(-1, keepdim=True)).sort(-1, descending=True).values
            min_p = _mid_gaps(ratio, torch.randint(0, max(vocab // 4, 1), (rows,), generator=gen), 1e-3).float()
            min_p[0] = 0.0
            if rows > 3:
                min_p[3] = 1.0  # only the top token (and exact ties with it) stays
            return [In(logits, "transposed"), In(min_p.clamp(0.0, 1.0))], {}
        yield Spec(f"{rows}x{vocab}", {"rows": rows, "vocab": vocab}, make)


def apply_penalties(dtype) -> Iterator[Spec]:
    for rows, vocab, count_dtype, layout in [(6, 101, torch.int32, "strided"), (6, 101, torch.int64, "transposed"),
                                             (1, 1, torch.int64, "contiguous"), (16, 4099, torch.int32, "contiguous")]:
        def make(gen, rows=rows, vocab=vocab, count_dtype=count_dtype, layout=layout):
            logits = randn(gen, rows, vocab, scale=3.0)
            logits[:, ::17] = NINF  # banned tokens stay banned
            prompt_mask = torch.rand(rows, vocab, generator=gen) < 0.3
            counts = torch.randint(1, 5, (rows, vocab), generator=gen) * (torch.rand(rows, vocab, generator=gen) < 0.4)
            repetition = torch.rand(rows, generator=gen) * 1.5 + 0.5
            frequency, presence = torch.rand(rows, generator=gen) * 4 - 2, torch.rand(rows, generator=gen) * 4 - 2
            repetition[0], frequency[0], presence[0] = 1.0, 0.0, 0.0  # a neutral row stays exactly unchanged
            return [In(logits, layout), In(prompt_mask, "strided"), In(counts.to(count_dtype), layout),
                    In(repetition, "strided"), In(frequency), In(presence, "strided")], {}
        yield Spec(f"{rows}x{vocab} counts {str(count_dtype).removeprefix('torch.')} {layout}",
                   {"rows": rows, "vocab": vocab}, make)


def random_sample(dtype) -> Iterator[Spec]:
    for rows, vocab in [(1, 1), (8, 257), (64, 4099)]:
        def make(gen, rows=rows, vocab=vocab):
            probs = randn(gen, rows, vocab, scale=2.0, dtype=torch.float64).softmax(-1)
            if vocab > 1:
                probs[:, ::3] = 0.0  # excluded tokens are never drawn
            probs = (probs / probs.sum(-1, keepdim=True)).float()
            exponentials = torch.empty(rows, vocab, dtype=torch.float64).exponential_(generator=gen).float()
            return [In(probs, "transposed"), In(exponentials, "strided")], {}
        yield Spec(f"{rows}x{vocab}", {"rows": rows, "vocab": vocab}, make)


def log_softmax(dtype) -> Iterator[Spec]:
    for rows, vocab, layout, scale in [(5, 33, "transposed", 4.0), (1, 1, "strided", 1.0),
                                       (3, 32000, "contiguous", 10.0), (17, 4099, "padded", 3.0)]:
        def make(gen, rows=rows, vocab=vocab, layout=layout, scale=scale):
            return [In(randn(gen, rows, vocab, dtype=dtype, scale=scale), layout)], {}
        yield Spec(f"{rows}x{vocab} {layout}", {"rows": rows, "vocab": vocab}, make)


SPECS: dict[str, Callable[[torch.dtype], Iterator[Spec]]] = {name: globals()[name] for name in OP_NAMES}


PERF_SPECS: dict[str, Callable[[torch.dtype], Iterator[Spec]]] = {"fused_experts": fused_experts_full_size}
"""Full-size cases only perf mode runs (their float64 reference is costly)."""


def op_cases(dtypes: tuple[torch.dtype, ...], perf: bool = False) -> list[Case]:
    cases = []
    for op in OP_NAMES:
        for dtype in dtypes:
            if op in FLOAT32_ONLY and dtype != torch.float32:
                continue
            specs = list(SPECS[op](dtype)) + (list(PERF_SPECS[op](dtype)) if perf and op in PERF_SPECS else [])
            for spec in specs:
                cases.append(Case(op, op, OP_FAMILY[op], dtype, spec.params, spec.label, partial(run_op_case, op, spec)))
    return cases
