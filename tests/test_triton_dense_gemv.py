"""The Triton dense matrix-vector kernel (``chitu_core.kernels.triton.dense_gemv``, the NVIDIA backend's linear
for one row and narrow outputs) on the CPU, under Triton's interpreter: both weight layouts (rows
contiguous, and the transposed storage the NVIDIA backend keeps), split-K with its in-kernel ordered sum,
ragged N and K, bias or none, float32 and bfloat16, a strided x and leading dimensions; against float64.
Dependent launch is a device feature the interpreter has not: it is off here (``pdl_launch``)."""

import pytest
import torch

from test_triton_kernels import interpreter  # skips this module where that one is skipped

with interpreter():
    from chitu_core.kernels.triton.dense_gemv import DenseGemvConfig, dense_gemv, dense_gemv_config
    from chitu_core.kernels.triton.pdl import pdl_launch
    from chitu_core.kernels.triton.split_k import split_counters


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


CASES = [  # n, k, config (block_n, block_k, split_k), or None for the default tiles
    (64, 256, DenseGemvConfig(16, 64, 1)),
    (70, 300, DenseGemvConfig(16, 64, 3)),  # ragged N and K, three slices
    (96, 1024, DenseGemvConfig(32, 128, 4)),
    (40, 512, None),
    (70, 300, None),  # the default tiles on ragged N and K: one deep tile a program, masked past K
]


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,config", CASES)
def test_matches_float64(n, k, config, dtype, transposed):
    gen = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    if transposed:
        weight = weight.t().contiguous().t()
    x = torch.randn(1, 2 * k, generator=gen).to(dtype)[:, ::2]  # a strided row
    bias = torch.randn(n, generator=gen).to(dtype)
    for b in (None, bias):
        got = dense_gemv(x, weight, b, config)
        want = x.double() @ weight.double().t() + (0 if b is None else b.double())
        assert got.dtype == dtype and got.shape == (1, n)
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
        assert ((got.double() - want).norm() / want.norm()).item() < tol
        assert torch.equal(dense_gemv(x, weight, b, config), got)  # the slices are added in one order
    assert not split_counters(x.device).any()  # every launch leaves the counters zeroed


def test_leading_dimensions_and_default_tiles():
    weight = torch.randn(24, 128)
    x = torch.randn(1, 1, 128)
    assert dense_gemv(x, weight).shape == (1, 1, 24)
    torch.testing.assert_close(dense_gemv(x, weight), x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert not pdl_launch(x.device)


def test_default_tiles_follow_the_layout():
    rows, transposed = dense_gemv_config(64, 2048, True, 132), dense_gemv_config(576, 2048, False, 132)
    assert (rows.block_n, rows.block_k, rows.split_k, rows.num_warps) == (8, 1024, 1, 8)
    assert (transposed.block_n, transposed.block_k, transposed.split_k, transposed.num_warps) == (8, 1024, 1, 4)
    wide = dense_gemv_config(4096, 2048, False, 132)  # about one program a compute unit: 32 columns each
    assert (wide.block_n, wide.block_k, wide.split_k, wide.num_warps) == (32, 512, 1, 8)
    assert dense_gemv_config(49152, 576, False, 132).block_n == 64  # at most 64 columns
    assert dense_gemv_config(64, 100, True, 132).block_k == 128  # never wider than K's power of two
    assert dense_gemv_config(64, 100, False, 132).block_k == 128


def test_dependent_launch_waits_for_a_backend_to_allow_it(monkeypatch):
    from chitu_core.kernels.triton import pdl

    monkeypatch.setattr(pdl, "_allowed", False)
    pdl.pdl_launch.cache_clear()
    assert not pdl.pdl_launch(torch.device("cuda", 0))  # not allowed: no device is even asked
    pdl.allow()
    try:
        assert not pdl.pdl_launch(torch.device("cpu"))  # allowed, but not a device that launches dependent
    finally:
        pdl.allow(False)


@pytest.mark.parametrize("config", [DenseGemvConfig(8, 256, 4), None], ids=["split", "default"])
def test_a_bfloat16_row_through_a_float32_weight_gives_float32(config):
    """linear_float32's path (contract 1.11): x widened as it is read, the float32 sums kept in a float32 output;
    a router of 64 experts over a 2048 row, as DeepSeek-V2-Lite's."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 2048, generator=gen) / 2048**0.5
    x = torch.randn(1, 2048, generator=gen).to(torch.bfloat16)
    got = dense_gemv(x, weight, config=config, out_dtype=torch.float32)
    want = x.double() @ weight.double().t()
    assert got.dtype == torch.float32 and got.shape == (1, 64)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6  # not the 1e-3 a bfloat16 output would give
    assert not split_counters(x.device).any()
