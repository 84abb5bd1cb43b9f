"""Operands for the norms of contract 1.6 (``offset_rms_norm``, ``fused_add_offset_rms_norm``,
``layer_norm``), judged by ``op_cases`` against the reference in float64.

Shapes are those the older norms are checked at (one element, odd widths past a power of two, Gemma's
2304 and 3840) in every memory layout; offset weights are drawn around zero as Gemma stores them,
LayerNorm inputs around a non-zero mean so that centring matters.
"""

from collections.abc import Iterator

from chitu_core.conformance.case import randn

SHAPES = [((1, 1), "contiguous", "strided"), ((7, 96), "padded", "transposed"), ((3, 5, 33), "transposed", "padded"),
          ((17, 2304), "contiguous", "contiguous"), ((2, 3841), "strided", "contiguous"), ((4, 9), "contiguous", "padded")]


def _spec():
    from chitu_core.conformance.op_cases import In, Spec

    return In, Spec


def _name(shape, layout) -> str:
    return f"{'x'.join(map(str, shape))} {layout}"


def offset_rms_norm(dtype) -> Iterator:
    In, Spec = _spec()
    for shape, layout, _ in SHAPES:
        def make(gen, shape=shape, layout=layout):
            x = randn(gen, *shape, dtype=dtype, scale=3.0)
            return [In(x, layout), In(randn(gen, shape[-1], dtype=dtype, scale=0.3), "strided"), 1e-6], {}
        yield Spec(_name(shape, layout), {"shape": list(shape), "eps": 1e-6}, make)


def fused_add_offset_rms_norm(dtype) -> Iterator:
    In, Spec = _spec()
    for shape, lx, lr in SHAPES:
        def make(gen, shape=shape, lx=lx, lr=lr):
            x, residual = randn(gen, *shape, dtype=dtype), randn(gen, *shape, dtype=dtype, scale=2.0)
            return [In(x, lx), In(residual, lr), In(randn(gen, shape[-1], dtype=dtype, scale=0.3)), 1e-6], {}
        yield Spec(f"{_name(shape, lx)}, residual {lr}", {"shape": list(shape), "eps": 1e-6}, make)


def layer_norm(dtype) -> Iterator:
    In, Spec = _spec()
    for (shape, layout, _), bias in zip(SHAPES, [True, False, True, True, False, True]):
        def make(gen, shape=shape, layout=layout, bias=bias):
            x = randn(gen, *shape, dtype=dtype, scale=2.0, offset=1.5)
            w = randn(gen, shape[-1], dtype=dtype, scale=0.3, offset=1.0)
            b = In(randn(gen, shape[-1], dtype=dtype, scale=0.5), "strided") if bias else None
            return [In(x, layout), In(w), b, 1e-5], {}
        yield Spec(f"{_name(shape, layout)}{' with bias' if bias else ''}", {"shape": list(shape), "bias": bias}, make)
