"""The split-K matrix-vector kernel for a few rows (``chitu_core.kernels.triton.splitk_gemv``: plain, RMSNorm
in the prologue with or without the gated activation, residual add in the epilogue) on the CPU, under
Triton's interpreter, against the float64 reference ops: 1 to 16 rows, both weight layouts, ragged N and K,
K split 1 to 7 ways (the last slice short), bias or none. float16: triton's interpreter multiplies
bfloat16 ``tl.dot`` operands as raw 16-bit integers (test_triton_kernels); bfloat16 is checked on the GPU
(the NVIDIA conformance rows, plugins/nvidia/scripts/splitk_gemv_sweep.py)."""

import pytest
import torch

from test_triton_fused_gemv import _nmse
from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.ops import reference

with interpreter():
    from chitu_core.kernels.triton.splitk_gemv import MAX_ROWS, SplitKGemvConfig, splitk_gemv, splitk_gemv_config

F16 = torch.float16


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


def _operands(rows, n, k, transposed, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(F16)
    if transposed:
        weight = weight.t().contiguous().t()
    x = (3 * torch.randn(rows, 2 * k, generator=gen)).to(F16)[:, ::2]  # strided rows
    norm_w = (1 + 0.3 * torch.randn(2 * k, generator=gen)).to(F16)[::2]
    return x, weight, torch.randn(n, generator=gen).to(F16), norm_w


CASES = [  # rows, n, k, config or None (the default tiles)
    (1, 70, 300, SplitKGemvConfig(32, 32, 3, 2)),  # 10 steps in 3 slices of 4, 4, 2
    (3, 130, 257, SplitKGemvConfig(64, 32, 7, 3)),  # 9 steps in 5 slices, the last one feature
    (16, 40, 96, SplitKGemvConfig(16, 32, 1, 2)),  # no split
    (2, 96, 512, None),
]
TOL = 1e-5  # float16: the output's rounding and the normed x's


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("rows,n,k,config", CASES)
def test_plain_and_bias(rows, n, k, config, transposed):
    x, weight, bias, _ = _operands(rows, n, k, transposed, rows * n + k)
    for b in (None, bias):
        got = splitk_gemv(x, weight, b, config=config)
        want = x.double() @ weight.double().t() + (0 if b is None else b.double())
        assert got.dtype == F16 and got.shape == want.shape
        assert _nmse(got, want) < TOL, b is not None


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("rows,n,k,config", CASES)
def test_norm_prologue_and_gated_epilogue(rows, n, k, config, transposed):
    x, weight, bias, norm_w = _operands(rows, n, k, transposed, rows * n + k + 1)
    for activation in (None, "silu", "gelu_tanh"):
        for b in (None, bias):
            got = splitk_gemv(x, weight, b, norm_w, 1e-6, activation, config=config)
            want = reference.rms_norm_linear(x.double(), norm_w.double(), 1e-6, weight.double(),
                                             None if b is None else b.double(), activation)
            assert got.shape == want.shape and _nmse(got, want) < TOL, (activation, b is not None)


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("rows,n,k,config", CASES)
def test_residual_epilogue(rows, n, k, config, transposed):
    x, weight, bias, _ = _operands(rows, n, k, transposed, rows + n * k)
    residual = (4 * torch.randn(2 * rows, n)).to(F16)[::2]  # strided rows
    for b in (None, bias):
        got = splitk_gemv(x, weight, b, residual=residual, config=config)
        want = reference.linear_add(x.double(), weight.double(), None if b is None else b.double(), residual.double())
        assert got.shape == residual.shape and _nmse(got, want) < TOL


def test_split_is_deterministic_and_counters_left_zeroed():
    from chitu_core.kernels.triton.split_k import split_counters

    x, weight, _, norm_w = _operands(2, 64, 512, True, 3)
    cfg = SplitKGemvConfig(32, 32, 8, 2)
    first = splitk_gemv(x, weight, None, norm_w, 1e-6, "silu", config=cfg)
    for _ in range(2):
        assert torch.equal(splitk_gemv(x, weight, None, norm_w, 1e-6, "silu", config=cfg), first)
    assert not split_counters(x.device).any()


def test_bad_calls():
    x, weight, _, norm_w = _operands(2, 24, 64, True, 0)
    assert splitk_gemv(x.reshape(2, 1, 64), weight).shape == (2, 1, 24)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        splitk_gemv(torch.zeros(MAX_ROWS + 1, 64, dtype=F16), weight)
    with pytest.raises(ValueError, match="16-bit weight"):
        splitk_gemv(x.float(), weight.float())
    with pytest.raises(ValueError, match="'relu'"):
        splitk_gemv(x, weight, None, norm_w, 1e-5, "relu")
    with pytest.raises(ValueError, match="even width"):
        splitk_gemv(x, weight[:23], None, norm_w, 1e-5, "silu")


def test_default_tiles():
    # 128 columns (64 a half where gated), 64 features a step, K split to cover the units once.
    assert splitk_gemv_config(4096, 14336, False, 132) == SplitKGemvConfig(256, 64, 8)  # Llama-3.1-8B down
    assert splitk_gemv_config(14336, 4096, True, 132) == SplitKGemvConfig(128, 64, 1)  # its gate/up
    assert splitk_gemv_config(2048, 2048, False, 132) == SplitKGemvConfig(256, 64, 16)  # Qwen3-1.7B o_proj
    assert splitk_gemv_config(64, 128, False, 132) == SplitKGemvConfig(128, 64, 1)  # one step deep each: no split


def test_the_nvidia_ops_route_one_row_of_a_large_16_bit_weight_to_the_kernel(monkeypatch):
    from chitu_nvidia import ops

    ops.nvidia_ops()  # binds the kernels (no CUDA here: the FP8 op is not registered, but the functions are whole)
    calls = []

    def spy(x, weight, bias=None, norm_weight=None, eps=0.0, activation=None, residual=None):
        calls.append(("norm" if norm_weight is not None else "residual" if residual is not None else "plain",
                      tuple(weight.shape)))
        return torch.zeros(*x.shape[:-1], weight.shape[0], dtype=x.dtype)

    monkeypatch.setattr(ops, "_splitk_gemv", spy)
    monkeypatch.setattr(ops, "SPLITK_MIN_WEIGHT", 64 * 128)  # the sizes of this test's weights
    monkeypatch.setattr(ops, "SPLITK_MIN_K", 128)
    x, weight, _, norm_w = _operands(1, 64, 128, True, 5)
    res = torch.zeros(1, 64, dtype=F16)
    ops.linear(x, weight)
    ops.rms_norm_linear(x, norm_w, 1e-6, weight, None)
    ops.linear_add(x, weight, None, res)
    ops.rms_norm_linear(x, norm_w, 1e-6, weight, None, "silu")  # gated: the norm, the kernel plain, the activation
    assert calls == [("plain", (64, 128)), ("norm", (64, 128)), ("residual", (64, 128)), ("plain", (64, 128))]
    calls.clear()
    ops.linear(x.repeat(2, 1), weight)  # two rows
    ops.linear(x.float(), weight.float())  # float32
    ops.linear(x[:, :96], weight[:32, :96])  # smaller than SPLITK_MIN_WEIGHT
    monkeypatch.setattr(ops, "SPLITK_MAX_N", 32)
    ops.linear(x, weight)  # wider than SPLITK_MAX_N
    monkeypatch.setattr(ops, "SPLITK_MAX_N", 64)
    monkeypatch.setattr(ops, "SPLITK_MIN_K", 256)
    ops.linear(x, weight)  # shallower than SPLITK_MIN_K
    monkeypatch.setattr(ops, "SPLITK_MIN_K", 128)
    monkeypatch.setattr(ops, "SPLITK_MIN_WEIGHT", 0)  # CHITU_SPLITK_MIN_WEIGHT=0: off
    ops.linear(x, weight)
    assert calls == []


def test_k_splits_at_most_max_split():
    from chitu_core.kernels.triton.splitk_gemv import MAX_SPLIT

    assert splitk_gemv_config(256, 65536, False, 132).split_k == MAX_SPLIT  # one tile, a deep K
    x, weight, _, _ = _operands(1, 16, 64 * 40, True, 9)
    got = splitk_gemv(x, weight, config=SplitKGemvConfig(16, 64, 40, 2))  # asked for 40 slices: 14 of 3 steps
    assert _nmse(got, x.double() @ weight.double().t()) < TOL
