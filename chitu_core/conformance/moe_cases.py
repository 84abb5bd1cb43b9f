"""Cases of the mixture-of-experts ops, ``moe_route`` and ``fused_experts``, at the routers of real models.

moe_route: every routing configuration of ``ROUTERS`` at 1, 7, 64 and 300 tokens. Logits are drawn at
random, then each row with a near-tie at a boundary that decides the choice (the top_k-th allowed
expert against the next one, the topk_groups-th group score against the next) closer than MARGIN of
its largest choice is drawn again, so rounding in the backend's float32 cannot change which experts
are chosen. The contract leaves the order of a row's k entries free: ``by_expert_id`` puts both the
backend's and the reference's rows in id order before the comparison (ids exactly, each weight with
its id).

fused_experts: the expert counts and top-k of the same models with small hidden and intermediate
sizes (odd ones, off every tile size), on both sides of the shape choices kernels make (tokens per
expert below one and in the dozens, one token and a few hundred), with experts no token chose,
every token routed to one expert, slots routed to no expert held here (negative ids, as expert
parallelism gives them: a whole token's among them) and non-contiguous operands. Mixtral's full
size (H 4096, I 14336) runs in perf mode only.

fused_experts_fp8 (contract 1.3): the same kinds of routing and layouts with FP8 weights, at the full
expert shapes of DeepSeek-V2-Lite (H 2048, I 1408, E 64, top-6) and Qwen3-30B-A3B (H 2048, I 768, E
128, top-8) for a few tokens and one (in bfloat16 only), and at small odd shapes whose last scale blocks are partial; 128x128
blocks (DeepSeek-V3's), smaller blocks, and per-channel scales. Weights are random e4m3 bytes with
exponents in a band of eight binades (values 2**-3 to 30, drawn cheaply even at full size), scales
sized for outputs of O(1).
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from chitu_core.conformance.case import randn

Tensor = torch.Tensor
MARGIN = 1e-3
TOKENS = (1, 7, 64, 300)
LAYOUTS = ("contiguous", "transposed", "padded", "strided")


@dataclass(frozen=True)
class Router:
    """One model's routing: moe_route's arguments besides the logits."""

    model: str
    experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    bias: bool = False  # a correction bias (DeepSeek-V3's e_score_correction_bias)
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    scaling: float = 1.0

    def kwargs(self) -> dict:
        return dict(scoring=self.scoring, renormalize=self.renormalize, num_groups=self.num_groups,
                    topk_groups=self.topk_groups, group_score=self.group_score, scaling=self.scaling)

    def label(self) -> str:
        parts = [self.model, f"E={self.experts} k={self.top_k}", self.scoring + ("+bias" if self.bias else "")]
        if self.num_groups > 1:
            parts.append(f"groups {self.num_groups}/{self.topk_groups} {self.group_score}")
        if self.renormalize:
            parts.append("renormalized")
        if self.scaling != 1.0:
            parts.append(f"x{self.scaling:g}")
        return " ".join(parts)


ROUTERS = (
    Router("Mixtral", 8, 2, renormalize=True),
    Router("Qwen3-MoE", 128, 8, renormalize=True),
    Router("Qwen2-MoE", 60, 4),
    Router("DeepSeek-V2-Lite", 64, 6),
    Router("DeepSeek-V2", 160, 6, num_groups=8, topk_groups=3, scaling=16.0),
    Router("DeepSeek-V3", 256, 8, scoring="sigmoid", bias=True, num_groups=8, topk_groups=4,
           group_score="top2_sum", renormalize=True, scaling=2.5),
)


def _gap_below(values: Tensor, n: int) -> Tensor:
    """Per row, the n-th largest value minus the (n+1)-th (inf where there is no (n+1)-th finite one)."""
    top = values.topk(n + 1, dim=-1).values
    return (top[:, n - 1] - top[:, n]).nan_to_num(nan=float("inf"))


def near_ties(logits: Tensor, bias: Tensor | None, router: Router) -> Tensor:
    """bool [T]: rows whose choice a rounding of MARGIN times their largest choice could change."""
    x = logits.double()
    scores = x.softmax(-1) if router.scoring == "softmax" else x.sigmoid()
    choice = scores if bias is None else scores + bias.double()
    bound = MARGIN * choice.abs().amax(-1)
    close = torch.zeros(x.shape[0], dtype=torch.bool)
    if router.num_groups > 1:
        grouped = choice.view(x.shape[0], router.num_groups, -1)
        if router.group_score == "max":
            group_scores = grouped.amax(-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        close |= _gap_below(group_scores, router.topk_groups) < bound
        dropped = torch.ones_like(group_scores, dtype=torch.bool)
        dropped.scatter_(1, group_scores.topk(router.topk_groups, dim=-1).indices, False)
        choice = grouped.masked_fill(dropped[..., None], float("-inf")).view_as(choice)
    return close | (_gap_below(choice, router.top_k) < bound)


def route_operands(gen: torch.Generator, router: Router, tokens: int, dtype: torch.dtype
                   ) -> tuple[Tensor, Tensor | None]:
    """(logits [T, E] in dtype, correction bias float32 [E] or None) with no near-tie at a boundary."""
    bias = randn(gen, router.experts, scale=0.05) if router.bias else None
    logits = randn(gen, tokens, router.experts, dtype=dtype)
    for _ in range(100):
        redraw = near_ties(logits, bias, router)
        if not redraw.any():
            return logits, bias
        logits[redraw] = randn(gen, int(redraw.sum()), router.experts, dtype=dtype)
    raise RuntimeError(f"moe_route case {router.label()}: no tie-free logits in 100 draws")


def by_expert_id(weights: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """A row's (weights, ids) in ascending id order: the contract's k entries are a set."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids


def moe_route(dtype: torch.dtype) -> Iterator:
    from chitu_core.conformance.op_cases import In, Spec  # op_cases imports this module for its table

    for i, (router, tokens) in enumerate((r, t) for r in ROUTERS for t in TOKENS):
        layout = LAYOUTS[i % len(LAYOUTS)]

        def make(gen, router=router, tokens=tokens, layout=layout):
            logits, bias = route_operands(gen, router, tokens, dtype)
            # positionally, in the contract's order, so that the bias is guarded like the logits
            bias = None if bias is None else In(bias, "strided")
            return [In(logits, layout), router.top_k, router.scoring, router.renormalize, bias, router.num_groups,
                    router.topk_groups, router.group_score, router.scaling], {}

        params = {"tokens": tokens, "experts": router.experts, "top_k": router.top_k, **router.kwargs(),
                  "correction_bias": router.bias}
        yield Spec(f"{router.label()} T={tokens} {layout}", params, make)


@dataclass(frozen=True)
class ExpertsCase:
    """One fused_experts case. routing: "random" (k distinct experts per token), "idle" (only the first half
    of the experts chosen), "one" (every token's first slot on expert 0) or "local" (a quarter of the slots,
    and all of token 0's, routed to no expert held here: -1). layouts: of x, of w13 and w2, of the routing."""

    model: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: int
    routing: str = "random"
    layouts: tuple[str, str, str] = ("contiguous", "contiguous", "contiguous")
    activation: str = "silu"


EXPERTS_CASES = (
    ExpertsCase("Mixtral", 8, 2, 64, 96, 1),
    ExpertsCase("Mixtral", 8, 2, 64, 96, 7, "local", ("padded", "transposed", "strided")),
    ExpertsCase("Mixtral", 8, 2, 80, 112, 300, "one"),
    ExpertsCase("Qwen3-MoE", 128, 8, 64, 48, 1, "random", ("contiguous", "padded", "strided")),
    ExpertsCase("Qwen3-MoE", 128, 8, 64, 48, 64, "idle", ("strided", "contiguous", "transposed")),
    ExpertsCase("Qwen2-MoE", 60, 4, 48, 40, 7),
    ExpertsCase("DeepSeek-V2-Lite", 64, 6, 64, 32, 300, "local", ("contiguous", "strided", "contiguous")),
    ExpertsCase("DeepSeek-V3", 256, 8, 56, 24, 7, "local", ("transposed", "padded", "strided")),
    ExpertsCase("DeepSeek-V3", 256, 8, 56, 24, 64),
    ExpertsCase("gelu", 8, 2, 48, 40, 7, activation="gelu"),
)
PERF_EXPERTS_CASES = (ExpertsCase("Mixtral", 8, 2, 4096, 14336, 1), ExpertsCase("Mixtral", 8, 2, 4096, 14336, 64))
"""Full-size cases, for perf mode only: the float64 reference alone needs 12 GB of weights."""


def expert_routing(gen: torch.Generator, case: ExpertsCase) -> tuple[Tensor, Tensor]:
    """(topk_weights float32 [T, k], topk_ids int64 [T, k]) as ``case.routing`` describes."""
    t, e, k = case.tokens, case.experts, case.top_k
    if case.routing == "one":
        others = 1 + torch.rand(t, e - 1, generator=gen).argsort(dim=-1)[:, : k - 1]
        ids = torch.cat((torch.zeros(t, 1, dtype=torch.long), others), dim=-1)
    else:
        ids = torch.rand(t, e // 2 if case.routing == "idle" else e, generator=gen).argsort(dim=-1)[:, :k]
    if case.routing == "local":
        ids[torch.rand(t, k, generator=gen) < 0.25] = -1
        ids[0] = -1
    weights = torch.rand(t, k, generator=gen) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def fused_experts(dtype: torch.dtype, cases: tuple[ExpertsCase, ...] = EXPERTS_CASES) -> Iterator:
    from chitu_core.conformance.op_cases import In, Spec  # op_cases imports this module for its table

    for case in cases:
        def make(gen, case=case):
            lx, lw, lr = case.layouts
            x = randn(gen, case.tokens, case.hidden, dtype=dtype)
            w13 = randn(gen, case.experts, 2 * case.inter, case.hidden, dtype=dtype, scale=case.hidden**-0.5)
            w2 = randn(gen, case.experts, case.hidden, case.inter, dtype=dtype, scale=case.inter**-0.5)
            weights, ids = expert_routing(gen, case)
            return [In(x, lx), In(w13, lw), In(w2, lw), In(weights, lr), In(ids, lr)], {
                "activation": case.activation}

        params = {"tokens": case.tokens, "experts": case.experts, "top_k": case.top_k, "hidden": case.hidden,
                  "inter": case.inter, "activation": case.activation}
        label = (f"{case.model} E={case.experts} k={case.top_k} H={case.hidden} I={case.inter} T={case.tokens}"
                 f" {case.routing} {case.activation}; x {case.layouts[0]}, weights {case.layouts[1]},"
                 f" routing {case.layouts[2]}")
        yield Spec(label, params, make, flops=_flops)


def fused_experts_full_size(dtype: torch.dtype) -> Iterator:
    yield from fused_experts(dtype, PERF_EXPERTS_CASES)


def _flops(host: list) -> int:
    """Two GEMMs of 2 * I * H and H * I multiply-adds per slot routed to an expert."""
    x, w13, w2, weights, ids = host[:5]
    return int((ids >= 0).sum()) * 2 * 3 * w2.shape[1] * w2.shape[2]


FP8_EXPERTS_CASES = (  # (case, block_size)
    (ExpertsCase("DeepSeek-V2-Lite", 64, 6, 2048, 1408, 3, "local", ("contiguous", "contiguous", "strided")),
     (128, 128)),
    (ExpertsCase("Qwen3-MoE", 128, 8, 2048, 768, 1, "random", ("padded", "contiguous", "contiguous")), None),
    (ExpertsCase("Mixtral", 8, 2, 80, 48, 7, "local", ("padded", "transposed", "strided")), (32, 32)),
    (ExpertsCase("Mixtral", 8, 2, 80, 48, 1), None),
    (ExpertsCase("Qwen2-MoE", 60, 4, 48, 40, 300, "one"), (128, 128)),
    (ExpertsCase("DeepSeek-V3", 256, 8, 56, 24, 64, "idle", ("strided", "contiguous", "transposed")), None),
    (ExpertsCase("DeepSeek-V3", 256, 8, 256, 64, 7), (128, 128)),
    (ExpertsCase("gelu", 8, 2, 48, 40, 7, activation="gelu"), (16, 32)),
)
E4M3_RMS = 9.2
"""Root mean square of ``random_e4m3``'s values."""


def random_e4m3(gen: torch.Generator, *shape: int) -> Tensor:
    """float8_e4m3fn [*shape]: random sign and mantissa, exponent field uniform in 4..11 (2**-3 <= |v| < 32,
    never NaN), made from random bits four bytes at a time, without a float intermediate (the top bit of
    each int32 draw is 0, so bit 6 of each byte gives its sign)."""
    numel = 1
    for size in shape:
        numel *= size
    b = torch.randint(0, 1 << 31, (-(-numel // 4),), generator=gen, dtype=torch.int32)
    exponent = b >> 3  # in place from here: a full-size case draws 0.3 GB
    exponent &= 0x07070707
    exponent += 0x04040404
    exponent <<= 3
    sign = b & 0x40404040
    sign <<= 1
    b &= 0x07070707
    b |= sign
    b |= exponent
    return b.view(torch.uint8)[:numel].view(shape).view(torch.float8_e4m3fn)


def fp8_expert_scales(gen: torch.Generator, experts: int, n: int, k: int, block: tuple[int, int] | None) -> Tensor:
    shape = (experts, n) if block is None else (experts, -(-n // block[0]), -(-k // block[1]))
    return (torch.rand(shape, generator=gen) * 0.5 + 0.5) / (E4M3_RMS * k**0.5)


def fused_experts_fp8(dtype: torch.dtype) -> Iterator:
    from chitu_core.conformance.op_cases import In, Spec  # op_cases imports this module for its table

    for case, block in FP8_EXPERTS_CASES:
        if case.hidden >= 1024 and dtype != torch.bfloat16:
            continue  # full size in the dtype models run in only: each such case draws 0.5 GB of weights
        def make(gen, case=case, block=block):
            lx, lw, lr = case.layouts
            e, h, i = case.experts, case.hidden, case.inter
            x = randn(gen, case.tokens, h, dtype=dtype)
            w13, w2 = random_e4m3(gen, e, 2 * i, h), random_e4m3(gen, e, h, i)
            s13, s2 = fp8_expert_scales(gen, e, 2 * i, h, block), fp8_expert_scales(gen, e, h, i, block)
            weights, ids = expert_routing(gen, case)
            return [In(x, lx), In(w13, lw), In(s13, lr), In(w2, lw), In(s2, lr), block, In(weights, lr),
                    In(ids, lr)], {"activation": case.activation}

        params = {"tokens": case.tokens, "experts": case.experts, "top_k": case.top_k, "hidden": case.hidden,
                  "inter": case.inter, "activation": case.activation, "block_size": block}
        scales = "per-channel" if block is None else f"block {block[0]}x{block[1]}"
        label = (f"{case.model} E={case.experts} k={case.top_k} H={case.hidden} I={case.inter} T={case.tokens}"
                 f" {scales} {case.routing} {case.activation}; x {case.layouts[0]}, weights {case.layouts[1]},"
                 f" scales and routing {case.layouts[2]}")
        yield Spec(label, params, make, flops=_flops_fp8)


def _flops_fp8(host: list) -> int:
    w2, ids = host[3], host[7]
    return int((ids >= 0).sum()) * 2 * 3 * w2.shape[1] * w2.shape[2]
