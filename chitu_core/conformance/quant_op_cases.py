"""Operands for the quantized-linear ops of contract 1.2 (``int4_linear``, ``int8_linear``,
``fp8_linear``, ``gguf_linear``) and 1.18's fusions over 4-bit weights (``int4_rms_norm_linear``,
``int4_linear_add``), judged by ``op_cases`` against the reference in float64.

Shapes come from real models (Llama-3.1-8B's 4096 and 14336, DeepSeek-V3's 7168 and its 576-row
``kv_a_proj_with_mqa``, which ends in half a 128-block) and from the edges kernels dispatch on (one
token, odd token counts). Weights are random bits in the format's range; scales are sized so that
outputs are O(1).
"""

from collections.abc import Iterator

import torch

from chitu_core.conformance.case import randn

GGUF_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _spec():
    from chitu_core.conformance.op_cases import In, Spec

    return In, Spec


def _int4_weight(gen, k: int, n: int, group: int, sdtype: torch.dtype) -> list:
    """qweight, scales, zeros (strided) and the group size, as ``int4_linear`` takes them, outputs O(1)."""
    In, _ = _spec()
    qweight = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(k // group, n, generator=gen) * 0.5 + 0.5) * (2.0 / (15 * k**0.5))
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).float()
    return [In(qweight), In(scales.to(sdtype)), In(zeros.to(sdtype), "strided"), group]


def int4_linear(dtype) -> Iterator:
    In, Spec = _spec()
    for m, k, n, group, sdtype, bias, layout in [
        (1, 4096, 4096, 128, torch.float16, False, "contiguous"), (7, 512, 96, 32, dtype, True, "padded"),
        (33, 1024, 640, 64, torch.float16, False, "strided"), (1, 14336, 512, 128, dtype, False, "contiguous"),
        (5, 256, 24, 128, torch.float32, True, "transposed"), (1, 512, 96, 32, dtype, True, "strided"),
    ]:
        def make(gen, m=m, k=k, n=n, group=group, sdtype=sdtype, bias=bias, layout=layout):
            weight = _int4_weight(gen, k, n, group, sdtype)
            b = In(randn(gen, n, dtype=dtype)) if bias else None
            return [In(randn(gen, m, k, dtype=dtype), layout), *weight, b], {}
        yield Spec(f"M={m} K={k} N={n} g{group} scales {str(sdtype)[6:]}{' bias' if bias else ''} {layout}",
                   {"m": m, "k": k, "n": n, "group_size": group}, make)


def int4_rms_norm_linear(dtype) -> Iterator:  # contract 1.18; the layers' scales are float16
    In, Spec = _spec()
    for m, k, n, group, sdtype, bias, act, layout in [
        (1, 4096, 1024, 128, torch.float16, False, None, "contiguous"),
        (1, 1024, 1536, 64, torch.float16, True, "silu", "strided"),
        (1, 768, 80, 128, dtype, False, "gelu", "contiguous"),
        (3, 512, 192, 32, torch.float16, True, "gelu_tanh", "padded"),
        (8, 256, 96, 128, torch.float16, False, None, "transposed"),
    ]:
        def make(gen, m=m, k=k, n=n, group=group, sdtype=sdtype, bias=bias, act=act, layout=layout):
            x = randn(gen, m, k, dtype=dtype, scale=3.0)
            norm_w = randn(gen, k, dtype=dtype, scale=0.3, offset=1.0)
            weight = _int4_weight(gen, k, n, group, sdtype)
            b = In(randn(gen, n, dtype=dtype), "strided") if bias else None
            kwargs = {} if act is None else {"activation": act}
            return [In(x, layout), In(norm_w, "strided"), 1e-6, *weight, b], kwargs
        yield Spec(f"M={m} K={k} N={n} g{group} scales {str(sdtype)[6:]}{' bias' if bias else ''}"
                   f"{' ' + act if act else ''} {layout}", {"m": m, "k": k, "n": n, "group_size": group,
                                                           "activation": act}, make)


def int4_linear_add(dtype) -> Iterator:  # contract 1.18
    In, Spec = _spec()
    for m, k, n, group, sdtype, bias, layout, res_layout in [
        (1, 4096, 1024, 128, torch.float16, False, "contiguous", "contiguous"),
        (1, 14336, 512, 128, torch.float16, True, "strided", "padded"),
        (1, 256, 40, 128, dtype, False, "contiguous", "strided"),
        (2, 512, 96, 32, torch.float16, True, "padded", "contiguous"),
    ]:
        def make(gen, m=m, k=k, n=n, group=group, sdtype=sdtype, bias=bias, layout=layout, res_layout=res_layout):
            weight = _int4_weight(gen, k, n, group, sdtype)
            b = In(randn(gen, n, dtype=dtype), "strided") if bias else None
            residual = In(randn(gen, m, n, dtype=dtype), res_layout)
            return [In(randn(gen, m, k, dtype=dtype), layout), *weight, b, residual], {}
        yield Spec(f"M={m} K={k} N={n} g{group} scales {str(sdtype)[6:]}{' bias' if bias else ''} {layout}, residual "
                   f"{res_layout}", {"m": m, "k": k, "n": n, "group_size": group}, make)


def int8_linear(dtype) -> Iterator:
    In, Spec = _spec()
    for m, k, n, act_quant, bias, layout in [
        (1, 4096, 4096, True, False, "contiguous"), (1, 4096, 1024, False, False, "contiguous"),
        (7, 512, 96, True, True, "padded"), (33, 1024, 640, False, True, "strided"), (64, 256, 264, True, False, "contiguous"),
    ]:
        def make(gen, m=m, k=k, n=n, act_quant=act_quant, bias=bias, layout=layout):
            weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
            scales = (torch.rand(n, generator=gen) * 0.5 + 0.5) * (1.7 / (127 * k**0.5))
            x = randn(gen, m, k, dtype=dtype)
            x[0] = 0 if m > 1 else x[0]  # an all-zero row: its scale is 1 by contract
            b = In(randn(gen, n, dtype=dtype)) if bias else None
            return [In(x, layout), In(weight), In(scales), act_quant, b], {}
        yield Spec(f"M={m} K={k} N={n} {'W8A8' if act_quant else 'W8A16'}{' bias' if bias else ''} {layout}",
                   {"m": m, "k": k, "n": n, "act_quant": act_quant}, make)


def fp8_linear(dtype) -> Iterator:
    In, Spec = _spec()
    for m, k, n, block, act_quant, bias, layout in [
        (1, 7168, 576, (128, 128), True, False, "contiguous"), (1, 7168, 576, (128, 128), False, False, "contiguous"),
        (1, 4096, 4096, None, True, False, "contiguous"), (9, 4096, 1024, None, False, True, "padded"),
        (33, 1536, 640, (128, 128), True, True, "strided"), (3, 200, 72, (128, 128), False, False, "transposed"),
        (64, 512, 256, (128, 128), False, False, "contiguous"), (1, 1024, 200, None, False, True, "strided"),
    ]:
        def make(gen, m=m, k=k, n=n, block=block, act_quant=act_quant, bias=bias, layout=layout):
            weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
            scales = (torch.rand(shape, generator=gen) * 0.5 + 0.5) * (1.0 / (100 * k**0.5))
            b = In(randn(gen, n, dtype=dtype)) if bias else None
            return [In(randn(gen, m, k, dtype=dtype), layout), In(weight), In(scales), block, act_quant, b], {}
        what = "per-channel" if block is None else f"block {block[0]}x{block[1]}"
        yield Spec(f"M={m} K={k} N={n} {what} {'W8A8' if act_quant else 'W8A16'}{' bias' if bias else ''} {layout}",
                   {"m": m, "k": k, "n": n, "block_size": block, "act_quant": act_quant}, make)


def gguf_linear(dtype) -> Iterator:
    from chitu_core.quantization.gguf_blocks import random_blocks

    In, Spec = _spec()
    for (tname, qtype), (m, k, n, layout) in zip(
            list(GGUF_TYPES.items()) * 2,
            [(1, 2048, 64, "contiguous"), (5, 512, 96, "padded"), (1, 256, 33, "strided"), (3, 1024, 80, "contiguous"),
             (1, 2048, 64, "contiguous"), (17, 768, 48, "transposed"), (1, 4096, 256, "contiguous"),
             (9, 512, 40, "padded"), (2, 256, 16, "contiguous"), (1, 4096, 128, "contiguous"),
             (33, 1024, 64, "strided"), (1, 3072, 96, "contiguous")]):
        def make(gen, qtype=qtype, m=m, k=k, n=n, layout=layout):
            return [In(randn(gen, m, k, dtype=dtype), layout), In(random_blocks(qtype, n, k, gen)), qtype, None], {}
        yield Spec(f"{tname} M={m} K={k} N={n} {layout}", {"m": m, "k": k, "n": n, "qtype": tname}, make)
