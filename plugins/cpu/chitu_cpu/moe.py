"""``fused_experts`` of the op contract (``chitu_core.ops.spec``) on the CPU.

The token slots are grouped by expert (a stable sort of the flattened ids) and their rows gathered
once; each expert that some slot chose runs its two GEMMs on its contiguous slice of rows, reading
its weights once, in place (a batched matmul over each slot's gathered weight matrices would copy
them first). The activation is computed in
float32 and rounded once; the slots' outputs are weighted and summed into their tokens' rows in
float32. Nothing loops over tokens. ``moe_route`` is the reference's (``chitu_cpu.ops``).
"""

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def fused_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                  activation: str = "silu") -> Tensor:
    if activation not in ("silu", "gelu"):
        raise ValueError(f"fused_experts: activation {activation!r} is not 'silu' or 'gelu'")
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    flat = topk_ids.reshape(-1)
    # Slots routed to no expert here sort last, under the key num_experts, and are never computed.
    key = torch.where(flat >= 0, flat, num_experts)
    order = key.argsort(stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts].tolist()
    slots = order[: sum(counts)]
    rows = x.index_select(0, slots // top_k)  # [slots computed here, H], grouped by expert
    out_rows = torch.empty((rows.shape[0], w2.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            gate, up = F.linear(rows[start:end], w13[expert]).float().split(inter, dim=-1)
            act = (F.silu(gate) if activation == "silu" else F.gelu(gate)).mul_(up)  # rounded once, below
            out_rows[start:end] = F.linear(act.to(x.dtype), w2[expert])
            start = end
    weighted = out_rows.float().mul_(topk_weights.reshape(-1).float().index_select(0, slots)[:, None])
    out = torch.zeros((num_tokens, w2.shape[1]), dtype=torch.float32, device=x.device)
    return out.index_add_(0, slots // top_k, weighted).to(x.dtype)
