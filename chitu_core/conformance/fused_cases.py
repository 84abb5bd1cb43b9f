"""Operands for the decode-step fusions of contract 1.9 (``rms_norm_linear``, ``linear_add``) and 1.10
(``mla_inputs``), judged by ``op_cases`` against the reference in float64.

Rows 1 (batch-1 decode), 2 to 8 (small batches, where a backend may keep a matrix-vector kernel) and
more (where it hands over to a GEMM); K and N off the powers of two and past a tile; each gated
activation; the weight in both memory orders (row-major as checkpoints store it, and transposed).
``mla_inputs``: DeepSeek-V2-Lite's and V3's head shapes, sizes off the powers of two, both rotary
pair layouts, q contiguous (the view of a projection's output the layer passes) and padded.
"""

from collections.abc import Iterator

import torch

from chitu_core.conformance.case import randn

NORM_LINEAR = [  # (rows, K, N, bias, activation, x layout, weight layout)
    (1, 1, 1, False, None, "contiguous", "contiguous"), (1, 576, 960, False, None, "contiguous", "transposed"),
    (1, 300, 70, True, None, "strided", "contiguous"), (1, 576, 3072, False, "silu", "contiguous", "transposed"),
    (3, 257, 130, True, "gelu_tanh", "padded", "transposed"), (4, 2048, 4096, False, None, "contiguous", "transposed"),
    (8, 1000, 96, False, "gelu", "contiguous", "contiguous"), (5, 512, 1026, True, "silu", "transposed", "transposed"),
    (17, 256, 384, False, "silu", "contiguous", "transposed"), (64, 1024, 1024, True, None, "contiguous", "contiguous"),
]
LINEAR_ADD = [  # (rows, K, N, bias, x layout, weight layout, residual layout)
    (1, 1, 1, False, "contiguous", "contiguous", "contiguous"),
    (1, 960, 576, False, "contiguous", "transposed", "contiguous"),
    (1, 300, 70, True, "strided", "contiguous", "padded"), (2, 1536, 576, False, "contiguous", "transposed", "strided"),
    (4, 2048, 2048, True, "padded", "transposed", "contiguous"),
    (8, 129, 1000, False, "transposed", "contiguous", "contiguous"),
    (17, 512, 256, True, "contiguous", "transposed", "transposed"),
    (64, 1024, 1024, False, "contiguous", "contiguous", "padded"),
]


def _spec():
    from chitu_core.conformance.op_cases import In, Spec

    return In, Spec


def rms_norm_linear(dtype) -> Iterator:
    In, Spec = _spec()
    for m, k, n, bias, act, lx, lw in NORM_LINEAR:
        def make(gen, m=m, k=k, n=n, bias=bias, act=act, lx=lx, lw=lw):
            x = randn(gen, m, k, dtype=dtype, scale=3.0)
            norm_w = randn(gen, k, dtype=dtype, scale=0.3, offset=1.0)
            w = randn(gen, n, k, dtype=dtype, scale=k**-0.5)
            b = In(randn(gen, n, dtype=dtype), "strided") if bias else None
            return [In(x, lx), In(norm_w, "strided"), 1e-6, In(w, lw), b], ({} if act is None else {"activation": act})
        label = f"M={m} K={k} N={n}{' bias' if bias else ''}{' ' + act if act else ''} x {lx}, weight {lw}"
        yield Spec(label, {"m": m, "k": k, "n": n, "bias": bias, "activation": act}, make,
                   flops=lambda host, m=m, k=k, n=n: 2 * m * k * n)


def linear_add(dtype) -> Iterator:
    In, Spec = _spec()
    for m, k, n, bias, lx, lw, lr in LINEAR_ADD:
        def make(gen, m=m, k=k, n=n, bias=bias, lx=lx, lw=lw, lr=lr):
            x, w = randn(gen, m, k, dtype=dtype), randn(gen, n, k, dtype=dtype, scale=k**-0.5)
            b = In(randn(gen, n, dtype=dtype), "strided") if bias else None
            return [In(x, lx), In(w, lw), b, In(randn(gen, m, n, dtype=dtype, scale=4.0), lr)], {}
        label = f"M={m} K={k} N={n}{' bias' if bias else ''} x {lx}, weight {lw}, residual {lr}"
        yield Spec(label, {"m": m, "k": k, "n": n, "bias": bias}, make, flops=lambda host, m=m, k=k, n=n: 2 * m * k * n)


MLA_INPUTS = [  # (tokens, heads, nope N, rotary R, latent L, is_neox, q layout)
    (1, 16, 128, 64, 512, False, "contiguous"), (1, 128, 128, 64, 512, False, "contiguous"),
    (3, 3, 24, 16, 40, True, "padded"), (5, 2, 16, 8, 100, False, "contiguous"), (17, 4, 64, 32, 256, True, "contiguous"),
]


def mla_inputs(dtype) -> Iterator:
    from chitu_core.conformance.op_cases import _cos_sin_cache

    In, Spec = _spec()
    for t, h, n, r, lora, neox, lq in MLA_INPUTS:
        def make(gen, t=t, h=h, n=n, r=r, lora=lora, neox=neox, lq=lq):
            q = randn(gen, t, h, n + r, dtype=dtype)
            kv = randn(gen, t, lora + r, dtype=dtype, scale=3.0)
            w_uk = randn(gen, h, n, lora, dtype=dtype, scale=n**-0.5)
            positions = torch.randint(0, 4096, (t,), generator=gen)
            return [In(q, lq), In(kv), In(w_uk),
                    In(randn(gen, lora, dtype=dtype, scale=0.3, offset=1.0)), 1e-6, In(positions),
                    In(_cos_sin_cache(gen, 4096, r)), neox], {}
        label = f"T={t} H={h} N={n} R={r} L={lora} {'neox' if neox else 'interleaved'} q {lq}"
        yield Spec(label, {"tokens": t, "heads": h, "nope": n, "rope": r, "lora": lora, "is_neox": neox}, make,
                   flops=lambda host, t=t, h=h, n=n, lora=lora: 2 * t * h * n * lora)
