"""The Triton int4_linear (``chitu_core.kernels.triton.int4_linear``) on the CPU, under Triton's interpreter.

float32 activations (see test_triton_kernels.py for why), small shapes, every path the launcher can
take: the matrix-vector kernel (one row) and the tl.dot tiles, the latter with a K tile inside one group
(scale after the products) and across groups (scale per row), split-K with its in-kernel ordered sum, ragged
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
    from chitu_core.kernels.triton.gemv import GemvConfig, gemv_config
    from chitu_core.kernels.triton.int4_linear import Int4Config
    from chitu_core.kernels.triton.split_k import split_counters


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


CASES = [
    # m, k, n, group, config: Int4Config (block_m, block_n, block_k, split_k) or GemvConfig (block_n, block_k, split_k)
    (1, 256, 64, 128, GemvConfig(32, 128, 1)),  # matrix-vector: one group a tile
    (1, 512, 96, 128, GemvConfig(32, 64, 4)),   # split-K, N ragged at the block
    (1, 1024, 40, 32, GemvConfig(16, 32, 3)),   # groups of 32, three uneven slices
    (1, 384, 48, 128, None),                    # the default matrix-vector tiles
    (5, 256, 48, 128, Int4Config(16, 16, 128, 2)),  # one group a tile, split-K
    (20, 256, 32, 64, Int4Config(16, 32, 128, 1)),  # tiles across groups (per-row scales), two row blocks
    (3, 96, 24, 32, Int4Config(16, 16, 64, 1)),     # K = 96 not a multiple of the tile
    (2, 192, 16, 64, Int4Config(16, 16, 32, 3)),    # split into 3 slices of two tiles
    (33, 384, 40, 128, Int4Config(16, 32, 128, 1)),
    (1, 256, 32, 128, Int4Config(16, 32, 128, 2)),  # one row through the tiled kernel, when asked
]


@pytest.mark.parametrize("m,k,n,group,config", CASES, ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-g{c[3]}-{c[4]}" for c in CASES])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_paths_match_the_reference(m, k, n, group, config, bias):
    x, qweight, scales, zeros = operands(m, k, n, group)
    b = torch.randn(n) if bias else None
    check(x, qweight, scales, zeros, group, b, config)
    assert split_counters(x.device).count_nonzero() == 0  # split-K leaves its counters as it found them


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
    """The tiles picked are the ones the sweeps found fastest (see the config functions' docstrings)."""
    gemv = [gemv_config(n, k, 128, 132) for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]]
    assert [(c.block_n, c.block_k, c.split_k) for c in gemv] == [(64, 128, 6), (64, 128, 9), (64, 128, 2),
                                                                 (64, 128, 9)]
    assert gemv_config(4096, 4096, 32, 132).block_k == 32
    tiled = [int4.int4_config(m, n, k, 128, 132)
             for m, n, k in [(16, 4096, 4096), (64, 4096, 14336), (64, 28672, 4096), (16, 6144, 4096)]]
    assert [(c.block_m, c.block_n, c.block_k, c.split_k) for c in tiled] == [(16, 64, 128, 4), (64, 64, 128, 4),
                                                                            (64, 128, 128, 3), (16, 64, 128, 4)]


def test_split_k_is_deterministic():
    x, qweight, scales, zeros = operands(1, 2048, 64, 128, seed=3)
    one = int4.int4_linear(x, qweight, scales, zeros, 128, None, GemvConfig(32, 128, 8))
    assert torch.equal(one, int4.int4_linear(x, qweight, scales, zeros, 128, None, GemvConfig(32, 128, 8)))


def test_operands_that_do_not_fit_are_errors():
    x, qweight, scales, zeros = operands(1, 256, 32, 64)
    with pytest.raises(ValueError, match="do not fit"):
        int4.int4_linear(x, qweight, scales, zeros, 128, None)
    with pytest.raises(ValueError, match="needs block_m, block_n and block_k >= 16"):
        int4.int4_linear(x, qweight, scales, zeros, 64, None, Int4Config(1, 32, 128, 1))
    with pytest.raises(ValueError, match="matrix-vector kernel's, for one row of x, not 2"):
        int4.int4_linear(torch.cat([x, x]), qweight, scales, zeros, 64, None, GemvConfig(32, 64, 1))
    with pytest.raises(ValueError, match="must be a multiple of 8 dividing group size 64"):
        int4.int4_linear(x, qweight, scales, zeros, 64, None, GemvConfig(32, 128, 1))
