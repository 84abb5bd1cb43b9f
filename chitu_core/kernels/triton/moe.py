"""moe_route and fused_experts of the op contract (``chitu_core.ops.spec``) as Triton kernels.

moe_route: one program per token row (``_route_kernel``) holds the row's E logits as a
[groups, experts per group] tile: softmax or sigmoid in float32, the correction bias, group scores
(max, or the sum of the two largest) and the best topk_groups groups, then top_k rounds of "take
the largest choice" (the lowest expert id among exact ties), renormalised and scaled. One launch.

fused_experts, two paths, both without host synchronisation (every size and grid comes from T,
top_k, E, H, I and the block sizes, so a device graph can capture them):

* grouped (``_grouped_gemm_kernel``): ``moe_align.align`` sorts the T * top_k token slots by expert
  and pads each expert's run to a multiple of BLOCK_M; a program computes BLOCK_M rows of one
  expert, so each weight tile is loaded once for up to BLOCK_M slots. The gate/up GEMM applies
  act(gate) * up in its epilogue and stores the intermediate [S, I] in x.dtype (the contract's
  rounding); the down GEMM stores each slot's output [S, H] in float32; ``_sum_slots_kernel`` then
  weights and sums each token's k slots in order: deterministic, no atomics.
* per slot (``_slot_gemv_kernel``), for decode: while experts are rarely shared (``use_slot_path``), a
  program multiplies one slot's row by its expert's weights as a matrix-vector product, with no
  alignment pass; the same two GEMMs and the same sum, three launches in all.

Slots with a negative id are skipped (never computed, never summed). Block sizes: ``grouped_config``.
Both kernels read the weights as ``ExpertWeights`` says: the model dtype, or 8-bit with block or
channel scales (``moe_fp8``, contract 1.3).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.activation import act_and_mul
from chitu_core.kernels.triton.common import pow2
from chitu_core.kernels.triton.moe_align import align
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_options
from chitu_core.kernels.triton.quant_matmul import TORCH_TO_TL, weight_tile

ACTIVATIONS = ("silu", "gelu")

# ----- moe_route -----


@triton.jit
def _route_kernel(out_weights, out_ids, logits, bias, stride_t, stride_e, stride_b, num_groups, group_size, scaling,
                  TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                  GROUPS_P: tl.constexpr, GROUP_P: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                  TOP2_SUM: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    gdc_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, GROUPS_P)
    member = tl.arange(0, GROUP_P)
    expert = group[:, None] * group_size + member[None, :]  # [GROUPS_P, GROUP_P]
    valid = (group[:, None] < num_groups) & (member[None, :] < group_size)
    x = tl.load(logits + row * stride_t + expert * stride_e, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.where(valid, tl.sigmoid(x), 0.0)
    else:
        p = tl.where(valid, tl.exp(x - tl.max(tl.max(x, axis=1), axis=0)), 0.0)
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias + expert * stride_b, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPS_P > 1:
        best = tl.max(choice, axis=1)
        if TOP2_SUM:
            first = tl.min(tl.where(choice == best[:, None], member[None, :], GROUP_P), axis=1)
            best += tl.max(tl.where(member[None, :] == first[:, None], float("-inf"), choice), axis=1)
        best = tl.where(group < num_groups, best, float("-inf"))
        keep = group < 0
        for _ in tl.static_range(TOPK_GROUPS):
            pick = tl.min(tl.where(best == tl.max(best, axis=0), group, GROUPS_P), axis=0)
            keep |= group == pick
            best = tl.where(group == pick, float("-inf"), best)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    slot = tl.arange(0, TOP_K_P)
    weights = tl.zeros((TOP_K_P,), dtype=tl.float32)
    ids = tl.zeros((TOP_K_P,), dtype=tl.int64)
    for i in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, 2147483647), axis=1), axis=0)
        chosen = expert == pick
        weights = tl.where(slot == i, tl.sum(tl.sum(tl.where(chosen, scores, 0.0), axis=1), axis=0), weights)
        ids = tl.where(slot == i, pick.to(tl.int64), ids)
        choice = tl.where(chosen, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(out_weights + row * TOP_K + slot, weights * scaling, mask=slot < TOP_K)
    tl.store(out_ids + row * TOP_K + slot, ids, mask=slot < TOP_K)


def moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
              correction_bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
              group_score: str = "max", scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any strides) -> (weights float32 [T, top_k], ids int64 [T, top_k])."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_route: scoring {scoring!r} is not 'softmax' or 'sigmoid'")
    if group_score not in ("max", "top2_sum"):
        raise ValueError(f"moe_route: group_score {group_score!r} is not 'max' or 'top2_sum'")
    num_tokens, num_experts = router_logits.shape
    if num_experts % num_groups:
        raise ValueError(f"moe_route: {num_experts} experts do not split into {num_groups} equal groups")
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    group_size = num_experts // num_groups
    grouped = num_groups > 1
    bias = correction_bias if correction_bias is not None else weights  # an unread stand-in
    _route_kernel[(num_tokens,)](
        weights, ids, router_logits, bias, router_logits.stride(0), router_logits.stride(1), bias.stride(0), num_groups,
        group_size, float(scaling), TOP_K=top_k, TOP_K_P=pow2(top_k), SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None, GROUPS_P=pow2(num_groups) if grouped else 1,
        GROUP_P=pow2(group_size), TOPK_GROUPS=topk_groups if grouped else 1, TOP2_SUM=group_score == "top2_sum",
        RENORMALIZE=renormalize, num_warps=4 if num_experts > 256 else 2 if num_experts > 64 else 1,
        **pdl_options(router_logits.device))
    return weights, ids


# ----- fused_experts -----


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of the grouped GEMMs: BLOCK_M slots (the alignment's padding unit), BLOCK_N outputs,
    BLOCK_K of the reduction per step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def grouped_config(slots: int, num_experts: int, dtype: torch.dtype) -> GemmConfig:
    """Tiles by the mean number of slots per expert: small BLOCK_M when experts get a few rows each
    (decode batches), larger tiles for prefill. float32 operands take half the BLOCK_K."""
    rows = slots / num_experts
    block_k = 32 if dtype == torch.float32 else 64
    if rows <= 16:
        return GemmConfig(16, 64, block_k)
    if rows <= 64:
        return GemmConfig(32, 64, block_k)
    return GemmConfig(64, 128, block_k, num_warps=8 if dtype != torch.float32 else 4)


def use_slot_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Per-slot matrix-vector products while slots rarely share an expert (one token's slots never
    do): about one pair of T * top_k slots in E / 4 shares one when T * top_k <= E / 4."""
    return num_tokens == 1 or num_tokens * top_k <= num_experts // 4


@triton.jit
def _scales(base, n, k0, n_ok, stride_sn, stride_sk, SCALES: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr,
            W_FACTOR: tl.constexpr):
    """The scales of output rows n: of the [BN_W, BK_W] block column holding K offset k0 ("block"), or per
    output channel ("channel")."""
    if SCALES == "block":
        s = tl.load(base + (n // BN_W) * stride_sn + (k0 // BK_W) * stride_sk, mask=n_ok, other=0.0)
    else:
        s = tl.load(base + n * stride_sn, mask=n_ok, other=0.0)
    return s * W_FACTOR


@triton.jit(do_not_specialize=["slots"])
def _grouped_gemm_kernel(
    out, a, w, w_scale, sorted_slots, block_expert, slots, n_out, k_dim, rows_per_a,
    stride_at, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_out,
    GATED: tl.constexpr, ACT: tl.constexpr, W_KIND: tl.constexpr, SCALES: tl.constexpr, BN_W: tl.constexpr,
    BK_W: tl.constexpr, W_FACTOR: tl.constexpr, CT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[slot, n] = sum_k a[slot // rows_per_a, k] * W[e, n, k] for the BLOCK_M slots of one block of
    expert e; GATED: act(gate) * up of the rows n and n + n_out of W (the gate/up GEMM). W is w itself
    (W_KIND "float", SCALES "none") or an 8-bit w times its scales: per block column, applied to each K
    tile's product (BLOCK_K divides BK_W), or per channel, applied after the K loop."""
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
        w_tile = weight_tile(w_ptrs, w_mask, W_KIND, CT)
        if SCALES == "block":
            scale = _scales(s_base, n, k0, n_ok, stride_sn, stride_sk, SCALES, BN_W, BK_W, W_FACTOR)
            acc += tl.dot(a_tile, w_tile, input_precision=PRECISION) * scale[None, :]
        else:
            acc = tl.dot(a_tile, w_tile, acc=acc, input_precision=PRECISION)
        if GATED:
            up_tile = weight_tile(w_ptrs + n_out * stride_wn, w_mask, W_KIND, CT)
            if SCALES == "block":
                scale = _scales(s_base, n + n_out, k0, n_ok, stride_sn, stride_sk, SCALES, BN_W, BK_W, W_FACTOR)
                acc_up += tl.dot(a_tile, up_tile, input_precision=PRECISION) * scale[None, :]
            else:
                acc_up = tl.dot(a_tile, up_tile, acc=acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if SCALES == "channel":
        acc *= _scales(s_base, n, 0, n_ok, stride_sn, stride_sk, SCALES, BN_W, BK_W, W_FACTOR)[None, :]
        if GATED:
            acc_up *= _scales(s_base, n + n_out, 0, n_ok, stride_sn, stride_sk, SCALES, BN_W, BK_W, W_FACTOR)[None, :]
    if GATED:
        acc = act_and_mul(acc, acc_up, ACT)
    ptrs = out + slot.to(tl.int64)[:, None] * stride_out + n[None, :]
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=live[:, None] & n_ok[None, :])


@triton.jit
def _sum_slots_kernel(out, per_slot, topk_weights, topk_ids, hidden, stride_out, stride_wt, stride_wk,
                      stride_it, stride_ik, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    gdc_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if tl.load(topk_ids + token * stride_it + j * stride_ik) >= 0:
            weight = tl.load(topk_weights + token * stride_wt + j * stride_wk).to(tl.float32)
            acc += weight * tl.load(per_slot + (token * TOP_K + j) * hidden + cols, mask=cols < hidden, other=0.0)
    tl.store(out + token * stride_out + cols, acc.to(out.dtype.element_ty), mask=cols < hidden)


@triton.jit
def _slot_gemv_kernel(
    out, a, w, w_scale, topk_ids, n_out, k_dim, rows_per_a, stride_at, stride_ak, stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk, stride_out, stride_it, stride_ik,
    TOP_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, W_KIND: tl.constexpr, SCALES: tl.constexpr,
    BN_W: tl.constexpr, BK_W: tl.constexpr, W_FACTOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[slot, n] = sum_k a[slot // rows_per_a, k] * W[e, n, k], e the slot's expert, as a matrix-vector
    product in float32 registers; GATED, W and its scales as in ``_grouped_gemm_kernel``."""
    gdc_enter(PDL)
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
        part = tl.sum(weight_tile(w_ptrs, mask, W_KIND, tl.float32) * a_row, axis=1)
        if SCALES == "block":
            part *= _scales(s_base, n, k0, n_ok, stride_sn, stride_sk, SCALES, BN_W, BK_W, W_FACTOR)
        acc += part
        if GATED:
            part = tl.sum(weight_tile(w_ptrs + n_out * stride_wn, mask, W_KIND, tl.float32) * a_row, axis=1)
            if SCALES == "block":
                part *= _scales(s_base, n + n_out, k0, n_ok, stride_sn, stride_sk, SCALES, BN_W, BK_W, W_FACTOR)
            acc_up += part
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if SCALES == "channel":
        acc *= _scales(s_base, n, 0, n_ok, stride_sn, stride_sk, SCALES, BN_W, BK_W, W_FACTOR)
        if GATED:
            acc_up *= _scales(s_base, n + n_out, 0, n_ok, stride_sn, stride_sk, SCALES, BN_W, BK_W, W_FACTOR)
    if GATED:
        acc = act_and_mul(acc, acc_up, ACT)
    tl.store(out + slot * stride_out + n, acc.to(out.dtype.element_ty), mask=n_ok)


def sum_slots(out, per_slot, topk_weights, topk_ids):
    """out [T, H] = each token's float32 per-slot rows [T * k, H] weighted and summed in slot order (negative ids
    skipped)."""
    num_tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    block = min(pow2(hidden), 1024)
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, block))](
        out, per_slot, topk_weights, topk_ids, hidden, out.stride(0), *topk_weights.stride(), *topk_ids.stride(),
        TOP_K=top_k, BLOCK=block, num_warps=4, **pdl_options(out.device))
    return out


SLOT_TILES = {True: dict(BLOCK_N=8, BLOCK_K=128, num_warps=8), False: dict(BLOCK_N=16, BLOCK_K=128, num_warps=8)}
"""Tiles of the per-slot kernel, gate/up (True) and down (False). Swept on an H200 at batch-1 shapes
(plugins/nvidia/scripts/moe_gemv_sweep.py): few rows a program and 8 warps keep enough loads in
flight; DeepSeek-V2-Lite gate/up 53 -> 20 us (31% -> 81% of copy bandwidth), down 17 -> 8 us; Qwen3-30B-A3B
gate/up 52 -> ~14 us; Mixtral-8x7B down 206 -> ~59 us."""


@dataclass(frozen=True)
class ExpertWeights:
    """How the kernels read the expert weights: ``w_kind`` "float" (the model dtype, no scales), "fp8",
    "fp8_bytes" or "int8" (``quant_matmul.weight_tile``); ``scales`` "none", "block" ([bn, bk] blocks)
    or "channel"; ``factor`` multiplies every scale (``fp8_bytes``' 256)."""

    w_kind: str = "float"
    scales: str = "none"
    bn: int = 1
    bk: int = 1
    factor: float = 1.0

    def block_k(self, block_k: int) -> int:
        """The largest BLOCK_K <= block_k dividing bk (every K tile inside one block column)."""
        while self.scales == "block" and self.bk % block_k:
            block_k //= 2
        return block_k

    def consts(self) -> dict:
        return dict(W_KIND=self.w_kind, SCALES=self.scales, BN_W=self.bn, BK_W=self.bk, W_FACTOR=self.factor)


def _scale_strides(scale: torch.Tensor | None) -> tuple[int, int, int]:
    if scale is None:
        return 0, 0, 0
    return scale.stride(0), scale.stride(1), scale.stride(2) if scale.dim() == 3 else 0


def slot_experts(out, x, w13, s13, w2, s2, weights: ExpertWeights, topk_weights, topk_ids, activation):
    """The per-slot path: gate/up matrix-vector products, down, the ordered sum (s13, s2: scales or None)."""
    num_tokens, top_k = topk_ids.shape
    slots, (_, hidden, inter_size) = num_tokens * top_k, w2.shape
    up, down = (dict(t, BLOCK_K=weights.block_k(t["BLOCK_K"])) for t in (SLOT_TILES[True], SLOT_TILES[False]))
    inter = torch.empty((slots, inter_size), dtype=x.dtype, device=x.device)
    _slot_gemv_kernel[(slots, triton.cdiv(inter_size, up["BLOCK_N"]))](
        inter, x, w13, s13 if s13 is not None else x, topk_ids, inter_size, hidden, top_k, *x.stride(),
        *w13.stride(), *_scale_strides(s13), inter.stride(0), *topk_ids.stride(), TOP_K=top_k, GATED=True,
        ACT=activation, **weights.consts(), **up, **pdl_options(x.device))
    per_slot = torch.empty((slots, hidden), dtype=torch.float32, device=x.device)
    _slot_gemv_kernel[(slots, triton.cdiv(hidden, down["BLOCK_N"]))](
        per_slot, inter, w2, s2 if s2 is not None else x, topk_ids, hidden, inter_size, 1, *inter.stride(),
        *w2.stride(), *_scale_strides(s2), per_slot.stride(0), *topk_ids.stride(), TOP_K=top_k, GATED=False,
        ACT=activation, **weights.consts(), **down, **pdl_options(x.device))
    return sum_slots(out, per_slot, topk_weights, topk_ids)


def grouped_experts(out, x, w13, s13, w2, s2, weights: ExpertWeights, topk_weights, topk_ids, activation,
                    config: GemmConfig):
    """The grouped path: slots sorted by expert, gate/up GEMM, down GEMM, the ordered sum."""
    num_tokens, top_k = topk_ids.shape
    slots, (num_experts, hidden, inter_size) = num_tokens * top_k, w2.shape
    sorted_slots, block_expert = align(topk_ids, num_experts, config.block_m)
    blocks = block_expert.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # ignored for 16-bit operands
    tiles = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=weights.block_k(config.block_k),
                 PRECISION=precision, ACT=activation, CT=TORCH_TO_TL[x.dtype], num_warps=config.num_warps,
                 num_stages=config.num_stages, **weights.consts())
    inter = torch.empty((slots, inter_size), dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(blocks, triton.cdiv(inter_size, config.block_n))](
        inter, x, w13, s13 if s13 is not None else x, sorted_slots, block_expert, slots, inter_size, hidden, top_k,
        *x.stride(), *w13.stride(), *_scale_strides(s13), inter.stride(0), GATED=True, **tiles)
    per_slot = torch.empty((slots, hidden), dtype=torch.float32, device=x.device)
    _grouped_gemm_kernel[(blocks, triton.cdiv(hidden, config.block_n))](
        per_slot, inter, w2, s2 if s2 is not None else x, sorted_slots, block_expert, slots, hidden, inter_size, 1,
        *inter.stride(), *w2.stride(), *_scale_strides(s2), per_slot.stride(0), GATED=False, **tiles)
    return sum_slots(out, per_slot, topk_weights, topk_ids)


def run_experts(x, w13, s13, w2, s2, weights: ExpertWeights, topk_weights, topk_ids, activation, path, config):
    """Either path, chosen by shape unless ``path`` names one; ``fused_experts`` and ``moe_fp8``'s entry."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_experts: activation {activation!r} is not 'silu' or 'gelu'")
    num_tokens, top_k = topk_ids.shape
    out = torch.empty((num_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_experts = w13.shape[0]
    args = (out, x, w13, s13, w2, s2, weights, topk_weights, topk_ids, activation)
    if (path or ("slots" if use_slot_path(num_tokens, top_k, num_experts) else "grouped")) == "slots":
        return slot_experts(*args)
    return grouped_experts(*args, config or grouped_config(num_tokens * top_k, num_experts, x.dtype))


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", path: str | None = None,
                  config: GemmConfig | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights, topk_ids [T, k] (any strides) -> [T, H] in
    x.dtype. ``path`` ("grouped" or "slots") and ``config`` override the choices by shape (tests, tuning)."""
    if not x.dtype == w13.dtype == w2.dtype:
        raise ValueError(f"fused_experts: x, w13 and w2 must share a dtype (got {x.dtype}, {w13.dtype}, "
                         f"{w2.dtype}); quantized experts go through a quantization method")
    return run_experts(x, w13, None, w2, None, ExpertWeights(), topk_weights, topk_ids, activation, path, config)
