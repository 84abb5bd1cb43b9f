"""The Triton gguf_linear kernel (``chitu_core.kernels.triton.gguf_linear``) on the CPU, under Triton's
interpreter, for the six block types: both paths (decode with and without a split K, tl.dot) against
the float64 reference, non-contiguous and batched activations, bias, and the weights it multiplies
read back exactly: x = rows of the identity gives W.T bit for bit, so the in-register decoding is
ggml's dequantization exactly.
"""

import pytest
import torch

from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.ops.quant_reference import gguf_linear as reference_gguf_linear
from chitu_core.quantization.gguf_blocks import BLOCK, NAMES, dequantize, random_blocks
from test_ops import LAYOUTS, TOL, assert_unmodified, snapshot

with interpreter():
    import chitu_core.kernels.triton.gguf_linear as gl

TYPES = list(BLOCK)


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


def _dot_tiles(qtype: int, block_m: int = 16) -> "gl.Tiles":
    return gl.Tiles(block_m, 16, 32 // gl.LAYOUT[qtype][1], dot=True)


def check(x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None, config=None) -> torch.Tensor:
    snap = snapshot((x, qweight, bias))
    got = gl.gguf_linear(x, qweight, qtype, bias, config)
    assert_unmodified(snap)
    want = reference_gguf_linear(x.double(), qweight, qtype, None if bias is None else bias.double())
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], qweight.shape[0])
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    return got


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_both_paths_match_the_reference(qtype):
    e, _ = BLOCK[qtype]
    gen = torch.Generator().manual_seed(qtype)
    k = 2 * max(e, 256)
    w = random_blocks(qtype, 40, k, gen)
    bias = torch.randn(40, generator=gen)
    for m, layout, config in [
        (1, "contiguous", None),  # decode, BLOCK_M 1
        (3, "strided", gl.Tiles(4, 8, 256 // gl.LAYOUT[qtype][1], split=3)),  # decode, split K, a padded row
        (2, "transposed", gl.Tiles(2, 16, 128 // gl.LAYOUT[qtype][1], split=2)),
        (21, "contiguous", None),  # tl.dot, partial M and N tiles
        (5, "strided", _dot_tiles(qtype)),
    ]:
        x = LAYOUTS[layout](torch.randn(m, k, generator=gen))
        check(x, w, qtype, bias if m % 2 else None, config)


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_identity_rows_read_the_weight_back_exactly(qtype):
    """y = x @ W.T with x one-hot rows: each output is one product 1 * w plus zeros, exact in float32
    (up to the sign of a zero). tl.dot reads every element of a block; the decode path a sample
    that meets every plane."""
    e, _ = BLOCK[qtype]
    k = max(e, 256)
    w = random_blocks(qtype, 8, k, torch.Generator().manual_seed(7))
    expected = dequantize(w, qtype).T  # [K, N]
    eye = torch.eye(k)
    dot = gl.gguf_linear(eye, w, qtype, None, gl.Tiles(64, 16, 64 // gl.LAYOUT[qtype][1], dot=True))
    assert torch.equal(dot, expected)
    rows = [0, 1, 14, 17, 34, 47, 64, 99, 130, 161, 192, 200, 225, 243, 254, 255]
    tiles = gl.Tiles(4, 8, 128 // gl.LAYOUT[qtype][1], split=2)
    decode = gl.gguf_linear(eye[rows].reshape(4, 4, k), w, qtype, None, tiles)
    assert torch.equal(decode.reshape(16, -1), expected[rows])


def test_leading_dims_half_precision_and_empty_inputs():
    qtype = TYPES[0]
    gen = torch.Generator().manual_seed(3)
    w = random_blocks(qtype, 16, 256, gen)
    x = torch.randn(2, 3, 256, generator=gen)
    got = gl.gguf_linear(x, w, qtype, None)
    assert got.shape == (2, 3, 16)
    torch.testing.assert_close(got, gl.gguf_linear(x.reshape(6, 256), w, qtype, None).reshape(2, 3, 16), rtol=0, atol=0)
    half = gl.gguf_linear(x[0, :1].half(), w, qtype, None)  # decode: float32 products, rounded once
    want = reference_gguf_linear(x[0, :1].half().double(), w, qtype, None)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.double(), want, rtol=1e-3, atol=1e-3)
    assert gl.gguf_linear(x[:0, 0], w, qtype, None).shape == (0, 16)


def test_a_wrong_weight_or_tiling_is_named():
    w = random_blocks(TYPES[0], 8, 256, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"not rows of 512 values in 32-element 18-byte blocks \(expected uint8 \[N, 288"):
        gl.gguf_linear(torch.randn(1, 512), w, TYPES[0], None)
    with pytest.raises(ValueError, match=r"not a valid tiling for Q4_0 \(tl.dot needs"):
        gl.gguf_linear(torch.randn(1, 256), w, TYPES[0], None, gl.Tiles(16, 16, 1, dot=True))


def test_tiles_split_k_only_where_rows_are_few():
    from chitu_core.quantization.gguf_blocks import Q4_K

    few = gl.tiles(1, 1024, 4096, Q4_K, 132)
    programs = 1024 // few.block_n
    assert not few.dot and few.split == -(-2 * 132 // programs) > 1  # split until 2 programs a compute unit
    assert gl.tiles(1, 14336, 4096, Q4_K, 132).split == 1
    assert gl.tiles(4, 4096, 4096, Q4_K, 132).block_m == 4 and gl.tiles(5, 4096, 4096, Q4_K, 132).dot
    for qtype in TYPES:  # tl.dot needs K tiles of at least 16
        cfg = gl.tiles(64, 4096, 4096, qtype, 132)
        assert cfg.dot and cfg.groups * gl.LAYOUT[qtype][1] >= 16
