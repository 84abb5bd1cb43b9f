"""``fused_experts_fp8`` of the op contract (``chitu_core.ops.spec``, 1.3): FP8 (e4m3) experts, 16-bit activations.

The two paths of ``moe`` (``fused_experts``) with the weight tile read as FP8 and converted to x's dtype
in registers ("soft FP8"), and the same alignment (``moe_align.align``), shape choices
(``use_slot_path``, ``grouped_config``, ``SLOT_TILES``) and deterministic sum of each token's slots
(``moe.sum_slots``): no host synchronisation, every size from T, top_k, E, H, I and the tiles.

* grouped (``_grouped_gemm_fp8_kernel``): BLOCK_M slots of one expert times [BLOCK_K, BLOCK_N] weight
  tiles. Block scales [E, ceil(N/bn), ceil(K/bk)]: each K tile lies inside one block column (BLOCK_K
  divides bk), so its partial product is multiplied by its column's scales (one per output row's
  block) before it is added; channel scales [E, N] multiply the sum once, after the K loop.
* per slot (``_slot_gemv_fp8_kernel``), for decode: one slot's row times its expert's weights as a
  matrix-vector product in float32 registers, scales applied the same two ways.

Two entry points, as ``fp8_linear``: ``fused_experts_fp8`` loads the weight as float8_e4m3fn (Triton
targets with FP8 types: NVIDIA compute capability 8.9 and newer), ``fused_experts_fp8_bytes`` loads its
bytes and decodes them exactly in registers (``act_quant.decode_e4m3_bytes``: float16 values of 1/256
of the weight's, the 256 folded into the scales) for targets without them. A backend registers the
one that suits its device.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.act_quant import FP8_BYTES_FACTOR
from chitu_core.kernels.triton.moe import (
    ACTIVATIONS,
    SLOT_TILES,
    GemmConfig,
    act_and_mul,
    grouped_config,
    sum_slots,
    use_slot_path,
)
from chitu_core.kernels.triton.moe_align import align
from chitu_core.kernels.triton.quant_matmul import TORCH_TO_TL, _weight_tile


@triton.jit
def _scales(base, n, k0, n_ok, stride_sn, stride_sk, W_BLOCKS: tl.constexpr, BN_W: tl.constexpr,
            BK_W: tl.constexpr, W_FACTOR: tl.constexpr):
    """The scales of output rows n: of the block column holding K offset k0 (W_BLOCKS), else per channel."""
    if W_BLOCKS:
        s = tl.load(base + (n // BN_W) * stride_sn + (k0 // BK_W) * stride_sk, mask=n_ok, other=0.0)
    else:
        s = tl.load(base + n * stride_sn, mask=n_ok, other=0.0)
    return s * W_FACTOR


@triton.jit(do_not_specialize=["slots"])
def _grouped_gemm_fp8_kernel(
    out, a, w, w_scale, sorted_slots, block_expert, slots, n_out, k_dim, rows_per_a,
    stride_at, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_out,
    GATED: tl.constexpr, ACT: tl.constexpr, W_KIND: tl.constexpr, W_BLOCKS: tl.constexpr, BN_W: tl.constexpr,
    BK_W: tl.constexpr, W_FACTOR: tl.constexpr, CT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """``moe._grouped_gemm_kernel`` with w[e] = FP8 weight * scales (rows n + n_out: the up half, GATED)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert + pid_m).to(tl.int64)
    if expert < 0:
        return
    slot = tl.load(sorted_slots + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = slot < slots
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a + (slot // rows_per_a).to(tl.int64)[:, None] * stride_at + k[None, :] * stride_ak
    w_ptrs = w + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None] * stride_wk  # [K, N]
    s_base = w_scale + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = k0 + k < k_dim
        a_tile = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_tile = _weight_tile(w_ptrs, w_mask, W_KIND, CT)
        if W_BLOCKS:
            scale = _scales(s_base, n, k0, n_ok, stride_sn, stride_sk, True, BN_W, BK_W, W_FACTOR)
            acc += tl.dot(a_tile, w_tile, input_precision=PRECISION) * scale[None, :]
        else:
            acc = tl.dot(a_tile, w_tile, acc=acc, input_precision=PRECISION)
        if GATED:
            up_tile = _weight_tile(w_ptrs + n_out * stride_wn, w_mask, W_KIND, CT)
            if W_BLOCKS:
                scale = _scales(s_base, n + n_out, k0, n_ok, stride_sn, stride_sk, True, BN_W, BK_W, W_FACTOR)
                acc_up += tl.dot(a_tile, up_tile, input_precision=PRECISION) * scale[None, :]
            else:
                acc_up = tl.dot(a_tile, up_tile, acc=acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if not W_BLOCKS:
        acc *= _scales(s_base, n, 0, n_ok, stride_sn, stride_sk, False, BN_W, BK_W, W_FACTOR)[None, :]
        if GATED:
            acc_up *= _scales(s_base, n + n_out, 0, n_ok, stride_sn, stride_sk, False, BN_W, BK_W, W_FACTOR)[None, :]
    if GATED:
        acc = act_and_mul(acc, acc_up, ACT)
    ptrs = out + slot.to(tl.int64)[:, None] * stride_out + n[None, :]
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=live[:, None] & n_ok[None, :])


@triton.jit
def _slot_gemv_fp8_kernel(
    out, a, w, w_scale, topk_ids, n_out, k_dim, rows_per_a, stride_at, stride_ak, stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk, stride_out, stride_it, stride_ik,
    TOP_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, W_KIND: tl.constexpr, W_BLOCKS: tl.constexpr,
    BN_W: tl.constexpr, BK_W: tl.constexpr, W_FACTOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``moe._slot_gemv_kernel`` with w[e] = FP8 weight * scales."""
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(topk_ids + (slot // TOP_K) * stride_it + (slot % TOP_K) * stride_ik)
    if expert < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < n_out
    a_ptrs = a + (slot // rows_per_a) * stride_at + k * stride_ak
    w_ptrs = w + expert * stride_we + n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk  # [N, K]
    s_base = w_scale + expert * stride_se
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = k0 + k < k_dim
        a_row = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        part = tl.sum(_weight_tile(w_ptrs, mask, W_KIND, tl.float32) * a_row, axis=1)
        if W_BLOCKS:
            part *= _scales(s_base, n, k0, n_ok, stride_sn, stride_sk, True, BN_W, BK_W, W_FACTOR)
        acc += part
        if GATED:
            part = tl.sum(_weight_tile(w_ptrs + n_out * stride_wn, mask, W_KIND, tl.float32) * a_row, axis=1)
            if W_BLOCKS:
                part *= _scales(s_base, n + n_out, k0, n_ok, stride_sn, stride_sk, True, BN_W, BK_W, W_FACTOR)
            acc_up += part
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if not W_BLOCKS:
        acc *= _scales(s_base, n, 0, n_ok, stride_sn, stride_sk, False, BN_W, BK_W, W_FACTOR)
        if GATED:
            acc_up *= _scales(s_base, n + n_out, 0, n_ok, stride_sn, stride_sk, False, BN_W, BK_W, W_FACTOR)
    if GATED:
        acc = act_and_mul(acc, acc_up, ACT)
    tl.store(out + slot * stride_out + n, acc.to(out.dtype.element_ty), mask=n_ok)


def _block_k(block_k: int, block_size: tuple[int, int] | None) -> int:
    """The largest BLOCK_K <= block_k that divides bk: every K tile inside one block column."""
    if block_size is not None:
        while block_size[1] % block_k:
            block_k //= 2
    return block_k


def _scale_strides(scale: torch.Tensor) -> tuple[int, int, int]:
    return scale.stride(0), scale.stride(1), scale.stride(2) if scale.dim() == 3 else 0


def _slot_experts(out, x, w13, s13, w2, s2, weight_args, topk_weights, topk_ids, activation):
    num_tokens, top_k = topk_ids.shape
    slots, (_, hidden, inter_size) = num_tokens * top_k, w2.shape
    block_size = weight_args["block_size"]
    consts = dict(W_KIND=weight_args["w_kind"], W_BLOCKS=block_size is not None, BN_W=weight_args["bn"],
                  BK_W=weight_args["bk"], W_FACTOR=weight_args["factor"])
    up, down = (dict(t, BLOCK_K=_block_k(t["BLOCK_K"], block_size)) for t in (SLOT_TILES[True], SLOT_TILES[False]))
    inter = torch.empty((slots, inter_size), dtype=x.dtype, device=x.device)
    _slot_gemv_fp8_kernel[(slots, triton.cdiv(inter_size, up["BLOCK_N"]))](
        inter, x, w13, s13, topk_ids, inter_size, hidden, top_k, *x.stride(), *w13.stride(), *_scale_strides(s13),
        inter.stride(0), *topk_ids.stride(), TOP_K=top_k, GATED=True, ACT=activation, **consts, **up)
    per_slot = torch.empty((slots, hidden), dtype=torch.float32, device=x.device)
    _slot_gemv_fp8_kernel[(slots, triton.cdiv(hidden, down["BLOCK_N"]))](
        per_slot, inter, w2, s2, topk_ids, hidden, inter_size, 1, *inter.stride(), *w2.stride(), *_scale_strides(s2),
        per_slot.stride(0), *topk_ids.stride(), TOP_K=top_k, GATED=False, ACT=activation, **consts, **down)
    return sum_slots(out, per_slot, topk_weights, topk_ids)


def _grouped_experts(out, x, w13, s13, w2, s2, weight_args, topk_weights, topk_ids, activation, config: GemmConfig):
    num_tokens, top_k = topk_ids.shape
    slots, (num_experts, hidden, inter_size) = num_tokens * top_k, w2.shape
    sorted_slots, block_expert = align(topk_ids, num_experts, config.block_m)
    blocks = block_expert.shape[0]
    block_size = weight_args["block_size"]
    tiles = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=_block_k(config.block_k, block_size),
                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ACT=activation, W_KIND=weight_args["w_kind"],
                 W_BLOCKS=block_size is not None, BN_W=weight_args["bn"], BK_W=weight_args["bk"],
                 W_FACTOR=weight_args["factor"], CT=TORCH_TO_TL[x.dtype], num_warps=config.num_warps,
                 num_stages=config.num_stages)
    inter = torch.empty((slots, inter_size), dtype=x.dtype, device=x.device)
    _grouped_gemm_fp8_kernel[(blocks, triton.cdiv(inter_size, config.block_n))](
        inter, x, w13, s13, sorted_slots, block_expert, slots, inter_size, hidden, top_k, *x.stride(), *w13.stride(),
        *_scale_strides(s13), inter.stride(0), GATED=True, **tiles)
    per_slot = torch.empty((slots, hidden), dtype=torch.float32, device=x.device)
    _grouped_gemm_fp8_kernel[(blocks, triton.cdiv(hidden, config.block_n))](
        per_slot, inter, w2, s2, sorted_slots, block_expert, slots, hidden, inter_size, 1, *inter.stride(),
        *w2.stride(), *_scale_strides(s2), per_slot.stride(0), GATED=False, **tiles)
    return sum_slots(out, per_slot, topk_weights, topk_ids)


def _check(w13, w13_scale, w2, w2_scale, block_size) -> None:
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fused_experts_fp8: w13 and w2 must be float8_e4m3fn, got {w13.dtype} and {w2.dtype}")
    for name, w, s in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
        e, n, k = w.shape
        want = (e, n) if block_size is None else (e, -(-n // block_size[0]), -(-k // block_size[1]))
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"fused_experts_fp8: {name} must be float32 {list(want)} for weights {list(w.shape)} with "
                             f"block_size {block_size}, got {s.dtype} {list(s.shape)}")
    if block_size is not None and block_size[1] % 16:
        raise ValueError(f"fused_experts_fp8: the Triton kernels need block columns of a multiple of 16, got "
                         f"block_size {block_size}")


def _fused_experts_fp8(x, w13, w13_scale, w2, w2_scale, block_size, topk_weights, topk_ids, activation, w_kind,
                       path, config):
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_experts_fp8: activation {activation!r} is not 'silu' or 'gelu'")
    block_size = tuple(block_size) if block_size is not None else None
    _check(w13, w13_scale, w2, w2_scale, block_size)
    num_tokens, top_k = topk_ids.shape
    out = torch.empty((num_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    bn, bk = block_size or (1, 1)
    weight_args = dict(w_kind=w_kind, block_size=block_size, bn=bn, bk=bk,
                       factor=FP8_BYTES_FACTOR if w_kind == "fp8_bytes" else 1.0)
    if w_kind == "fp8_bytes":
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    args = (out, x, w13, w13_scale, w2, w2_scale, weight_args, topk_weights, topk_ids, activation)
    num_experts = w13.shape[0]
    if (path or ("slots" if use_slot_path(num_tokens, top_k, num_experts) else "grouped")) == "slots":
        return _slot_experts(*args)
    return _grouped_experts(*args, config or grouped_config(num_tokens * top_k, num_experts, x.dtype))


def fused_experts_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, block_size: tuple[int, int] | None, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: str = "silu", path: str | None = None,
                      config: GemmConfig | None = None) -> torch.Tensor:
    """x [T, H]; w13 float8_e4m3fn [E, 2I, H]; w2 [E, H, I]; scales as the spec says -> [T, H] in x.dtype.
    ``path`` ("grouped" or "slots") and ``config`` override the choices by shape (tests, tuning)."""
    return _fused_experts_fp8(x, w13, w13_scale, w2, w2_scale, block_size, topk_weights, topk_ids, activation,
                              "fp8", path, config)


def fused_experts_fp8_bytes(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                            w2_scale: torch.Tensor, block_size: tuple[int, int] | None, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, activation: str = "silu", path: str | None = None,
                            config: GemmConfig | None = None) -> torch.Tensor:
    """``fused_experts_fp8`` for Triton targets without FP8 types: the weights' bytes decoded in registers."""
    return _fused_experts_fp8(x, w13, w13_scale, w2, w2_scale, block_size, topk_weights, topk_ids, activation,
                              "fp8_bytes", path, config)
