"""The Triton MoE kernels (``chitu_core.kernels.triton.moe``, ``moe_align``) on the CPU, under Triton's interpreter.

float32 only, small shapes (see test_triton_kernels.py for why): the alignment against a Python
oracle, exactly; routing at every model configuration of the conformance cases, ids as per-row sets;
both fused_experts paths against the float64 reference, with negative ids, idle experts and
non-contiguous operands. And what lets a device graph capture them: every aten op the launchers run,
with the shape of what it returns, is the same whatever the routing, and none of them reads a value
back to the host.
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.conformance.moe_cases import ROUTERS, by_expert_id, route_operands
from chitu_core.ops import reference
from test_ops import assert_unmodified, randn, snapshot, strided, transposed

with interpreter():
    import chitu_core.kernels.triton.moe as moe
    import chitu_core.kernels.triton.moe_align as moe_align


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


def routing(tokens: int, experts: int, top_k: int, pool: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids): top_k distinct experts per token among the first ``pool``."""
    ids = torch.rand(tokens, pool or experts).argsort(-1)[:, :top_k]
    weights = torch.rand(tokens, top_k) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def expected_alignment(ids: torch.Tensor, experts: int, block_m: int) -> tuple[list[int], list[int]]:
    slots, flat = ids.numel(), ids.reshape(-1)
    rows, blocks = [], []
    for e in range(experts):
        mine = (flat == e).nonzero().flatten().tolist()
        padded = -(-len(mine) // block_m) * block_m
        rows += mine + [slots] * (padded - len(mine))
        blocks += [e] * (padded // block_m)
    return rows, blocks


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (7, 8, 2, 16), (300, 60, 4, 32),
                                                         (40, 256, 8, 16), (200, 8, 2, 64)])
def test_align_sorts_slots_by_expert_padded_to_blocks(tokens, experts, top_k, block_m):
    _, ids = routing(tokens, experts, top_k)
    ids[0, 0] = -1
    ids[tokens // 2] = -1
    for layout in (lambda t: t, transposed):
        sorted_slots, block_expert = moe_align.align(layout(ids), experts, block_m)
        rows, blocks = expected_alignment(ids, experts, block_m)
        assert sorted_slots.numel() == moe_align.padded_size(ids.numel(), experts, block_m)
        assert sorted_slots[: len(rows)].tolist() == rows
        assert block_expert.tolist() == blocks + [-1] * (block_expert.numel() - len(blocks))


def test_padded_size_is_the_bound_and_is_reached():
    for slots, experts, block_m in [(1, 8, 16), (8, 8, 16), (64, 256, 16), (4096, 128, 64)]:
        size = moe_align.padded_size(slots, experts, block_m)
        assert size % block_m == 0 and size >= slots + min(experts, slots) * (block_m - 1)
        assert size - (slots + min(experts, slots) * (block_m - 1)) < block_m
    ids = torch.arange(8)[:, None]  # 8 slots on 8 experts: every run is one slot and 15 padding rows
    sorted_slots, block_expert = moe_align.align(ids, 8, 16)
    assert sorted_slots.numel() == 128 and block_expert.tolist() == list(range(8))


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: r.model)
def test_moe_route_matches_reference(router):
    logits, bias = route_operands(torch.Generator().manual_seed(router.experts), router, 5, torch.float32)
    kwargs = router.kwargs() | {"correction_bias": None if bias is None else strided(bias)}
    got = moe.moe_route(transposed(logits), router.top_k, **kwargs)
    want = reference.moe_route(logits.double(), router.top_k, **(kwargs | {
        "correction_bias": None if bias is None else bias.double()}))
    (gw, gi), (ww, wi) = by_expert_id(*got), by_expert_id(*want)
    assert gw.dtype == torch.float32 and torch.equal(gi, wi)
    torch.testing.assert_close(gw.double(), ww, rtol=1e-5, atol=1e-7)


def check_experts(path: str, x, w13, w2, weights, ids, activation="silu", config=None) -> torch.Tensor:
    args = (x, w13, w2, weights, ids)
    snap = snapshot(args)
    got = moe.fused_experts(*args, activation=activation, path=path, config=config)
    assert_unmodified(snap)
    want = reference.fused_experts(*[a.double() if a.is_floating_point() else a for a in args], activation=activation)
    assert got.dtype == x.dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    return got


def expert_weights(experts, hidden, inter):
    return randn(experts, 2 * inter, hidden, scale=hidden**-0.5), randn(experts, hidden, inter, scale=inter**-0.5)


@pytest.mark.parametrize("path", ["slots", "grouped"])
def test_fused_experts_matches_reference(path):
    w13, w2 = expert_weights(8, 40, 24)
    x = randn(5, 40)
    weights, ids = routing(5, 8, 2)
    ids[0, 1], ids[3] = -1, -1  # one slot and one whole token routed to no expert held here
    got = check_experts(path, x, w13, w2, weights, ids)
    assert torch.equal(got[3], torch.zeros(40))
    check_experts(path, strided(x), transposed(w13), strided(w2), strided(weights), transposed(ids), "gelu")
    weights, ids = routing(3, 8, 2, pool=3)  # experts 3 to 7 idle
    check_experts(path, x[:3], w13, w2, weights, ids)


def test_grouped_path_with_every_block_size():
    w13, w2 = expert_weights(4, 48, 40)
    x = randn(37, 48)
    weights, ids = routing(37, 4, 2)
    ids[:, 0] = 1  # every token on expert 1: a run of 37 slots over several blocks
    for block_m in (16, 32, 64):
        check_experts("grouped", x, w13, w2, weights, ids, config=moe.GemmConfig(block_m, 32, 16))


def test_shape_choices():
    assert moe.use_slot_path(1, 8, 128) and moe.use_slot_path(4, 8, 128) and not moe.use_slot_path(5, 8, 128)
    assert moe.use_slot_path(1, 2, 8) and not moe.use_slot_path(2, 2, 8)
    assert [moe.grouped_config(s, 8, torch.bfloat16).block_m for s in (16, 128, 129, 512, 513)] == [16, 16, 32, 32, 64]


class AtenLog(TorchDispatchMode):
    """Every aten op run inside, with the shapes of the tensors it returns."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.calls.append((str(func), [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]))
        return out


HOST_READS = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "bincount", "item", "equal")


def test_device_path_sizes_come_from_shapes_and_nothing_is_read_back():
    x = randn(6, 40)
    w13, w2 = expert_weights(8, 40, 24)
    ones = torch.ones(6, 2)
    for path in ("slots", "grouped"):
        logs = []
        for ids in (routing(6, 8, 2)[1].contiguous(), torch.full((6, 2), 3), torch.full((6, 2), -1)):
            with AtenLog() as log:
                moe.fused_experts(x, w13, w2, ones, ids, path=path)
                moe.moe_route(randn(6, 64), 6, num_groups=8, topk_groups=3)
            logs.append(log.calls)
            assert not [op for op, _ in log.calls if any(name in op for name in HOST_READS)], path
        assert logs[0] == logs[1] == logs[2], path
        assert Counter(op for op, _ in logs[0])["aten.empty.memory_format"] > 0
