"""The KV-cache write of the attention contract: each new token's keys and values stored at its slot.

Cache layout (``TritonPagedAttention.kv_cache_shape``): [2, num_blocks, block_size,
num_kv_heads, head_dim], keys then values, head_dim contiguous. Slot s is
position s % block_size of block s // block_size; a negative slot is a padding
token and writes nothing. One program per token copies all its heads.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import pow2


@triton.jit
def copy_heads(src, stride_src_h, stride_src_d, dst, stride_dst_h, num_heads, head_dim,
               HEADS_P: tl.constexpr, DIM_P: tl.constexpr):
    """dst[h, d] = src[h, d] for h < num_heads, d < head_dim (dst's last dimension contiguous)."""
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, DIM_P)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    x = tl.load(src + h * stride_src_h + d * stride_src_d, mask=mask)
    tl.store(dst + h * stride_dst_h + d, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    cache, k, v, slot_mapping,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head, num_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, HEADS_P: tl.constexpr, DIM_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:
        dst = cache + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok
        copy_heads(k + t * stride_kt, stride_kh, stride_kd, dst, stride_c_head, num_heads, head_dim, HEADS_P, DIM_P)
        copy_heads(v + t * stride_vt, stride_vh, stride_vd, dst + stride_c_kv, stride_c_head, num_heads, head_dim,
                   HEADS_P, DIM_P)


def check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(f"expected a [2, num_blocks, block_size, kv_heads, head_dim] cache with head_dim contiguous, "
                         f"got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D] (any strides); slot_mapping: int [T]. Writes them into kv_cache in place."""
    check_cache(kv_cache)
    t, heads, dim = k.shape
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        kv_cache, k, v, slot_mapping, *k.stride(), *v.stride(), *kv_cache.stride()[:4], heads, dim,
        BLOCK_SIZE=kv_cache.shape[2], HEADS_P=pow2(heads), DIM_P=pow2(dim), num_warps=1 if heads * dim <= 1024 else 4,
    )
