"""``fused_experts`` and ``fused_experts_fp8`` of the op contract (``chitu_core.ops.spec``) on the CPU.

The token slots are grouped by expert (a stable sort of the flattened ids) and their rows gathered
once; each expert that some slot chose runs its two GEMMs on its contiguous slice of rows, reading
its weights once, in place (a batched matmul over each slot's gathered weight matrices would copy
them first). The activation is computed in float32 and rounded once; the slots' outputs are weighted
and summed into their tokens' rows in float32. Nothing loops over tokens. FP8 experts are dequantized
to float32 one expert at a time, as the loop reaches them (never the whole stack: DeepSeek-V2-Lite's
would be 1.5 GB a layer), and multiplied in float32. ``moe_route`` is the reference's (``chitu_cpu.ops``).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from chitu_core.ops.quant_reference import dequantize_fp8

Tensor = torch.Tensor


def _by_expert(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, num_experts: int, hidden: int,
               activation: str, gate_up: Callable[[Tensor, int], Tensor],
               down: Callable[[Tensor, int], Tensor]) -> Tensor:
    """The experts' weighted sum, ``gate_up(rows, e)`` -> [r, 2I] and ``down(act, e)`` -> [r, H] being
    one expert's two products."""
    if activation not in ("silu", "gelu"):
        raise ValueError(f"fused_experts: activation {activation!r} is not 'silu' or 'gelu'")
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    # Slots routed to no expert here sort last, under the key num_experts, and are never computed.
    key = torch.where(flat >= 0, flat, num_experts)
    order = key.argsort(stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts].tolist()
    slots = order[: sum(counts)]
    rows = x.index_select(0, slots // top_k)  # [slots computed here, H], grouped by expert
    out_rows = torch.empty((rows.shape[0], hidden), dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            gate, up = gate_up(rows[start:end], expert).float().chunk(2, dim=-1)
            act = (F.silu(gate) if activation == "silu" else F.gelu(gate)).mul_(up)  # rounded once, below
            out_rows[start:end] = down(act.to(x.dtype), expert)
            start = end
    weighted = out_rows.float().mul_(topk_weights.reshape(-1).float().index_select(0, slots)[:, None])
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    return out.index_add_(0, slots // top_k, weighted).to(x.dtype)


def fused_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                  activation: str = "silu") -> Tensor:
    return _by_expert(x, topk_weights, topk_ids, w13.shape[0], w2.shape[1], activation,
                      lambda rows, e: F.linear(rows, w13[e]), lambda act, e: F.linear(act, w2[e]))


def fused_experts_fp8(x: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
                      block_size: tuple[int, int] | None, topk_weights: Tensor, topk_ids: Tensor,
                      activation: str = "silu") -> Tensor:
    def gate_up(rows: Tensor, e: int) -> Tensor:
        return F.linear(rows.float(), dequantize_fp8(w13[e], w13_scale[e], block_size))

    def down(act: Tensor, e: int) -> Tensor:
        return F.linear(act.float(), dequantize_fp8(w2[e], w2_scale[e], block_size))

    return _by_expert(x, topk_weights, topk_ids, w13.shape[0], w2.shape[1], activation, gate_up, down)
