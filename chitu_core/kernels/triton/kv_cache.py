"""The KV-cache write of the attention contract: each new token's keys and values stored at its slot.

Cache layout (``TritonPagedAttention.kv_cache_shape``): [2, num_blocks, block_size,
num_kv_heads, head_dim], keys then values, head_dim contiguous. Slot s is
position s % block_size of block s // block_size; a negative slot is a padding
token and writes nothing. One program per token copies all its heads.

An fp8 cache (contract 1.2, ``chitu_core.attention.fp8``) is written through its
bytes (a uint8 view): ``e4m3_bits`` divides by the layer's scale (IEEE division,
as the reference), saturates and rounds to nearest even with integer operations,
so the bytes equal torch's cast on every Triton target and under the interpreter
(whose float8 casts round differently), and no float8 type is needed to write.
"""

import torch
import triton
import triton.language as tl

from chitu_core.attention.fp8 import FP8_DTYPE, check_scale
from chitu_core.kernels.triton.common import pow2


@triton.jit
def e4m3_bits(x, scale):
    """float32 x -> the float8_e4m3fn bits (uint8) of clamp(x / scale, -448, 448), rounded to nearest even."""
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    bits = y.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # Normal in e4m3 (|y| >= 2**-6): round the 23-bit mantissa to 3 bits, ties to even (a carry moves
    # into the exponent), then rebias the exponent from 127 to 7 (120 << 3 in the shifted bits).
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - 960
    # Subnormal (steps of 2**-9): adding 2**14, whose float32 step is 2**-9, rounds |y| to nearest
    # even in the hardware; the low bits of the sum are then the count of steps.
    subnormal = (tl.abs(y) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
    code = tl.where(magnitude < 0x3C800000, subnormal, normal) | ((bits >> 24) & 0x80)
    return code.to(tl.uint8)


@triton.jit
def store_kv(dst, x, mask, scale, FP8: tl.constexpr):
    """Store x at dst, a cache element pointer: cast to the cache's dtype, or (FP8; dst then points at
    the cache's bytes) as the e4m3 bits of x / the float32 at ``scale``."""
    if FP8:
        tl.store(dst, e4m3_bits(x.to(tl.float32), tl.load(scale)), mask=mask)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def copy_heads(src, stride_src_h, stride_src_d, dst, stride_dst_h, num_heads, head_dim, scale,
               HEADS_P: tl.constexpr, DIM_P: tl.constexpr, FP8: tl.constexpr):
    """dst[h, d] = src[h, d] for h < num_heads, d < head_dim (dst's last dimension contiguous), through
    ``store_kv``."""
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, DIM_P)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    x = tl.load(src + h * stride_src_h + d * stride_src_d, mask=mask)
    store_kv(dst + h * stride_dst_h + d, x, mask, scale, FP8)


@triton.jit
def _write_kv_kernel(
    cache, k, v, slot_mapping, kv_scale,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head, num_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, HEADS_P: tl.constexpr, DIM_P: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:
        dst = cache + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok
        copy_heads(k + t * stride_kt, stride_kh, stride_kd, dst, stride_c_head, num_heads, head_dim, kv_scale,
                   HEADS_P, DIM_P, FP8)
        copy_heads(v + t * stride_vt, stride_vh, stride_vd, dst + stride_c_kv, stride_c_head, num_heads, head_dim,
                   kv_scale + 1, HEADS_P, DIM_P, FP8)


def check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(f"expected a [2, num_blocks, block_size, kv_heads, head_dim] cache with head_dim contiguous, "
                         f"got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")


def store_target(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None,
                 num_scales: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(tensor the write kernels store into, scale pointer, FP8): an fp8 cache's bytes and its scales;
    else the cache itself (and a stand-in pointer the kernels never read)."""
    if kv_cache.dtype != FP8_DTYPE:
        return kv_cache, kv_cache, False
    check_scale(kv_cache, kv_scale, num_scales)
    return kv_cache.view(torch.uint8), kv_scale, True


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hk, D] (any strides); slot_mapping: int [T]. Writes them into kv_cache in place;
    an fp8 cache needs the layer's ``kv_scale`` (float32 [2])."""
    check_cache(kv_cache)
    t, heads, dim = k.shape
    if t == 0:
        return
    target, scale, fp8 = store_target(kv_cache, kv_scale, 2)
    _write_kv_kernel[(t,)](
        target, k, v, slot_mapping, scale, *k.stride(), *v.stride(), *kv_cache.stride()[:4], heads, dim,
        BLOCK_SIZE=kv_cache.shape[2], HEADS_P=pow2(heads), DIM_P=pow2(dim), FP8=fp8,
        num_warps=1 if heads * dim <= 1024 else 4,
    )
