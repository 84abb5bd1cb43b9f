"""The NVIDIA plugin's 8-bit digit matrix-vector kernel (``chitu_nvidia.int4_digits``) on the CPU, under
Triton's interpreter: its plain-Triton integer form (the dp4a PTX needs a GPU; the GPU conformance run checks
it), every path the launcher takes (split-K, ragged N, groups of 8 to 128, bias, strided x, steps of zeros
and outliers), against the float64 reference; its tiles; and that the NVIDIA ops send one row to it.
"""

import pytest
import torch

from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.ops import quant_reference

with interpreter():
    from chitu_core.kernels.triton.gemv import GemvConfig
    from chitu_nvidia import int4_digits as digits
    from chitu_nvidia import ops
    from test_nvidia_pairs_gemv import BOUND, INT4_CASES, check_int4_kernel, int4_operands, nmse


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


@pytest.mark.parametrize("k,n,group,config,dtype,bias", INT4_CASES,
                         ids=[f"K{c[0]}-N{c[1]}-g{c[2]}-{c[3]}-{c[4]}-bias{c[5]}" for c in INT4_CASES])
def test_int4_digits_match_the_reference(k, n, group, config, dtype, bias):
    check_int4_kernel(digits.int4_digits_gemv, k, n, group, config, dtype, bias)


def test_int4_digits_read_strided_x_zero_steps_and_outliers():
    """A step's digits are relative to its largest feature: a step of zeros, a step with one feature 10^4 times
    the others, and x in the thousands (fp16), read with a stride of 2."""
    x, qweight, scales, zeros = int4_operands(512, 64, 128, torch.float16, seed=3)
    x = x * 3000
    x[:, 64:128] = 0  # one 64-feature step of zeros
    x[:, 130] = 6e4  # an outlier among the next step's
    wide = torch.zeros(1, 1024, dtype=torch.float16)
    wide[:, ::2] = x
    got = digits.int4_digits_gemv(wide[:, ::2], qweight, scales, zeros, 128, None, GemvConfig(64, 64, 2, 2))
    want = quant_reference.int4_linear(x.double(), qweight, scales, zeros, 128, None)
    assert torch.isfinite(got).all() and nmse(got, want) < BOUND[torch.float16]


def test_int4_digits_tiles_are_the_measured_ones():
    """Four warps of 512 columns, 64 features a step, about four programs a unit (two up to 4,096 columns):
    at each of Llama-3.1-8B's shapes the fastest of gemv_sweep.py's digits tiles on an H200."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    assert [digits.int4_digits_config(n, k, 128, 132) for n, k in shapes] == [
        GemvConfig(512, 64, 44, 4), GemvConfig(512, 64, 33, 4), GemvConfig(512, 64, 10, 4), GemvConfig(512, 64, 33, 4)]
    assert digits.int4_digits_config(4096, 4096, 32, 132).block_k == 32
    with pytest.raises(ValueError, match="block_k 64 must be a multiple of 8 dividing group size 32"):
        x, qweight, scales, zeros = int4_operands(256, 64, 32, torch.float16)
        digits.int4_digits_gemv(x, qweight, scales, zeros, 32, None, GemvConfig(64, 64, 1, 2))


def test_the_nvidia_ops_send_one_row_of_int4_to_the_digit_kernel(monkeypatch):
    calls = []
    ops.nvidia_ops()
    for name in ("int4_digits", "int4_gemv"):
        monkeypatch.setitem(ops._pairs, name, lambda *a, name=name, **k: calls.append(name) or
                            torch.zeros(1, a[1].shape[1]))
    x, qweight, scales, zeros = int4_operands(256, 64, 128, torch.float16)
    ops.int4_linear(x, qweight, scales, zeros, 128, None)
    ops.int4_linear(x.repeat(2, 1), qweight, scales, zeros, 128, None)  # two rows: the portable kernel
    monkeypatch.setattr(ops, "INT4_DIGITS", False)  # CHITU_INT4_DIGITS=0
    ops.int4_linear(x, qweight, scales, zeros, 128, None)
    assert calls == ["int4_digits", "int4_gemv"]
