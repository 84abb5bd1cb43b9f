"""The Triton kernels of ``fused_experts_fp8`` (``chitu_core.kernels.triton.moe_fp8``) on the CPU, under
Triton's interpreter (see test_triton_kernels.py), float32 activations on small shapes.

Both paths (per-slot matrix-vector products and the grouped GEMM, at each BLOCK_M) and both entry
points (weights read as float8_e4m3fn, or as bytes decoded in registers) against the float64
reference: 128x128 and smaller block scales whose last blocks are partial along both dimensions,
per-channel scales, negative ids (a slot and a whole token), idle experts, gelu, non-contiguous
operands. And what a device graph needs: the same aten ops and shapes whatever the routing, none of
them reading a value back to the host.
"""

import pytest
import torch

from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.ops import reference
from test_ops import assert_unmodified, snapshot, strided, transposed
from test_quant_moe import quantized_experts as experts
from test_triton_moe import HOST_READS, AtenLog

with interpreter():
    import chitu_core.kernels.triton.moe as moe
    import chitu_core.kernels.triton.moe_fp8 as moe_fp8


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


ENTRIES = [moe_fp8.fused_experts_fp8, moe_fp8.fused_experts_fp8_bytes]


def routing(gen, tokens: int, num: int, top_k: int, pool: int | None = None):
    ids = torch.rand(tokens, pool or num, generator=gen).argsort(-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def check(entry, path, x, w13, s13, w2, s2, block, weights, ids, activation="silu", config=None) -> torch.Tensor:
    args = (x, w13, s13, w2, s2, block, weights, ids)
    snap = snapshot([a for a in args if isinstance(a, torch.Tensor) and a.dtype != torch.float8_e4m3fn])
    got = entry(*args, activation=activation, path=path, config=config)
    assert_unmodified(snap)
    want = reference.fused_experts_fp8(x.double(), w13, s13.double(), w2, s2.double(), block, weights, ids, activation)
    assert got.dtype == x.dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    return got


@pytest.mark.parametrize("entry", ENTRIES, ids=["fp8", "bytes"])
@pytest.mark.parametrize("path", ["slots", "grouped"])
@pytest.mark.parametrize("block", [(128, 128), (32, 32), (16, 64), None], ids=["128", "32", "16x64", "channel"])
def test_fused_experts_fp8_matches_the_reference(entry, path, block):
    gen = torch.Generator().manual_seed(0)
    w13, s13, w2, s2 = experts(gen, 8, 80, 48, block)  # H 80, I 48: last blocks partial for every block size
    x = torch.randn(5, 80, generator=gen)
    weights, ids = routing(gen, 5, 8, 2)
    ids[0, 1], ids[3] = -1, -1  # a slot and a whole token routed to no expert held here
    got = check(entry, path, x, w13, s13, w2, s2, block, weights, ids)
    assert torch.equal(got[3], torch.zeros(80))
    check(entry, path, strided(x), transposed(w13), strided(s13), strided(w2), transposed(s2) if block else strided(s2),
          block, strided(weights), transposed(ids), "gelu")
    weights, ids = routing(gen, 3, 8, 2, pool=3)  # experts 3 to 7 idle
    check(entry, path, x[:3], w13, s13, w2, s2, block, weights, ids)


@pytest.mark.parametrize("block", [(32, 32), None], ids=["block", "channel"])
def test_grouped_path_with_every_block_size(block):
    gen = torch.Generator().manual_seed(1)
    w13, s13, w2, s2 = experts(gen, 4, 48, 40, block)
    x = torch.randn(37, 48, generator=gen)
    weights, ids = routing(gen, 37, 4, 2)
    ids[:, 0] = 1  # every token on expert 1: a run of 37 slots over several blocks
    for block_m in (16, 32, 64):
        check(moe_fp8.fused_experts_fp8, "grouped", x, w13, s13, w2, s2, block, weights, ids,
              config=moe.GemmConfig(block_m, 32, 64))  # BLOCK_K 64 narrowed to the 32-wide blocks


def test_wrong_operands_are_refused():
    gen = torch.Generator().manual_seed(2)
    w13, s13, w2, s2 = experts(gen, 2, 32, 16, (16, 16))
    weights, ids = routing(gen, 1, 2, 1)
    x = torch.randn(1, 32)
    with pytest.raises(ValueError, match=r"w13_scale must be float32 \[2, 2, 2\] for weights \[2, 32, 32\] with "
                                         r"block_size \(16, 16\), got torch.float32 \[2, 2\]"):
        moe_fp8.fused_experts_fp8(x, w13, s13[:, 0], w2, s2, (16, 16), weights, ids)
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        moe_fp8.fused_experts_fp8(x, w13.float(), s13, w2, s2, (16, 16), weights, ids)


def test_device_path_sizes_come_from_shapes_and_nothing_is_read_back():
    gen = torch.Generator().manual_seed(3)
    w13, s13, w2, s2 = experts(gen, 8, 48, 32, (16, 16))
    x, ones = torch.randn(6, 48, generator=gen), torch.ones(6, 2)
    for entry in ENTRIES:
        for path in ("slots", "grouped"):
            logs = []
            for ids in (routing(gen, 6, 8, 2)[1].contiguous(), torch.full((6, 2), 3), torch.full((6, 2), -1)):
                with AtenLog() as log:
                    entry(x, w13, s13, w2, s2, (16, 16), ones, ids, path=path)
                logs.append(log.calls)
                assert not [op for op, _ in log.calls if any(name in op for name in HOST_READS)], path
            assert logs[0] == logs[1] == logs[2], path
