"""rotary_embedding of the op contract (``chitu_core.ops.spec``), optionally fused with the KV-cache write.

One program per token rotates all its query and key heads in float32: channel i
pairs with i + R/2 (neox) or 2i with 2i+1 (interleaved) for i < R/2, where R is
the rotary dimension (the cos|sin table's width); channels R..D pass through.
Returns new contiguous q and k. The fused variant also stores the rotated keys
and the values at the token's cache slot (layout and padding rule as kv_cache.py),
saving the separate write's re-read of k. Into an fp8 cache it stores the rotated
keys rounded to k's dtype first, so that the bytes are those of the separate
rotary op followed by the cache write. Launched dependent (``pdl``), it reads the positions,
their cos|sin rows and the slots before waiting for the kernel before it (the qkv product): step
inputs and a constant table, which no kernel of the step writes.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import pow2
from chitu_core.kernels.triton.kv_cache import check_cache, copy_heads, store_kv, store_target
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options


@triton.jit
def _normed(x, rstd, norm_w, channels, mask, NORM: tl.constexpr):
    """x (float32) times rstd and the norm weight at ``channels``, rounded to the weight's dtype (the
    separate rms_norm op's output) and widened again; x itself without NORM."""
    if NORM:
        w = tl.load(norm_w + channels, mask=mask, other=0.0).to(tl.float32)
        x = (x * rstd * w).to(norm_w.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _rotate_heads(src, stride_h, stride_d, dst, stride_dst_h, num_heads, half, head_dim, cos, sin, scale,
                  norm_w, eps, HEADS_P: tl.constexpr, HALF_P: tl.constexpr, PASS_P: tl.constexpr,
                  DIM_P: tl.constexpr, IS_NEOX: tl.constexpr, FP8: tl.constexpr, NORM: tl.constexpr):
    """Rotate src[h, :2*half] by (cos, sin) ([1, HALF_P] float32) into dst; copy channels 2*half.. as they are.
    FP8: dst is an fp8 cache's bytes; the rotated values are rounded to src's dtype, then stored by
    ``store_kv`` with the scale at ``scale``. NORM: each head is first RMS-normalised over its head_dim
    channels with weight ``norm_w`` and ``eps``, as the rms_norm op would return it."""
    h = tl.arange(0, HEADS_P)[:, None]
    src_ty = src.dtype.element_ty
    rstd = 1.0
    if NORM:  # the whole head once more (from the cache lines just read): its mean square
        d = tl.arange(0, DIM_P)[None, :]
        xs = tl.load(src + h * stride_h + d * stride_d, mask=(h < num_heads) & (d < head_dim), other=0.0)
        xs = xs.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xs * xs, axis=1)[:, None] / head_dim + eps)  # as the rms_norm kernel
    if IS_NEOX:  # the two halves, each a contiguous load
        i = tl.arange(0, HALF_P)[None, :]
        mask = (h < num_heads) & (i < half)
        x1 = tl.load(src + h * stride_h + i * stride_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * stride_h + (i + half) * stride_d, mask=mask, other=0.0).to(tl.float32)
        x1 = _normed(x1, rstd, norm_w, i, i < half, NORM)
        x2 = _normed(x2, rstd, norm_w, i + half, i < half, NORM)
        out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if FP8:
            out1, out2 = out1.to(src_ty), out2.to(src_ty)
        store_kv(dst + h * stride_dst_h + i, out1, mask, scale, FP8)
        store_kv(dst + h * stride_dst_h + i + half, out2, mask, scale, FP8)
    else:  # pairs (2i, 2i+1): one contiguous load, split in registers (stride-2 accesses are slow)
        r = tl.arange(0, 2 * HALF_P)[None, :]
        mask = (h < num_heads) & (r < 2 * half)
        x = tl.load(src + h * stride_h + r * stride_d, mask=mask, other=0.0).to(tl.float32)
        x = _normed(x, rstd, norm_w, r, r < 2 * half, NORM)
        x1, x2 = tl.split(tl.reshape(x, [HEADS_P, HALF_P, 2]))
        out = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), [HEADS_P, 2 * HALF_P])
        if FP8:
            out = out.to(src_ty)
        store_kv(dst + h * stride_dst_h + r, out, mask, scale, FP8)
    if PASS_P > 0:
        p = 2 * half + tl.arange(0, PASS_P)[None, :]
        pass_mask = (h < num_heads) & (p < head_dim)
        x = tl.load(src + h * stride_h + p * stride_d, mask=pass_mask)
        if NORM:
            x = _normed(x.to(tl.float32), rstd, norm_w, p, p < head_dim, NORM).to(src_ty)
        store_kv(dst + h * stride_dst_h + p, x, pass_mask, scale, FP8)


@triton.jit
def _rotary_kernel(
    q_out, k_out, q, k, positions, cos_sin, v, cache, slot_mapping, kv_scale, q_norm_w, k_norm_w, eps,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_pos, stride_cs,
    stride_vt, stride_vh, stride_vd, stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
    num_q_heads, num_kv_heads, half, head_dim,
    Q_HEADS_P: tl.constexpr, K_HEADS_P: tl.constexpr, HALF_P: tl.constexpr, PASS_P: tl.constexpr,
    DIM_P: tl.constexpr, IS_NEOX: tl.constexpr, WRITE_CACHE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):
    # positions and slots are engine inputs no kernel of the step writes, the table a constant: read before the
    # wait, while the kernel before (the qkv product) finishes; q, k and v after it
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t * stride_pos).to(tl.int64)
    i = tl.arange(0, HALF_P)[None, :]
    cos = tl.load(cos_sin + pos * stride_cs + i, mask=i < half, other=0.0)
    sin = tl.load(cos_sin + pos * stride_cs + half + i, mask=i < half, other=0.0)
    if WRITE_CACHE:
        slot = tl.load(slot_mapping + t).to(tl.int64)
    gdc_enter(PDL)
    _rotate_heads(q + t * stride_qt, stride_qh, stride_qd, q_out + t * num_q_heads * head_dim, head_dim,
                  num_q_heads, half, head_dim, cos, sin, kv_scale, q_norm_w, eps, Q_HEADS_P, HALF_P, PASS_P, DIM_P,
                  IS_NEOX, False, NORM)
    _rotate_heads(k + t * stride_kt, stride_kh, stride_kd, k_out + t * num_kv_heads * head_dim, head_dim,
                  num_kv_heads, half, head_dim, cos, sin, kv_scale, k_norm_w, eps, K_HEADS_P, HALF_P, PASS_P, DIM_P,
                  IS_NEOX, False, NORM)
    if WRITE_CACHE:
        if slot >= 0:
            dst = cache + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok
            _rotate_heads(k + t * stride_kt, stride_kh, stride_kd, dst, stride_c_head, num_kv_heads, half, head_dim,
                          cos, sin, kv_scale, k_norm_w, eps, K_HEADS_P, HALF_P, PASS_P, DIM_P, IS_NEOX, FP8, NORM)
            copy_heads(v + t * stride_vt, stride_vh, stride_vd, dst + stride_c_kv, stride_c_head,
                       num_kv_heads, head_dim, kv_scale + 1, K_HEADS_P, DIM_P, FP8)


def _launch(positions, q, k, cos_sin_cache, is_neox, v=None, kv_cache=None, slot_mapping=None, kv_scale=None,
            qk_norm=None):
    t, hq, dim = q.shape
    hk, rot = k.shape[1], cos_sin_cache.shape[-1]
    if rot % 2 or rot > dim:
        raise ValueError(f"rotary_embedding: rotary dim {rot} must be even and at most head_dim {dim}")
    q_out = torch.empty((t, hq, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, dim), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    write = kv_cache is not None
    if write:
        check_cache(kv_cache)
        target, scale, fp8 = store_target(kv_cache, kv_scale, 2)
    else:  # unused: the WRITE_CACHE branch is compiled out
        v, kv_cache, slot_mapping, target, scale, fp8 = k, k_out, positions, k_out, k_out, False
    stride_c = kv_cache.stride()[:4] if write else (0, 0, 0, 0)
    q_norm_w, k_norm_w, eps = (q, k, 0.0) if qk_norm is None else _check_qk_norm(qk_norm, q, dim)
    _rotary_kernel[(t,)](
        q_out, k_out, q, k, positions, cos_sin_cache, v, target, slot_mapping, scale, q_norm_w, k_norm_w, eps,
        *q.stride(), *k.stride(), positions.stride(0), cos_sin_cache.stride(0), *v.stride(), *stride_c,
        hq, hk, rot // 2, dim,
        Q_HEADS_P=pow2(hq), K_HEADS_P=pow2(hk), HALF_P=pow2(rot // 2), PASS_P=pow2(dim - rot) if dim > rot else 0,
        DIM_P=pow2(dim), IS_NEOX=is_neox, WRITE_CACHE=write, BLOCK_SIZE=kv_cache.shape[2] if write else 1, FP8=fp8,
        NORM=qk_norm is not None, num_warps=4, **pdl_options(q.device),
    )
    return q_out, k_out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(positions, q, k, cos_sin_cache, is_neox)


def _check_qk_norm(qk_norm, q: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    q_w, k_w, eps = qk_norm
    for name, w in (("q", q_w), ("k", k_w)):
        if tuple(w.shape) != (dim,) or w.dtype != q.dtype or not w.is_contiguous():
            raise ValueError(f"rotary_embedding_and_write_kv: the {name} norm weight must be contiguous {q.dtype} "
                             f"[{dim}] (head_dim), got {w.dtype} {list(w.shape)}")
    return q_w, k_w, float(eps)


def rotary_embedding_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None,
                                  qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding, and the rotated k with v written to kv_cache at slot_mapping (as write_kv;
    an fp8 cache needs the layer's ``kv_scale``). ``qk_norm`` (q weight, k weight, eps): each head of q
    and k RMS-normalised first, as the rms_norm op returns it (Qwen3's per-head norms)."""
    return _launch(positions, q, k, cos_sin_cache, is_neox, v, kv_cache, slot_mapping, kv_scale, qk_norm)
