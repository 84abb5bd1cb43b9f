"""The Triton int4_linear (``chitu_core.kernels.triton.int4_linear``) on the CPU, under Triton's interpreter.

float32 activations (see test_triton_kernels.py for why), small shapes, every path the launcher can
take: the FMA path (decode) and the tl.dot path, each with a K tile inside one group (scale after
the products) and across groups (scale per packed row), split-K with its ordered second pass, ragged
N and K, leading dimensions, non-contiguous x and zeros, scales in three dtypes, bias or none, no
rows. Against the float64 reference (``chitu_core.ops.quant_reference``); inputs left untouched.
"""

import pytest
import torch

from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.ops import quant_reference
from test_ops import TOL, assert_unmodified, snapshot, strided, transposed

with interpreter():
    import chitu_core.kernels.triton.int4_linear as int4


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


def operands(m: int, k: int, n: int, group: int, sdtype=torch.float16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = ((torch.rand(k // group, n, generator=gen) * 0.5 + 0.5) * (2.0 / (15 * k**0.5))).to(sdtype)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).to(sdtype)
    x = torch.randn(m, k, generator=gen)
    return x, qweight, scales, zeros


def check(x, qweight, scales, zeros, group, bias=None, config=None):
    snap = snapshot((x, qweight, scales, zeros, bias))
    got = int4.int4_linear(x, qweight, scales, zeros, group, bias, config)
    assert_unmodified(snap)
    b64 = None if bias is None else bias.double()
    want = quant_reference.int4_linear(x.double(), qweight, scales, zeros, group, b64)
    assert got.dtype == x.dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])


FMA, DOT = False, True
CASES = [
    # m, k, n, group, config (block_m, block_n, block_k, split_k, use_dot)
    (1, 256, 64, 128, (1, 32, 128, 1, FMA)),   # one group a tile
    (1, 512, 96, 128, (1, 32, 128, 4, FMA)),   # split-K, N ragged at the block
    (3, 256, 40, 32, (4, 16, 128, 2, FMA)),    # groups of 32 inside a 128 tile: per-row scales
    (2, 96, 24, 32, (2, 16, 64, 1, FMA)),      # K = 96 not a multiple of the tile
    (2, 192, 16, 64, (2, 16, 32, 3, FMA)),     # split into 3 slices of two tiles
    (5, 256, 48, 128, (16, 16, 128, 2, DOT)),  # tl.dot, one group a tile, split-K
    (20, 256, 32, 64, (16, 32, 128, 1, DOT)),  # tl.dot across groups, two row blocks
    (33, 384, 40, 128, (16, 32, 128, 1, DOT)),
]


@pytest.mark.parametrize("m,k,n,group,config", CASES, ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-g{c[3]}-{c[4]}" for c in CASES])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_paths_match_the_reference(m, k, n, group, config, bias):
    x, qweight, scales, zeros = operands(m, k, n, group)
    b = torch.randn(n) if bias else None
    check(x, qweight, scales, zeros, group, b, int4.Int4Config(*config))


def test_layouts_dtypes_and_leading_dimensions():
    x, qweight, scales, zeros = operands(6, 256, 32, 64, sdtype=torch.bfloat16, seed=1)
    check(strided(x), qweight, scales, strided(zeros), 64, strided(torch.randn(32)))
    check(transposed(x), qweight, scales.float(), zeros.float(), 64)
    x3 = x.reshape(2, 3, 256)
    got = int4.int4_linear(x3, qweight, scales, zeros, 64, None)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got.reshape(6, 32), int4.int4_linear(x, qweight, scales, zeros, 64, None))
    empty = int4.int4_linear(x[:0].reshape(0, 1, 256), qweight, scales, zeros, 64, None)
    assert empty.shape == (0, 1, 32) and empty.dtype == torch.float32


@pytest.mark.parametrize("m", [1, 4, 16, 40])
def test_default_configs_run(m):
    check(*operands(m, 512, 64, 128, seed=m), 128, torch.randn(64))


def test_configs_are_the_measured_tiles():
    """The tiles int4_config picks are the ones the H100 sweep found fastest (see its docstring)."""
    decode = [int4.int4_config(1, n, k, 128, 132) for n, k in [(6144, 4096), (4096, 14336), (28672, 4096)]]
    assert [(c.block_m, c.block_n, c.split_k, c.use_dot) for c in decode] == [(16, 128, 8, True), (16, 128, 8, True),
                                                                             (16, 64, 8, True)]
    batch = [int4.int4_config(64, n, k, 128, 132) for n, k in [(4096, 4096), (28672, 4096)]]
    assert [(c.block_m, c.block_n, c.split_k) for c in batch] == [(64, 128, 4), (64, 128, 1)]
    assert all(c.split_k * c.block_k <= k for c, k in zip(decode, [4096, 14336, 4096]))


def test_operands_that_do_not_fit_are_errors():
    x, qweight, scales, zeros = operands(1, 256, 32, 64)
    with pytest.raises(ValueError, match="do not fit"):
        int4.int4_linear(x, qweight, scales, zeros, 128, None)
    with pytest.raises(ValueError, match="needs block_m, block_n >= 16"):
        int4.int4_linear(x, qweight, scales, zeros, 64, None, int4.Int4Config(1, 32, 128, 1, True))
