"""The Triton kernels of ``fp8_linear`` and ``int8_linear`` (``chitu_core.kernels.triton``) on the CPU,
under Triton's interpreter (see test_triton_kernels.py), in float32 on small shapes.

Dynamic activation quantization is checked bit for bit: against torch's own float8_e4m3fn cast and
round-half-to-even on values placed exactly at rounding ties, and against the reference's
quantizers. Each matmul path is forced by its config (matrix-vector with a reduction in registers,
tl.dot tiles for a few rows, split K, the GEMM after a quantization pass) and compared with the
float64 reference, for both FP8 entry points (float8 types, or bytes decoded in registers), with
block scales whose last block is partial, biases, leading dimensions and non-contiguous x. What
only a GPU can check: speed, the FP8 tensor-core path (the interpreter multiplies FP8 in numpy),
bfloat16 (the interpreter truncates float32 -> bfloat16) and compiler behaviour around the
rounding trick (``act_quant.round_half_even``).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.ops import quant_reference as ref
from test_ops import strided, transposed

with interpreter():
    from chitu_core.kernels.triton import act_quant, fp8_linear, int8_linear, quant_matmul
    from chitu_core.kernels.triton.quant_matmul import MatmulConfig


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


FP8_ENTRIES = [fp8_linear.fp8_linear, fp8_linear.fp8_linear_bytes]
E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_FINITE = E4M3[~E4M3.isnan()]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


# ----- activation quantization, bit for bit -----


def test_fp8_rounding_ties_go_to_even_like_torchs_cast():
    grid = E4M3_FINITE[E4M3_FINITE >= 0].unique().sort().values  # 0, 2**-9, ..., 448
    midpoints = (grid[:-1] + grid[1:]) / 2  # exact in float32: ties between neighbouring e4m3 values
    for values in (midpoints, grid, -midpoints, midpoints * 0.999, midpoints * 1.001):
        row = torch.cat([values, torch.tensor([448.0])])  # amax 448: scale exactly 1
        q, scales = act_quant.quantize_groups(row[None], row.numel(), "fp8", torch.float8_e4m3fn)
        assert scales.item() == 1.0
        assert q.float()[0].equal(row.to(torch.float8_e4m3fn).float())


def test_int8_rounding_ties_go_to_even_and_clamp():
    row = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.49, -3.51, 127.0, 0.0])
    q, scales = act_quant.quantize_groups(row[None], row.numel(), "int8", torch.int8)
    assert scales.item() == 1.0
    assert q[0].tolist() == [0, 2, 2, 0, -2, -2, 126, -126, 3, -4, 127, 0]


@pytest.mark.parametrize("group", [128, 300, 64])
def test_fp8_group_quantization_matches_the_reference(group):
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(6, 300, generator=gen) * torch.logspace(-3, 2, 6)[:, None]
    x[2] = 0  # an all-zero row: scale 1
    x[3, :200] = 0  # all-zero groups in a row that is not
    for carrier in (torch.float8_e4m3fn, torch.float16):
        q, scales = act_quant.quantize_groups(strided(x), group, "fp8", carrier)
        assert scales.shape == (6, -(-300 // group))
        got = q.float() * scales.repeat_interleave(group, 1)[:, :300]
        assert got.equal(ref.quantize_groups_fp8(x, group))
    assert scales[2].eq(1).all()


def test_int8_row_quantization_matches_the_reference():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 333, generator=gen) * 7
    x[1] = 0
    q, scales = act_quant.quantize_groups(transposed(x), 333, "int8", torch.int8)
    want_q, want_s = ref.quantize_rows_int8(x)
    assert q.float().equal(want_q) and scales.equal(want_s)


def test_fp8_bytes_decode_every_pattern_exactly():
    import triton
    import triton.language as tl

    @triton.jit
    def decode(b_ptr, o_ptr):
        i = tl.arange(0, 256)
        tl.store(o_ptr + i, act_quant.decode_e4m3_bytes(tl.load(b_ptr + i)).to(tl.float32))

    out = torch.empty(256)
    decode[(1,)](torch.arange(256, dtype=torch.int32).to(torch.uint8), out)
    finite = ~E4M3.isnan()
    assert (out[finite] * act_quant.FP8_BYTES_FACTOR).equal(E4M3[finite])


# ----- the matmuls, path by path -----


def fp8_operands(m, k, n, block, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scales = (torch.rand(shape, generator=gen) * 0.5 + 0.5) / (100 * k ** 0.5)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, weight, scales, torch.randn(n, generator=gen)


PATHS = {
    "matvec": MatmulConfig(1, 16, 64, dot=False, inline=True),
    "matvec rows 4": MatmulConfig(4, 16, 128, dot=False, inline=True),
    "matvec after a quantization pass": MatmulConfig(2, 16, 64, split_k=2, dot=False),
    "dot tiles": MatmulConfig(16, 32, 64, inline=True),
    "split k": MatmulConfig(2, 16, 64, split_k=3, dot=False, inline=True),
    "dot split k": MatmulConfig(16, 16, 32, split_k=2, inline=True),
    "gemm": MatmulConfig(16, 32, 64),
    "gemm split k": MatmulConfig(16, 32, 128, split_k=2),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
def test_fp8_linear_paths_match_the_reference(path, block, act_quant):
    m, k, n = (3, 200, 136) if block else (3, 160, 40)  # blocks: 2 x 2, both last ones partial
    x, weight, scales, bias = fp8_operands(m, k, n, block, seed=list(PATHS).index(path))
    want = ref.fp8_linear(x.double(), weight, scales.double(), block, act_quant, bias.double())
    for entry in FP8_ENTRIES:
        got = entry(x, weight, scales, block, act_quant, bias, config=PATHS[path])
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert rel_error(got, want) < 2e-6, (entry.__name__, rel_error(got, want))


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
def test_fp8_linear_paths_with_k_a_whole_number_of_tiles(block, act_quant):
    """K = 256: every path's tiles lie inside K, so its loads go unmasked along K (EVEN_K)."""
    x, weight, scales, bias = fp8_operands(3, 256, 136, block, seed=5)
    want = ref.fp8_linear(x.double(), weight, scales.double(), block, act_quant, bias.double())
    for path, config in PATHS.items():
        got = fp8_linear.fp8_linear(x, weight, scales, block, act_quant, bias, config=config)
        assert rel_error(got, want) < 2e-6, (path, rel_error(got, want))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
def test_int8_linear_paths_match_the_reference(path, act_quant):
    gen = torch.Generator().manual_seed(7)
    m, k, n = 3, 200, 40
    weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) / (127 * k ** 0.5)
    x = torch.randn(m, k, generator=gen)
    x[1] = 0
    bias = torch.randn(n, generator=gen)
    want = ref.int8_linear(x.double(), weight, scales.double(), act_quant, bias.double())
    got = int8_linear.int8_linear(x, weight, scales, act_quant, bias, config=PATHS[path])
    assert rel_error(got, want) < 2e-6


def test_leading_dims_layouts_no_bias_and_the_default_configs():
    for m, layout in [(1, strided), (2, transposed), (7, strided), (40, transposed)]:  # matvec, dot, gemm
        x, weight, scales, _ = fp8_operands(m, 256, 48, (128, 128), seed=m)
        for act_quant in (False, True):
            want = ref.fp8_linear(x.double(), weight, scales.double(), (128, 128), act_quant, None)
            got = fp8_linear.fp8_linear(layout(x), weight, scales, (128, 128), act_quant, None)
            assert rel_error(got, want) < 2e-6
    x, weight, scales, bias = fp8_operands(6, 128, 32, None, seed=3)
    got = fp8_linear.fp8_linear(x.view(2, 3, 128), weight, scales, None, True, bias)
    want = ref.fp8_linear(x.double(), weight, scales.double(), None, True, bias.double())
    assert got.shape == (2, 3, 32) and rel_error(got.view(6, 32), want) < 2e-6
    assert fp8_linear.fp8_linear(x[:0], weight, scales, None, True, None).shape == (0, 32)


def test_a_k_tile_narrower_than_the_scale_block_quantizes_in_a_pass_of_its_own():
    x, weight, scales, bias = fp8_operands(2, 384, 40, (128, 128), seed=11)
    want = ref.fp8_linear(x.double(), weight, scales.double(), (128, 128), True, bias.double())
    config = MatmulConfig(16, 16, 64, inline=True)  # K tiles of 64 inside blocks of 128: a separate pass
    assert rel_error(fp8_linear.fp8_linear(x, weight, scales, (128, 128), True, bias, config=config), want) < 2e-6


def test_operand_checks_say_what_is_wrong():
    x, weight, scales, _ = fp8_operands(1, 256, 16, (128, 128), seed=0)
    with pytest.raises(ValueError, match=r"scales must be float32 \[1, 2\] .* got torch.float32 \[16\]"):
        fp8_linear.fp8_linear(x, weight, scales.new_ones(16), (128, 128), False, None)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn, got torch.int8"):
        fp8_linear.fp8_linear(x, weight.view(torch.int8), scales, (128, 128), False, None)
    with pytest.raises(ValueError, match=r"int8_linear: scales must be float32 \[16\]"):
        int8_linear.int8_linear(x, weight.view(torch.int8), scales, True, None)


def test_decode_configs_spread_the_weight_over_the_device():
    """M <= 16 splits K until enough programs per compute unit exist; M up to 64 splits at most 4 ways, where
    N alone gives fewer than two programs per unit; larger M never splits."""
    wanted = quant_matmul.DECODE_PROGRAMS_PER_UNIT * 132
    for n, k in [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (1024, 4096), (576, 7168)]:
        for m in (1, 4, 16):
            c = quant_matmul.matmul_config(m, n, k, 132, 1)
            programs = -(-m // c.block_m) * -(-n // c.block_n) * c.split_k
            assert programs >= wanted or c.split_k == -(-k // c.block_k)
            assert c.split_k == 1 or programs < wanted + -(-m // c.block_m) * -(-n // c.block_n)  # no more than needed
        c = quant_matmul.matmul_config(64, n, k, 132, 1)
        assert c.split_k == (1 if n >= 64 * 264 else min(4, -(-264 // -(-n // 64)))), (n, k)
        assert quant_matmul.matmul_config(128, n, k, 132, 1).split_k == 1


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_launchers_read_nothing_back_from_the_device():
    """Sizes and grids come from shapes alone, so a device graph can capture the launches."""
    x, weight, scales, bias = fp8_operands(2, 256, 48, (128, 128), seed=5)
    for run in (lambda: fp8_linear.fp8_linear(x, weight, scales, (128, 128), True, bias),
                lambda: fp8_linear.fp8_linear(x.repeat(9, 1), weight, scales, (128, 128), True, bias),
                lambda: int8_linear.int8_linear(x, weight.view(torch.int8), scales.new_ones(48), True, None)):
        with _Record() as record:
            run()
        assert not [op for op in record.ops if "item" in op or "_local_scalar" in op or "nonzero" in op]
