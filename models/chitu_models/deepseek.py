"""DeepSeek-V2 (and V2-Lite) and DeepSeek-V3: multi-head latent attention, then a dense MLP in the first
``first_k_dense_replace`` layers and a mixture of experts (routed plus shared) in every
``moe_layer_freq``-th layer after.

Routing, as each family's reference code and transformers compute it (router logits in float32):
  V2: softmax over experts; topk_method "greedy", or "group_limited_greedy" (n_group groups scored by
      their best expert, the topk_group best kept); the top-k weights are renormalised where
      norm_topk_prob (and top_k > 1), else multiplied by routed_scaling_factor.
  V3: sigmoid, plus e_score_correction_bias for the choice only; groups scored by the sum of their
      two best experts; weights renormalised where norm_topk_prob, then times routed_scaling_factor.
Shared experts (n_shared_experts * moe_intermediate_size wide) are a gated MLP added to the routed sum.

RoPE: q_pe and k_pe rotate in interleaved pairs (2i, 2i+1), as the checkpoints are laid out (V2
always; V3 unless its config sets rope_interleave false, which rotates halves, i with i + R/2, as
transformers does). With YaRN scaling, the softmax scale is qk_head_dim**-0.5 times
yarn_mscale(factor, mscale_all_dim)**2.

Loading ends with ``CausalLM.process_weights_after_loading``, which has each MLA layer split its
kv_b_proj into the absorbed per-head matrices (see chitu_core/layers/mla.py).
"""

import re

import torch
from torch import nn

from chitu_core.layers import (
    BuildContext,
    FusedMoE,
    MultiHeadLatentAttention,
    Router,
    RotaryEmbedding,
    map_expert_weight,
    rope_config,
)
from chitu_core.layers.rotary import RopeConfig, yarn_mscale
from chitu_core.layers.stage import build_lm_head
from chitu_core.model import CausalLM, KVGeometry
from chitu_models.llama import CONFORMANCE_SIZES, DecoderLayer, DecoderMLP, DecoderModel, overrides_both
from chitu_models.mixtral import EXPERT_ACTIVATIONS

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def softmax_scale(config, rope: RopeConfig) -> float:
    """qk_head_dim**-0.5, times YaRN's mscale(factor, mscale_all_dim)**2 where the config sets
    mscale_all_dim (transformers' yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    mscale_all_dim = rope.params.get("mscale_all_dim")
    if rope.rope_type != "default" and mscale_all_dim:
        scale *= yarn_mscale(rope.params["factor"], mscale_all_dim) ** 2
    return scale


def is_moe_layer(config, layer_idx: int) -> bool:
    return (bool(getattr(config, "n_routed_experts", None)) and layer_idx >= config.first_k_dense_replace
            and layer_idx % (getattr(config, "moe_layer_freq", None) or 1) == 0)


class DeepseekMoE(nn.Module):
    """forward(x [T, H]) -> routed experts(x) + shared experts(x), summed over ranks."""

    def __init__(self, config, ctx: BuildContext, routing: dict, layer_idx: int | None = None):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in EXPERT_ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported for MoE experts; supported: {', '.join(EXPERT_ACTIVATIONS)}")
        experts, inter = config.n_routed_experts, config.moe_intermediate_size
        self.gate = Router(config.hidden_size, experts, ctx, logits_dtype=torch.float32)
        self.experts = FusedMoE(experts, config.hidden_size, inter, ctx, config.num_experts_per_tok,
                                activation=EXPERT_ACTIVATIONS[act], layer_idx=layer_idx, **routing)
        shared = getattr(config, "n_shared_experts", None) or 0
        # Unsummed: FusedMoE adds them to its own partial output before its one all-reduce.
        self.shared_experts = DecoderMLP(config, ctx, inter * shared).defer_reduce() if shared else None

    def defer_reduce(self) -> None:
        """Return this rank's partial output, unsummed (see ``FusedMoE.reduce``)."""
        self.experts.reduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts
        return self.experts(x, self.gate(x), None if shared is None else lambda: shared(x))

    def fuses(self) -> bool:
        """Whether ``forward_fused`` may serve (``DecoderLayer``): the shared experts take the fusions."""
        return self.shared_experts is not None and self.shared_experts.fuses() and overrides_both(self, DeepseekMoE)

    def forward_fused(self, stream: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """The residual stream after this sublayer: the routed experts of norm(stream), plus the shared
        experts' fused path (``DecoderMLP.forward_fused``: the norm in their gate/up product's prologue,
        the activation in its epilogue, ``stream`` added in the down product's), so that no add of the
        residual is left for the next layer."""
        x, shared = norm(stream), self.shared_experts
        return self.experts(x, self.gate(x), lambda: shared.forward_fused(stream, norm))


class DeepseekV2ForCausalLM(CausalLM):
    contract_version = "1.1"
    stacked_params = ((".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1))
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config, ctx: BuildContext):
        super().__init__()
        self.num_layers = config.num_hidden_layers
        rope, routing = rope_config(config), self.routing(config)
        rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings, rope, ctx,
                                 is_neox=not self.interleaved_rope(config))
        scale = softmax_scale(config, rope)

        def layer(i: int) -> DecoderLayer:
            mlp = DeepseekMoE(config, ctx, routing, i) if is_moe_layer(config, i) else DecoderMLP(config, ctx)
            return DecoderLayer(config, MultiHeadLatentAttention(config, i, rotary, scale, ctx), mlp, ctx)

        self.model = DecoderModel(config, ctx, rotary, layer)
        self.lm_head = build_lm_head(config, ctx, self.model.embed_tokens)

    @classmethod
    def routing(cls, config) -> dict:
        """FusedMoE's routing arguments (ops.moe_route's) for this config."""
        method = getattr(config, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported; supported: greedy, group_limited_greedy")
        grouped = method == "group_limited_greedy"
        renormalize = bool(getattr(config, "norm_topk_prob", False)) and config.num_experts_per_tok > 1
        return dict(scoring="softmax", renormalize=renormalize, num_groups=config.n_group if grouped else 1,
                    topk_groups=config.topk_group if grouped else 1, group_score="max",
                    scaling=1.0 if renormalize else config.routed_scaling_factor)

    @classmethod
    def interleaved_rope(cls, config) -> bool:
        return True

    @classmethod
    def kv_geometry(cls, config, tp_size: int) -> KVGeometry:
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        return KVGeometry(config.num_hidden_layers, config.num_attention_heads // tp_size, 1, latent,
                          kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim)

    @classmethod
    def max_model_len(cls, config) -> int:
        return rope_config(config).max_positions(config.max_position_embeddings)

    def map_weight_name(self, name: str) -> tuple[str, object]:
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias")
        return map_expert_weight(name) or super().map_weight_name(name)

    def skip_weight(self, name: str) -> bool:
        # V3 checkpoints carry their multi-token-prediction module as layers past num_hidden_layers.
        layer = _LAYER.match(name)
        return super().skip_weight(name) or (layer is not None and int(layer[1]) >= self.num_layers)

    def forward(self, token_ids, positions, step, intermediate=None):
        return self.model(token_ids, positions, step, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random DeepSeek-V2-Lite config (MLA without a q low-rank, YaRN, 4 routed experts top-2 plus a
        shared one after a dense first layer) for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="deepseek_v2", moe_intermediate_size=128, num_key_value_heads=4,
                    q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                    topk_method="greedy", routed_scaling_factor=2.0,
                    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32, beta_slow=1,
                                         original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @classmethod
    def routing(cls, config) -> dict:
        return dict(scoring="sigmoid", renormalize=bool(config.norm_topk_prob), correction_bias=True,
                    num_groups=config.n_group or 1, topk_groups=config.topk_group or 1, group_score="top2_sum",
                    scaling=config.routed_scaling_factor)

    @classmethod
    def interleaved_rope(cls, config) -> bool:
        return getattr(config, "rope_interleave", True)

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random DeepSeek-V3 config (MLA with a q low-rank, sigmoid routing over 4 experts in 2
        groups, top-2, a shared expert after a dense first layer) for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="deepseek_v3", moe_intermediate_size=128, num_key_value_heads=4,
                    q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                    n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
