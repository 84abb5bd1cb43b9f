"""mla_inputs of the op contract (1.10): multi-head latent attention's absorbed query and latent, from its
projections, in one launch (instead of a rotary, a batched product, a norm and two concatenations).

Programs (token t, p): for p < H * NB, head h = p // NB and columns [b * BLOCK_L, (b + 1) * BLOCK_L) of the
latent width L, b = p % NB: q[t, h, :N] times w_uk[h]'s columns as a matrix-vector product in float32 (the
weight tile is loaded before the dependent-launch wait: no earlier kernel writes it); the program with
b = 0 also rotates the head's R rotary channels. Program p = H * NB: the latent, the RMSNorm of kv[t, :L]
times its weight (float32, rounded once) and the rotated kv[t, L:]. Rotation in float32 as
``rotary.py``'s: channel i pairs with i + R/2 (neox) or 2i with 2i + 1 (interleaved).
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import pow2
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options

BLOCK_L = 64  # latent columns a program: DeepSeek's 512 over 8 programs a head, 16 KB of w_uk each


@triton.jit
def _rotate(src, dst, pos, cache, stride_cp, HALF: tl.constexpr, HALF_P: tl.constexpr, IS_NEOX: tl.constexpr):
    """dst[:2 * HALF] = src[:2 * HALF] rotated by the table's row ``pos`` (cos | sin), rounded to dst's dtype."""
    i = tl.arange(0, HALF_P)
    ok = i < HALF
    if IS_NEOX:
        first, second = i, i + HALF
    else:
        first, second = 2 * i, 2 * i + 1
    x1 = tl.load(src + first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cache + pos * stride_cp + i, mask=ok, other=0.0)
    sin = tl.load(cache + pos * stride_cp + HALF + i, mask=ok, other=0.0)
    tl.store(dst + first, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _mla_inputs_kernel(q_attn, latent, q, kv, w_uk, norm_w, positions, cache, eps, num_heads, nope, lora,
                       stride_qt, stride_qh, stride_kvt, stride_wh, stride_wn, stride_cp, stride_at, stride_ah,
                       stride_lt, NB: tl.constexpr, BLOCK_L: tl.constexpr, NOPE_P: tl.constexpr,
                       LORA_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, IS_NEOX: tl.constexpr,
                       PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    if p < num_heads * NB:
        h, b = p // NB, p % NB
        n = tl.arange(0, NOPE_P)
        cols = b * BLOCK_L + tl.arange(0, BLOCK_L)
        w = tl.load(w_uk + h * stride_wh + n[:, None] * stride_wn + cols[None, :],
                    mask=(n < nope)[:, None] & (cols < lora)[None, :], other=0.0)  # weights: before the wait
        gdc_enter(PDL)
        row = q + t * stride_qt + h * stride_qh
        qn = tl.load(row + n, mask=n < nope, other=0.0).to(tl.float32)
        out = q_attn + t * stride_at + h * stride_ah
        tl.store(out + cols, tl.sum(w.to(tl.float32) * qn[:, None], axis=0).to(out.dtype.element_ty),
                 mask=cols < lora)
        if b == 0:
            _rotate(row + nope, out + lora, tl.load(positions + t), cache, stride_cp, HALF, HALF_P, IS_NEOX)
    else:
        gdc_enter(PDL)
        c = tl.arange(0, LORA_P)
        row = kv + t * stride_kvt
        x = tl.load(row + c, mask=c < lora, other=0.0).to(tl.float32)
        rms = tl.rsqrt(tl.sum(x * x, axis=0) / lora + eps)
        g = tl.load(norm_w + c, mask=c < lora, other=0.0).to(tl.float32)
        out = latent + t * stride_lt
        tl.store(out + c, (x * rms * g).to(out.dtype.element_ty), mask=c < lora)
        _rotate(row + lora, out + lora, tl.load(positions + t), cache, stride_cp, HALF, HALF_P, IS_NEOX)


def _check(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor, kv_norm_weight: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> None:
    heads, nope, lora = w_uk.shape
    rot = cos_sin_cache.shape[-1]
    ok = (q.dim() == 3 and q.shape[1:] == (heads, nope + rot) and kv.dim() == 2 and kv.shape == (q.shape[0], lora + rot)
          and tuple(kv_norm_weight.shape) == (lora,) and rot % 2 == 0)
    if not ok:
        raise ValueError(f"mla_inputs: q {list(q.shape)}, kv {list(kv.shape)}, w_uk {list(w_uk.shape)}, kv_norm_weight "
                         f"{list(kv_norm_weight.shape)} and a table {rot} wide do not fit: q [T, H, N + R], kv "
                         "[T, L + R], w_uk [H, N, L], kv_norm_weight [L], R even")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with its last dimension contiguous (the kernel's loads step by one element); a copy only where not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def mla_inputs(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor, kv_norm_weight: torch.Tensor, eps: float,
               positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See the contract (``chitu_core.ops.spec.OpSet.mla_inputs``)."""
    _check(q, kv, w_uk, kv_norm_weight, cos_sin_cache)
    q, kv, w_uk, kv_norm_weight = _rows(q), _rows(kv), _rows(w_uk), kv_norm_weight.contiguous()
    tokens, (heads, nope, lora), rot = q.shape[0], w_uk.shape, cos_sin_cache.shape[-1]
    q_attn = torch.empty((tokens, heads, lora + rot), dtype=q.dtype, device=q.device)
    latent = torch.empty((tokens, lora + rot), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_attn, latent
    block_l = min(BLOCK_L, pow2(lora))
    blocks = triton.cdiv(lora, block_l)
    cache = cos_sin_cache.float()
    _mla_inputs_kernel[(tokens, heads * blocks + 1)](
        q_attn, latent, q, kv, w_uk, kv_norm_weight, positions, cache, eps, heads, nope, lora,
        q.stride(0), q.stride(1), kv.stride(0), w_uk.stride(0), w_uk.stride(1), cache.stride(0), q_attn.stride(0),
        q_attn.stride(1), latent.stride(0), NB=blocks, BLOCK_L=block_l, NOPE_P=pow2(nope), LORA_P=pow2(lora),
        HALF=rot // 2, HALF_P=pow2(max(1, rot // 2)), IS_NEOX=is_neox, num_warps=4, **pdl_options(q.device))
    return q_attn, latent
