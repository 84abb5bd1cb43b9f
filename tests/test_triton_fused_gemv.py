"""The decode-step fusions' Triton kernel (``chitu_core.kernels.triton.fused_gemv``: RMSNorm in the
prologue, gated activation or residual add in the epilogue) on the CPU, under Triton's interpreter, against
the float64 reference ops (``reference.rms_norm_linear``, ``reference.linear_add``): one row (elementwise
products) and 2 to 8 rows (tensor-core products of rows padded to 16), both weight layouts, ragged N and
K, bias or none, each activation, float32 and bfloat16. bfloat16 tensor-core products are checked on the GPU
only (the NVIDIA conformance rows): triton's interpreter multiplies bfloat16 ``tl.dot`` operands as raw
16-bit integers (test_triton_kernels)."""

import pytest
import torch

from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.ops import reference

with interpreter():
        from chitu_core.kernels.triton.fused_gemv import MAX_ROWS, FusedGemvConfig, fused_gemv, fused_gemv_config


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


def _nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).square().sum() / want.square().sum()).item()


def _skip_interpreted_bf16_dot(rows, dtype):
    if rows > 1 and dtype == torch.bfloat16:
        pytest.skip("bfloat16 tl.dot is wrong under triton's interpreter; the GPU conformance rows check it")


def _operands(rows, n, k, dtype, transposed, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    if transposed:
        weight = weight.t().contiguous().t()
    x = (3 * torch.randn(rows, 2 * k, generator=gen)).to(dtype)[:, ::2]  # strided rows
    norm_w = (1 + 0.3 * torch.randn(2 * k, generator=gen)).to(dtype)[::2]  # strided, as the conformance case has it
    return x, weight, torch.randn(n, generator=gen).to(dtype), norm_w


CASES = [  # rows, n, k, config or None (the default tiles)
    (1, 70, 300, FusedGemvConfig(16, 64)), (1, 96, 1024, None), (3, 70, 300, FusedGemvConfig(16, 64, 4, 2)),
    (8, 130, 257, None), (5, 64, 96, FusedGemvConfig(32, 32, 4, 3)),
]


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k,config", CASES)
def test_norm_prologue_and_gated_epilogue(rows, n, k, config, dtype, transposed):
    _skip_interpreted_bf16_dot(rows, dtype)
    x, weight, bias, norm_w = _operands(rows, n, k, dtype, transposed, rows * n + k)
    tol = 1e-10 if dtype == torch.float32 else 2e-5  # bf16: the output's rounding (and the normed x's, reference)
    for activation in (None, "silu", "gelu", "gelu_tanh"):
        for b in (None, bias):
            got = fused_gemv(x, weight, b, norm_w, 1e-6, activation, config=config)
            want = reference.rms_norm_linear(x.double(), norm_w.double(), 1e-6, weight.double(),
                                             None if b is None else b.double(), activation)
            assert got.dtype == dtype and got.shape == want.shape
            assert _nmse(got, want) < tol, (activation, b is not None)


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k,config", CASES)
def test_residual_epilogue(rows, n, k, config, dtype, transposed):
    _skip_interpreted_bf16_dot(rows, dtype)
    x, weight, bias, _ = _operands(rows, n, k, dtype, transposed, rows + n * k)
    residual = (4 * torch.randn(2 * rows, n)).to(dtype)[::2]  # strided rows
    for b in (None, bias):
        got = fused_gemv(x, weight, b, residual=residual, config=config)
        want = reference.linear_add(x.double(), weight.double(), None if b is None else b.double(), residual.double())
        assert got.shape == residual.shape and _nmse(got, want) < (1e-12 if dtype == torch.float32 else 2e-5)


def test_leading_dimensions_rows_and_bad_calls():
    x, weight, _, norm_w = _operands(2, 24, 64, torch.float32, True, 0)
    got = fused_gemv(x.reshape(2, 1, 64), weight, None, norm_w, 1e-5)
    assert got.shape == (2, 1, 24)
    torch.testing.assert_close(got.reshape(2, 24), reference.rms_norm_linear(x, norm_w, 1e-5, weight, None))
    with pytest.raises(ValueError, match="at most 8 rows"):
        fused_gemv(torch.zeros(MAX_ROWS + 1, 64), weight)
    with pytest.raises(ValueError, match="'relu'"):
        fused_gemv(x, weight, None, norm_w, 1e-5, "relu")
    with pytest.raises(ValueError, match="even width"):
        fused_gemv(x, weight[:23], None, norm_w, 1e-5, "silu")


def test_default_tiles():
    # One row: dense_gemv's tiles (halved for a gated pair); several rows: pipelined steps of 128 features.
    assert fused_gemv_config(960, 576, False, 1, False, 132) == FusedGemvConfig(8, 1024, 4, 1)
    assert fused_gemv_config(3072, 576, False, 1, True, 132).block_n == 16
    assert fused_gemv_config(4096, 2048, False, 4, False, 132) == FusedGemvConfig(32, 128, 4, 3)
    assert fused_gemv_config(960, 576, False, 4, True, 132).block_n == 16
