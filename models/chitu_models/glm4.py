"""GLM-4 (0414): Llama's decoder with bias on q, k and v, gate_up_proj fused in the checkpoint, rotary
on the first half of each head (partial_rotary_factor) in interleaved pairs (2i, 2i+1), and
"sandwich" norms: each sublayer's output is normed again before it joins the residual stream."""

from collections.abc import Iterable

import torch

from chitu_core.layers import BuildContext, RMSNorm, RotaryEmbedding, rope_config
from chitu_models.llama import CONFORMANCE_SIZES, DecoderLayer, LlamaForCausalLM, head_dim, unfuse


class SandwichDecoderLayer(DecoderLayer):
    fuse_boundaries = False  # the post-sublayer norms take whole outputs

    def __init__(self, config, self_attn, mlp, ctx: BuildContext):
        super().__init__(config, self_attn, mlp, ctx)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def forward(self, positions, hidden, residual, step):
        # hidden + residual is the stream; each norm with a residual adds the pending output into it first.
        hidden, residual = (self.input_layernorm(hidden), hidden) if residual is None else self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden, step))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    decoder_layer = SandwichDecoderLayer

    @classmethod
    def build_rotary(cls, config, ctx: BuildContext) -> RotaryEmbedding:
        return RotaryEmbedding(head_dim(config), config.max_position_embeddings, rope_config(config), ctx, is_neox=False)

    @classmethod
    def attention_options(cls, config) -> dict:
        return {"qkv_bias": getattr(config, "attention_bias", True), "o_bias": False, "qk_norm": False}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], presharded: bool = False) -> None:
        super().load_weights(weights if presharded else unfuse(self, weights), presharded)

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random GLM-4 config (qkv bias, partial interleaved rotary, head_dim unlike hidden_size /
        heads) for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="glm4", head_dim=32, attention_bias=True, partial_rotary_factor=0.5,
                    pad_token_id=0, bos_token_id=1)
