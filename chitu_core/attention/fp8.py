"""The FP8 KV cache (contract 1.2, ``kv_cache_dtype="fp8"``): the format every backend stores and reads.

Elements are float8_e4m3fn (4 exponent bits, 3 mantissa bits, no infinity, largest finite 448),
one byte each: a block takes half the bytes of a 16-bit cache, so the same memory holds twice the
blocks. Each layer has its own float32 scales, ``kv_scale``: [2] (keys, values) for regular
attention, [1] for latent attention (MLA), whose cache row (latent, then rotary key) is one
tensor. A value x of the model dtype is stored as

    e4m3(clamp(x / scale, -448, 448))

x taken exactly to float32, divided by the float32 scale with IEEE division (a kernel must not
multiply by a reciprocal instead: the rounding differs), clamped to e4m3's finite range
(saturating: a plain cast of a value beyond 464 gives NaN), and rounded to nearest, ties to even
(what torch's cast does). It is read back as float(stored) * scale; e4m3 values are exact in
bfloat16, float16 and float32, so a kernel may upcast the stored bytes to its compute dtype and
fold the scales into the softmax scale and the output instead.

Checkpoints quantized with a KV-cache scheme (llm-compressor's ``kv_cache_scheme``, ModelOpt's
``kv_cache_quant_algo``) carry per-layer scalars such as ``model.layers.N.self_attn.k_scale`` /
``v_scale`` with this very meaning; ``chitu_core.quantization.kv_scales`` loads them into the layers'
``kv_scale`` (regular attention only: no format defines one for the latent row). Elsewhere scales are
1.0, as vLLM's are where a checkpoint gives none: e4m3 then holds |x| <= 448 with a relative step of
2**-3 down to 2**-6 (and absolute steps of 2**-9 below): keys and values of order 1 to 100, as models
have them, fit, and rarer outliers saturate.
"""

import torch

Tensor = torch.Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_CACHE_DTYPES = ("auto", "fp8", "float16", "bfloat16")
"""What ``set_kv_cache_dtype`` accepts: "auto" (the model dtype), "fp8", or (contract 1.15) a 16-bit cache
of a float32 model (the engine resolves its own ``kv_cache_dtype`` to these: ``quantization.kv_scales``)."""


def is_fp8(kv_cache: Tensor) -> bool:
    return kv_cache.dtype == FP8_DTYPE


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """x (any float dtype) -> float8_e4m3fn: x / scale, saturated to +-448, rounded to nearest even.
    ``scale``: a float32 tensor of one element (a layer's key, value or latent scale), on x's device:
    a tensor, not a Python float, so that every device divides (some devices' kernels multiply a tensor
    by the reciprocal of a host scalar instead, which rounds differently)."""
    return (x.float() / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Stored float8_e4m3fn values -> ``dtype``: float(x) * scale, computed in ``dtype``."""
    return x.to(dtype) * scale.to(dtype)


def check_scale(kv_cache: Tensor, kv_scale: Tensor | None, width: int) -> None:
    """An fp8 cache needs its layer's scales: float32 [width]."""
    if kv_scale is None or kv_scale.shape != (width,) or kv_scale.dtype != torch.float32:
        got = "none" if kv_scale is None else f"{kv_scale.dtype} {tuple(kv_scale.shape)}"
        raise ValueError(f"an fp8 KV cache needs the layer's kv_scale, float32 [{width}]; got {got}")
