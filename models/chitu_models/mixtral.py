"""Mixtral: Mistral's decoder with a sparse MoE block (softmax top-k, renormalised) in every layer.

``SparseMoeBlock`` is the MLP of a sparse layer for the softmax-routed families: the router, the
routed experts (``FusedMoE``), and optionally a shared expert gated by a sigmoid (Qwen2-MoE, see
qwen_moe.py).
"""

import torch
from torch import nn

from chitu_core.layers import BuildContext, FusedMoE, Router, map_expert_weight
from chitu_core.layers.moe import MIXTRAL_PARTS
from chitu_models.llama import CONFORMANCE_SIZES, DecoderMLP, MistralForCausalLM

EXPERT_ACTIVATIONS = {"silu": "silu", "gelu": "gelu"}  # hidden_act -> fused_experts' activation


class SparseMoeBlock(nn.Module):
    """forward(x [T, H]) -> experts(x) (+ sigmoid(shared_expert_gate(x)) * shared_expert(x)), summed over ranks.

    The router runs in the model dtype, as transformers' does; routing itself (softmax over all
    experts, top-k, optional renormalisation) is ``ops.moe_route`` in float32.
    """

    def __init__(self, config, ctx: BuildContext, num_experts: int, expert_size: int, renormalize: bool,
                 shared_expert_size: int = 0, layer_idx: int | None = None):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in EXPERT_ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported for MoE experts; supported: {', '.join(EXPERT_ACTIVATIONS)}")
        self.gate = Router(config.hidden_size, num_experts, ctx)
        self.experts = FusedMoE(num_experts, config.hidden_size, expert_size, ctx, config.num_experts_per_tok,
                                renormalize=renormalize, activation=EXPERT_ACTIVATIONS[act], layer_idx=layer_idx)
        # Unsummed: FusedMoE adds it to its own partial output before its one all-reduce.
        self.shared_expert = DecoderMLP(config, ctx, shared_expert_size).defer_reduce() if shared_expert_size else None
        self.shared_expert_gate = Router(config.hidden_size, 1, ctx) if shared_expert_size else None

    def defer_reduce(self) -> None:
        """Return this rank's partial output, unsummed (see ``FusedMoE.reduce``)."""
        self.experts.reduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return self.experts(x, self.gate(x))
        return self.experts(x, self.gate(x), lambda: torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x))


class MixtralForCausalLM(MistralForCausalLM):
    @classmethod
    def build_mlp(cls, config, layer_idx: int, ctx: BuildContext) -> nn.Module:
        return SparseMoeBlock(config, ctx, config.num_local_experts, config.intermediate_size, renormalize=True,
                              layer_idx=layer_idx)

    def map_weight_name(self, name: str) -> tuple[str, object]:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the layer's MLP
        return map_expert_weight(name, MIXTRAL_PARTS) or super().map_weight_name(name)

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Mixtral config (4 experts, top-2) for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="mixtral", intermediate_size=128, num_local_experts=4,
                    num_experts_per_tok=2)
