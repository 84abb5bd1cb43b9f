"""The CPU backend's mixture-of-experts ops (moe_route, fused_experts) against the float64 reference.

Routing at the configurations of real models (``moe_cases.ROUTERS``) on logits with no near-tie at a
deciding boundary, ids compared as per-row sets; a hand-worked grouped example pins the semantics the
reference could share a mistake on. Experts in float32 and bfloat16 within the conformance thresholds,
with one token, experts no token chose, every token on one expert, negative ids and non-contiguous
operands; a token routed to no expert held here gets exact zeros. And the conformance cases accept
any order of a row's experts but fail a router that forgets to renormalise and experts that read a
negative id as the last expert.
"""

import pytest
import torch
import torch.nn.functional as F

from chitu_core.conformance.case import Target
from chitu_core.conformance.moe_cases import ROUTERS, by_expert_id, route_operands
from chitu_core.conformance.runner import Session, build_cases
from chitu_core.conformance.thresholds import ThresholdBook, default
from chitu_core.ops import reference
from chitu_core.ops.table import resolve_ops
from chitu_core.plugins import backend_ops, get_backend
from test_ops import assert_unmodified, randn, snapshot, strided, transposed

OPS = backend_ops(get_backend("cpu"))
ROUTE_TOL = dict(rtol=1e-5, atol=1e-7)


def assert_same_routes(got: tuple, want: tuple) -> None:
    (gw, gi), (ww, wi) = by_expert_id(*got), by_expert_id(*want)
    assert gw.dtype == torch.float32 and gi.dtype == torch.int64
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gw.double(), ww.double(), **ROUTE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: r.model)
def test_route_matches_reference(router, dtype):
    gen = torch.Generator().manual_seed(router.experts)
    for tokens in (1, 37):
        logits, bias = route_operands(gen, router, tokens, dtype)
        args = (transposed(logits), router.top_k)
        kwargs = router.kwargs() | {"correction_bias": None if bias is None else strided(bias)}
        snap = snapshot(args + (kwargs["correction_bias"],))
        got = OPS.moe_route(*args, **kwargs)
        assert_unmodified(snap)
        bias64 = None if bias is None else bias.double()
        want = reference.moe_route(logits.double(), router.top_k, **(kwargs | {"correction_bias": bias64}))
        assert_same_routes(got, want)


def test_grouped_route_by_hand():
    # 8 experts in 4 groups of 2, sigmoid scores s; the bias lifts expert 6 into the choice, but the weights
    # are the scores without it. Group scores (top2_sum of s + bias): g0 = .9+.1, g1 = .8+.7, g2 = .2+.3,
    # g3 = (.05+.9)+.6: the best two groups are g3 and g1, so expert 0 (s = .9) is out; the top 3 of experts
    # 2, 3, 6, 7 by s + bias (.8, .7, .95, .6): 6, 2, 3; weights their scores .05, .8, .7 renormalised, times 2.
    s = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.2, 0.3, 0.05, 0.6]], dtype=torch.float64)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0.9, 0], dtype=torch.float32)
    logits = torch.logit(s).float()
    weights, ids = OPS.moe_route(logits, 3, "sigmoid", True, bias, 4, 2, "top2_sum", 2.0)
    weights, ids = by_expert_id(weights, ids)
    assert ids.tolist() == [[2, 3, 6]]
    torch.testing.assert_close(weights, torch.tensor([[0.8, 0.7, 0.05]]) / 1.55 * 2.0)


def test_group_score_max_keeps_the_groups_of_the_best_experts():
    logits = torch.tensor([[5.0, -9.0, -9.0, -9.0, 1.0, 0.9, 4.0, -2.0]])  # groups of 2: maxima 5, -9, 1, 4
    weights, ids = OPS.moe_route(logits, 3, num_groups=4, topk_groups=2, group_score="max")
    assert sorted(ids.tolist()[0]) == [0, 6, 7]  # expert 4 (logit 1 > -2) is out with its group
    assert weights.sum() < 1  # softmax over all 8 experts, no renormalisation


def experts_operands(dtype, tokens, experts, top_k, hidden=48, inter=40):
    x = randn(tokens, hidden, dtype=dtype)
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    ids = torch.rand(tokens, experts).argsort(-1)[:, :top_k]
    weights = torch.rand(tokens, top_k) + 0.1
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def assert_experts_match(args, dtype, activation="silu"):
    snap = snapshot(args)
    got = OPS.fused_experts(*args, activation=activation)
    assert_unmodified(snap)
    want = reference.fused_experts(*[a.double() if a.is_floating_point() else a for a in args], activation=activation)
    assert got.dtype == dtype and got.shape == want.shape
    threshold = default("experts", dtype)
    err = got.double() - want
    assert float(err.pow(2).sum() / want.pow(2).sum()) <= threshold.limit
    assert float(err.abs().max()) <= threshold.rtol * float(want.abs().max())
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_experts_matches_reference(dtype):
    for tokens, experts, top_k in [(1, 8, 2), (7, 60, 4), (64, 16, 4), (300, 64, 6)]:
        assert_experts_match(experts_operands(dtype, tokens, experts, top_k), dtype)
    x, w13, w2, weights, ids = experts_operands(dtype, 9, 8, 2)
    assert_experts_match((x, w13, w2, weights, ids), dtype, activation="gelu")
    # non-contiguous everything: x and the routing as every other element of wider tensors, K-major weights
    assert_experts_match((strided(x), transposed(w13), transposed(w2), strided(weights), strided(ids)), dtype)


def test_experts_no_token_chose_and_all_tokens_on_one_expert():
    x, w13, w2, weights, ids = experts_operands(torch.float32, 33, 16, 3)
    ids = torch.rand(33, 4).argsort(-1)[:, :3] * 4  # only experts 0, 4, 8 and 12 are hit
    assert_experts_match((x, w13, w2, weights, ids), torch.float32)
    ids[:, 0] = 5  # every token's first slot on expert 5
    assert_experts_match((x, w13, w2, weights, ids), torch.float32)
    one = torch.full((33, 1), 7)
    assert_experts_match((x, w13, w2, torch.ones(33, 1), one), torch.float32)


def test_negative_ids_contribute_nothing():
    x, w13, w2, weights, ids = experts_operands(torch.float32, 6, 8, 2)
    ids[0] = -1  # routed wholly elsewhere: exact zeros
    ids[1, 1] = -1
    got, _ = assert_experts_match((x, w13, w2, weights, ids), torch.float32)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    alone = OPS.fused_experts(x[1:2], w13, w2, weights[1:2, :1], ids[1:2, :1])
    torch.testing.assert_close(got[1:2], alone, rtol=1e-6, atol=1e-7)
    assert torch.equal(OPS.fused_experts(x, w13, w2, weights, torch.full_like(ids, -1)), torch.zeros_like(x))


def test_one_expert_with_weight_one_is_the_dense_mlp():
    x, w13, w2, _, _ = experts_operands(torch.float32, 5, 4, 1)
    dense = F.linear(OPS.silu_and_mul(F.linear(x, w13[2])), w2[2])
    torch.testing.assert_close(OPS.fused_experts(x, w13, w2, torch.ones(5, 1), torch.full((5, 1), 2)), dense,
                               rtol=1e-6, atol=1e-6)


def test_no_tokens_and_bad_arguments():
    x, w13, w2, weights, ids = experts_operands(torch.bfloat16, 3, 8, 2)
    empty = OPS.fused_experts(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 48) and empty.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="activation 'relu'"):
        OPS.fused_experts(x, w13, w2, weights, ids, activation="relu")
    with pytest.raises(ValueError, match="scoring 'softplus'"):
        OPS.moe_route(torch.randn(2, 8), 2, scoring="softplus")
    with pytest.raises(ValueError, match="group_score 'mean'"):
        OPS.moe_route(torch.randn(2, 8), 2, num_groups=2, group_score="mean")


# ----- the conformance cases: a free order passes, faults fail -----


def route_reversed(*args, **kwargs):
    weights, ids = reference.moe_route(*args, **kwargs)
    return weights.flip(-1), ids.flip(-1)


def route_never_renormalizing(logits, top_k, scoring, renormalize, *rest):
    return reference.moe_route(logits, top_k, scoring, False, *rest)


def experts_taking_negative_ids_for_the_last_expert(x, w13, w2, topk_weights, topk_ids, activation="silu"):
    return reference.fused_experts(x, w13, w2, topk_weights, topk_ids % w13.shape[0], activation)


@pytest.mark.parametrize("op,impl,failing", [
    ("moe_route", route_reversed, set()),
    ("moe_route", route_never_renormalizing, {"Mixtral", "Qwen3-MoE", "DeepSeek-V3"}),
    ("fused_experts", experts_taking_negative_ids_for_the_last_expert, {"local"}),
])
def test_conformance_cases_allow_any_order_and_catch_faults(op, impl, failing):
    backend = get_backend("cpu")
    target = Target(backend, resolve_ops("planted", {op: impl}), torch.device("cpu"), ThresholdBook())
    results = Session(target, build_cases(target, (torch.float32,), op)).run_all()
    failed = {r.label for r in results if r.status == "fail"}
    assert {r.status for r in results} <= {"pass", "fail"} and results
    assert failed == {r.label for r in results if any(word in r.label.split() for word in failing)}, failed
