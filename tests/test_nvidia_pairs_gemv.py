"""The NVIDIA plugin's fp16-pair matrix-vector kernels (``chitu_nvidia.int4_gemv``, ``chitu_nvidia.fp8_gemv``)
on the CPU, under Triton's interpreter: their float32 form (the PTX products need a GPU; the GPU
conformance run checks those), every path the launchers take (split-K, ragged N, groups of 8 to 128,
per-channel and block FP8 scales, bias, strided x), against the float64 reference; and which linears
the NVIDIA ops send to them.
"""

import pytest
import torch

from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.ops import quant_reference, reference

with interpreter():
    from chitu_core.kernels.triton.gemv import GemvConfig
    from chitu_core.kernels.triton.split_k import split_counters
    from chitu_nvidia import fp8_gemv as fp8
    from chitu_nvidia import int4_gemv as int4
    from chitu_nvidia import ops


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


def nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want) ** 2).sum() / (want**2).sum())


# products and sums in float32 here; the bound is the output dtype's rounding, with room
BOUND = {torch.float16: 2e-7, torch.bfloat16: 3e-5}


def int4_operands(k: int, n: int, group: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = ((torch.rand(k // group, n, generator=gen) * 0.5 + 0.5) * (2.0 / (15 * k**0.5))).to(dtype)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).to(dtype)
    return torch.randn(1, k, generator=gen).to(dtype), qweight, scales, zeros


INT4_CASES = [  # k, n, group, config (None: the default tiles), dtype, bias: each launcher path once, for this
    # kernel and the digit one (test_nvidia_int4_digits)
    (256, 64, 128, GemvConfig(32, 32, 1, 1), torch.float16, False),
    (512, 96, 128, GemvConfig(64, 32, 4, 2), torch.float16, True),   # split-K, N ragged at the block
    (1024, 40, 32, GemvConfig(16, 16, 3, 1), torch.bfloat16, False),  # groups of 32, three uneven slices
    (768, 72, 128, GemvConfig(64, 64, 5, 2), torch.bfloat16, True),  # 64-feature steps, uneven slices
    (256, 48, 8, None, torch.float16, True),                         # groups of 8: one packed row a step
    (512, 512, 64, None, torch.bfloat16, False),                     # the default tiles
    (512, 1024, 32, GemvConfig(512, 32, 3, 2), torch.float16, True),  # wide weights' tiles, uneven slices
    (2560, 64, 128, GemvConfig(64, 32, 40, 2), torch.bfloat16, False),  # 40 slices: finished 16, 16 and 8 a load
]


@pytest.mark.parametrize("k,n,group,config,dtype,bias", INT4_CASES,
                         ids=[f"K{c[0]}-N{c[1]}-g{c[2]}-{c[3]}-{c[4]}-bias{c[5]}" for c in INT4_CASES])
def test_int4_pairs_match_the_reference(k, n, group, config, dtype, bias):
    check_int4_kernel(int4.int4_gemv, k, n, group, config, dtype, bias)


def check_int4_kernel(kernel, k: int, n: int, group: int, config, dtype: torch.dtype, bias: bool) -> None:
    """One row of ``int4_operands`` through kernel(x, qweight, scales, zeros, group, bias, config) against the
    float64 reference: dtype and shape, NMSE under ``BOUND``, the split counters left at zero."""
    x, qweight, scales, zeros = int4_operands(k, n, group, dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = kernel(x, qweight, scales, zeros, group, b, config)
    want = quant_reference.int4_linear(x.double(), qweight, scales, zeros, group, None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (1, n)
    assert nmse(got, want) < BOUND[dtype]
    assert split_counters(x.device).count_nonzero() == 0


FUSED_CASES = [  # k, n (the whole weight's), group, config (None: the default), dtype, fusion, bias
    (512, 96, 128, GemvConfig(32, 32, 4, 1), torch.float16, "norm", False),   # split-K, N ragged at the block
    (1024, 64, 32, None, torch.bfloat16, "norm", True),                        # the default tiles, groups of 32
    (768, 80, 128, GemvConfig(16, 64, 5, 2), torch.float16, "silu", True),     # gated: 40 of each half, uneven slices
    (256, 64, 128, GemvConfig(32, 32, 1, 1), torch.bfloat16, "gelu_tanh", False),  # gated, no split
    (512, 1024, 64, None, torch.float16, "gelu", False),                      # gated, the default (halved) tiles
    (640, 72, 128, GemvConfig(32, 64, 3, 1), torch.bfloat16, "add", True),    # residual, ragged, split
    (256, 48, 8, None, torch.float16, "add", False),                          # residual, groups of 8
    (512, 64, 128, GemvConfig(64, 64, 1, 2), torch.float16, "add", False),    # residual, no split
]


@pytest.mark.parametrize("k,n,group,config,dtype,fusion,bias", FUSED_CASES,
                         ids=[f"K{c[0]}-N{c[1]}-g{c[2]}-{c[3]}-{c[4]}-{c[5]}-bias{c[6]}" for c in FUSED_CASES])
def test_int4_pairs_fusions_match_the_reference(k, n, group, config, dtype, fusion, bias):
    """The norm in the prologue (and the gated activation of a merged gate/up weight), or the residual in
    the epilogue (contract 1.18), against the composed float64 reference, the counters left zeroed."""
    x, qweight, scales, zeros = int4_operands(k, n, group, dtype, seed=5)
    x = x * 3
    b = torch.randn(n).to(dtype) if bias else None
    b64 = None if b is None else b.double()
    if fusion == "add":
        res = torch.randn(1, n).to(dtype)
        got = int4.int4_gemv(x, qweight, scales, zeros, group, b, config, residual=res)
        want = reference.int4_linear_add(x.double(), qweight, scales, zeros, group, b64, res.double())
    else:
        nw = (1 + 0.3 * torch.randn(k, generator=torch.Generator().manual_seed(6))).to(dtype)
        act = None if fusion == "norm" else fusion
        got = int4.int4_gemv(x, qweight, scales, zeros, group, b, config, norm_weight=nw, eps=1e-6, activation=act)
        want = reference.int4_rms_norm_linear(x.double(), nw.double(), 1e-6, qweight, scales, zeros, group, b64, act)
    assert got.dtype == dtype and got.shape == want.shape
    # Beside the output's rounding: the normed x's into the fp16 pairs (x alone is exact there); and Triton's
    # interpreter rounds float32 to bfloat16 toward zero (the GPU: to nearest), up to 2^-8 an output.
    assert nmse(got, want) < {torch.float16: 1e-6, torch.bfloat16: 5e-5}[dtype]
    assert split_counters(x.device).count_nonzero() == 0


def test_int4_pairs_fusions_refuse_a_gated_activation_without_a_norm_or_an_odd_width():
    x, qweight, scales, zeros = int4_operands(256, 72, 128, torch.float16)
    with pytest.raises(ValueError, match="activation 'silu'"):
        int4.int4_gemv(x, qweight, scales, zeros, 128, None, activation="silu")
    with pytest.raises(ValueError, match="activation 'relu'"):
        int4.int4_gemv(x, qweight, scales, zeros, 128, None, norm_weight=torch.ones(256).half(), activation="relu")


def test_int4_pairs_read_strided_x_and_large_values():
    x, qweight, scales, zeros = int4_operands(512, 64, 128, torch.float16, seed=3)
    wide = torch.zeros(1, 1024, dtype=torch.float16)
    wide[:, ::2] = x * 3000  # x's scale keeps products of |x| in the thousands inside fp16
    got = int4.int4_gemv(wide[:, ::2], qweight, scales, zeros, 128, None)
    want = quant_reference.int4_linear(wide[:, ::2].double(), qweight, scales, zeros, 128, None)
    assert nmse(got, want) < BOUND[torch.float16]


def fp8_operands(n: int, k: int, block, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scales = (torch.rand(shape, generator=gen) * 0.5 + 0.5) * (1.0 / (100 * k**0.5))
    return torch.randn(1, k, generator=gen).to(dtype), weight, scales


FP8_CASES = [  # n, k, block, config, dtype
    (96, 512, (128, 128), GemvConfig(32, 128, 3, 4), torch.float16),  # split-K, blocks of scales
    (64, 256, None, GemvConfig(64, 128, 1, 2), torch.bfloat16),       # per-channel scales
    (200, 384, (128, 128), GemvConfig(64, 128, 2, 4), torch.float16),  # N ragged at the block and the scale block
    (72, 1024, None, None, torch.bfloat16),                            # the default tiles
]


@pytest.mark.parametrize("n,k,block,config,dtype", FP8_CASES,
                         ids=[f"N{c[0]}-K{c[1]}-{c[2]}-{c[3]}-{c[4]}" for c in FP8_CASES])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_pairs_match_the_reference(n, k, block, config, dtype, bias):
    x, weight, scales = fp8_operands(n, k, block, dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = fp8.fp8_gemv(x, weight, scales, block, b, config)
    want = quant_reference.fp8_linear(x.double(), weight, scales, block, False, None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (1, n)
    assert nmse(got, want) < BOUND[dtype]
    assert split_counters(x.device).count_nonzero() == 0


def test_fp8_fits_whole_steps_inside_a_scale_block():
    w = torch.zeros(8, 256, dtype=torch.float8_e4m3fn)
    assert fp8.fits(w, (128, 128)) and fp8.fits(w, None)
    assert not fp8.fits(torch.zeros(8, 200, dtype=torch.float8_e4m3fn), None)  # K not whole steps
    assert not fp8.fits(w, (128, 64))  # a step would span two scale blocks
    assert not fp8.fits(w.t().contiguous().t(), None)  # K not contiguous
    with pytest.raises(ValueError, match="do not fit"):
        fp8.fp8_gemv(torch.zeros(1, 200), torch.zeros(8, 200, dtype=torch.float8_e4m3fn), torch.ones(8), None, None)


def test_configs_are_the_measured_tiles():
    """The tiles picked are the ones the sweeps (int4: H200, fp8: H100) found fastest at Llama-3.1-8B's shapes (the config
    functions' docstrings)."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    assert [int4.int4_gemv_config(n, k, 128, 132) for n, k in shapes] == [
        GemvConfig(256, 64, 22, 2), GemvConfig(256, 64, 33, 2), GemvConfig(512, 32, 19, 2), GemvConfig(256, 64, 33, 2)]
    assert int4.int4_gemv_config(4096, 4096, 16, 132).block_k == 16
    assert int4.int4_gemv_config(4096, 4096, 32, 132).block_k == 32
    assert int4.int4_gemv_config(28672, 4096, 16, 132).block_k == 16  # wide: 32 features a step, or fewer
    assert [fp8.fp8_gemv_config(n, k, 132) for n, k in shapes] == [
        GemvConfig(32, 128, 6, 4), GemvConfig(32, 128, 9, 4), GemvConfig(64, 128, 1, 8), GemvConfig(32, 128, 9, 2)]


def test_the_nvidia_ops_send_one_row_of_16_bit_x_to_the_pair_kernels(monkeypatch):
    calls = []
    ops.nvidia_ops()  # binds the kernels (no CUDA here: the FP8 op is not registered, but the function is whole)
    monkeypatch.setattr(ops, "INT4_DIGITS", False)  # CHITU_INT4_DIGITS=0 (the digit kernel: test_nvidia_int4_digits)
    monkeypatch.setitem(ops._pairs, "int4_gemv", lambda *a, **k: calls.append("int4") or torch.zeros(1, a[1].shape[1]))
    monkeypatch.setitem(ops._pairs, "fp8_gemv", lambda *a, **k: calls.append("fp8") or torch.zeros(1, a[1].shape[0]))
    x, qweight, scales, zeros = int4_operands(256, 64, 128, torch.float16)
    ops.int4_linear(x, qweight, scales, zeros, 128, None)
    ops.int4_linear(x.repeat(2, 1), qweight, scales, zeros, 128, None)  # two rows: the portable kernel
    ops.int4_linear(x.float(), qweight, scales, zeros, 128, None)  # float32: the portable kernel
    with pytest.raises(ValueError, match="int4_linear"):
        ops.int4_linear(x, qweight, scales[:1], zeros, 128, None)  # checked before either
    xf, weight, s8 = fp8_operands(64, 256, (128, 128), torch.bfloat16)
    ops.fp8_linear(xf, weight, s8, (128, 128), False, None)
    ops.fp8_linear(xf, weight, s8, (128, 128), True, None)  # activations quantized: the portable kernel
    monkeypatch.setattr(ops, "PAIRS_GEMV", False)
    ops.int4_linear(x, qweight, scales, zeros, 128, None)
    ops.fp8_linear(xf, weight, s8, (128, 128), False, None)
    assert calls == ["int4", "fp8"]


def test_the_nvidia_int4_fusions_take_the_pair_kernel_for_one_row(monkeypatch):
    """Contract 1.18's ops (served with CHITU_INT4_FUSIONS=1): one row of 16-bit x on ``int4_gemv`` with the norm
    (and the gated activation) or the residual; other calls composed of the unfused ops, with the same result; bad shapes refused."""
    assert not {"int4_rms_norm_linear", "int4_linear_add"} & set(ops.nvidia_ops())  # by default the layers' unfused path
    monkeypatch.setattr(ops, "INT4_FUSIONS", True)  # CHITU_INT4_FUSIONS=1
    assert {"int4_rms_norm_linear", "int4_linear_add"} <= set(ops.nvidia_ops())
    calls = []
    kernel = ops._pairs["int4_gemv"]
    monkeypatch.setitem(ops._pairs, "int4_gemv", lambda *a, **k: calls.append(sorted(k)) or kernel(*a, **k))
    x, qweight, scales, zeros = int4_operands(256, 64, 128, torch.float16)
    nw, res = (1 + 0.1 * torch.randn(256)).half(), torch.randn(1, 64).half()
    want = reference.int4_rms_norm_linear(x.double(), nw.double(), 1e-6, qweight, scales, zeros, 128, None, "silu")
    gated = ops.int4_rms_norm_linear(x, nw, 1e-6, qweight, scales, zeros, 128, None, "silu")
    assert gated.shape == (1, 32) and nmse(gated, want) < 1e-6
    assert calls == [["activation", "eps", "norm_weight"]]
    added = ops.int4_linear_add(x, qweight, scales, zeros, 128, None, res)
    assert nmse(added, reference.int4_linear_add(x.double(), qweight, scales, zeros, 128, None, res.double())) < 1e-6
    assert calls[-1] == ["residual"]
    two = ops.int4_rms_norm_linear(x.repeat(2, 1), nw, 1e-6, qweight, scales, zeros, 128, None, "silu")
    assert len(calls) == 2 and nmse(two[1:], want) < 1e-5  # composed: the normed x rounded to float16 first
    with pytest.raises(ValueError, match=r"norm_weight \[128\] for x of 256 features"):
        ops.int4_rms_norm_linear(x, nw[:128], 1e-6, qweight, scales, zeros, 128, None)
    with pytest.raises(ValueError, match=r"residual \[1, 32\] for an output of \[1, 64\]"):
        ops.int4_linear_add(x, qweight, scales, zeros, 128, None, res[:, :32])
