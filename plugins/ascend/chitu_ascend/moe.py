"""``moe_route`` and ``fused_experts`` of the op contract on torch_npu's MoE operators.

Routing: ``npu_moe_gating_top_k_softmax`` serves plain softmax top-k (Mixtral, Qwen-MoE); sigmoid scoring,
a correction bias and grouped top-k (DeepSeek-V2/V3) go to the core's reference, inside this op.

Experts: the token slots are sorted by expert id once (slots routed to no expert here, negative ids, sort
last and belong to no group), and two grouped matmuls run every expert's rows in one launch each, with the
SwiGLU between them. Nothing reads ids on the host: the group boundaries stay a device tensor.
"""

import torch

from chitu_core.ops import reference

Tensor = torch.Tensor


def moe_route(router_logits: Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
              correction_bias: Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
              group_score: str = "max", scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """``torch_npu.npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx, row_idx)``.

    Doc: torch_npu API reference, "torch_npu.npu_moe_gating_top_k_softmax" (Pytorch 6.0.0,
    ptaoplist_000856; CANN aclnnMoeGatingTopKSoftmax): x [T, E] float16/bfloat16/float32; y the k largest
    of softmax(x) over E in x's dtype, expert_idx their int32 expert ids, row_idx int32 (unused here);
    finished (bool [T]) marks rows that get expert id E (not used). The logits go in as float32, so the
    weights come out float32, as the contract asks; renormalization and scaling follow here."""
    if scoring != "softmax" or correction_bias is not None or num_groups > 1:
        return reference.moe_route(router_logits, top_k, scoring, renormalize, correction_bias, num_groups,
                                   topk_groups, group_score, scaling)
    import torch_npu

    weights, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(router_logits.float(), None, k=top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling, ids.long()


def _grouped(x: Tensor, weights: Tensor, group_ends: Tensor) -> Tensor:
    """``torch_npu.npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type)``.

    Doc: torch_npu API reference, "torch_npu.npu_grouped_matmul" (Pytorch 7.0.0, ptaoplist_000524): with
    one x tensor [M, K] (split_item=2: one output tensor), group_type=0 splits x along M; group_list is an
    int64 device tensor of cumulative row ends (group_list_type=0): group e is rows
    group_list[e-1]:group_list[e], multiplied by weight[e] [K, N] (a 3-D weight [E, K, N] holds them all).
    Rows past the last end belong to no group; the doc leaves them undefined, so the caller masks them.
    ``weights`` is a stack [E, N, K] (the contract's layout); its transpose view is the operator's [E, K, N]."""
    import torch_npu

    return torch_npu.npu_grouped_matmul([x], [weights.transpose(1, 2)], group_list=group_ends, split_item=2,
                                        group_type=0, group_list_type=0)[0]


def fused_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                  activation: str = "silu") -> Tensor:
    """Sort the slots by expert, ``_grouped`` gate/up, ``npu_swiglu`` (see ``chitu_ascend.ops.silu_and_mul``),
    ``_grouped`` down, then weight each slot's row and add it to its token in float32. GELU experts have no
    fused operator here and run the reference."""
    if activation != "silu":
        return reference.fused_experts(x, w13, w2, topk_weights, topk_ids, activation)
    import torch_npu

    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)  # slots of no expert here sort last, in no group
    order = key.argsort(stable=True)
    group_ends = torch.bincount(key, minlength=num_experts + 1)[:num_experts].cumsum(0)
    rows = x.index_select(0, order // top_k)  # [T * k, H], grouped by expert
    hidden = torch_npu.npu_swiglu(_grouped(rows, w13, group_ends), dim=-1)  # [T * k, I] in x.dtype
    down = _grouped(hidden, w2, group_ends).float()  # [T * k, H]
    valid = (flat >= 0).index_select(0, order)
    slot_weights = torch.where(valid, topk_weights.reshape(-1).index_select(0, order).float(), 0.0)
    down = torch.where(valid[:, None], down, 0.0) * slot_weights[:, None]
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, order // top_k, down).to(x.dtype)
