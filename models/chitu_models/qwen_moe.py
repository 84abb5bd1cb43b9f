"""Qwen2-MoE (qkv bias, a sigmoid-gated shared expert) and Qwen3-MoE (q/k norm, no shared expert).

Layer i is sparse unless it is in ``mlp_only_layers`` or (i + 1) is not a multiple of
``decoder_sparse_step``; a dense layer has the Llama MLP of ``intermediate_size``.
"""

from torch import nn

from chitu_core.layers import BuildContext, map_expert_weight
from chitu_models.llama import CONFORMANCE_SIZES, DecoderMLP, LlamaForCausalLM
from chitu_models.mixtral import SparseMoeBlock
from chitu_models.qwen import Qwen3ForCausalLM


def is_sparse(config, layer_idx: int) -> bool:
    return (layer_idx not in (config.mlp_only_layers or ()) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config) -> dict:
        return {"qkv_bias": getattr(config, "qkv_bias", True), "o_bias": False, "qk_norm": False}

    @classmethod
    def build_mlp(cls, config, layer_idx: int, ctx: BuildContext) -> nn.Module:
        if not is_sparse(config, layer_idx):
            return DecoderMLP(config, ctx)
        return SparseMoeBlock(config, ctx, config.num_experts, config.moe_intermediate_size, config.norm_topk_prob,
                              shared_expert_size=config.shared_expert_intermediate_size, layer_idx=layer_idx)

    def map_weight_name(self, name: str) -> tuple[str, object]:
        return map_expert_weight(name) or super().map_weight_name(name)

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Qwen2-MoE config (4 experts, top-2, a shared expert; layer 0 dense) for the model
        conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="qwen2_moe", moe_intermediate_size=128, num_experts=4,
                    num_experts_per_tok=2, shared_expert_intermediate_size=256, mlp_only_layers=[0])


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def build_mlp(cls, config, layer_idx: int, ctx: BuildContext) -> nn.Module:
        if not is_sparse(config, layer_idx):
            return DecoderMLP(config, ctx)
        return SparseMoeBlock(config, ctx, config.num_experts, config.moe_intermediate_size, config.norm_topk_prob,
                              layer_idx=layer_idx)

    def map_weight_name(self, name: str) -> tuple[str, object]:
        return map_expert_weight(name) or super().map_weight_name(name)

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Qwen3-MoE config (q/k norm; layer 0 dense, layer 1 4 experts, top-2,
        renormalised) for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="qwen3_moe", head_dim=32, moe_intermediate_size=128, num_experts=4,
                    num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2)
