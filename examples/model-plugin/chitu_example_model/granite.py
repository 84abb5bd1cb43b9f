"""IBM Granite (3.x dense, ``GraniteForCausalLM``): Llama's decoder with four scalar multipliers.

What differs from Llama, as transformers' ``modeling_granite`` computes it:
  - the embeddings are multiplied by ``embedding_multiplier``;
  - attention scores are scaled by ``attention_multiplier`` instead of head_dim ** -0.5;
  - each sublayer's output is multiplied by ``residual_multiplier`` before it joins the residual stream;
  - the logits are divided by ``logits_scaling``.
Everything else (fused q/k/v and gate/up projections, RoPE, GQA, tied embeddings, tensor and
pipeline parallelism, checkpoint names) is the Llama decoder's, reused from ``chitu_models.llama``.
"""

import torch

from chitu_core.layers import BuildContext, StepContext
from chitu_core.layers.stage import build_lm_head
from chitu_models.llama import DecoderAttention, DecoderLayer, DecoderMLP, DecoderModel, LlamaForCausalLM


class GraniteAttention(DecoderAttention):
    """Llama's attention, its output times ``residual_multiplier``. Under tensor parallelism the output
    may be this rank's partial sum (``defer_reduce``, inherited): scaling each part scales the sum."""

    def __init__(self, config, layer_idx: int, rotary, ctx: BuildContext, **options):
        super().__init__(config, layer_idx, rotary, ctx, **options)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        return super().forward(positions, x, step) * self.residual_multiplier


class GraniteMLP(DecoderMLP):
    """Llama's gated MLP, its output times ``residual_multiplier``."""

    def __init__(self, config, ctx: BuildContext):
        super().__init__(config, ctx)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    """Checkpoint names, ``stacked_params``, ``kv_geometry`` and ``max_model_len`` are Llama's."""

    contract_version = "1.6"  # Attention's explicit ``scale`` came with contract 1.6

    def __init__(self, config, ctx: BuildContext):
        super(LlamaForCausalLM, self).__init__()  # CausalLM's: Llama's own __init__ would build its attention
        rotary = self.build_rotary(config, ctx)
        opts = self.attention_options(config)
        self.model = DecoderModel(
            config, ctx, rotary,
            lambda i: DecoderLayer(config, GraniteAttention(config, i, rotary, ctx, **opts), GraniteMLP(config, ctx), ctx),
            # Rounded to the model dtype first: exact for Granite's multipliers (12.0), in every dtype.
            embed_scale=float(config.embedding_multiplier))
        self.lm_head = build_lm_head(config, ctx, self.model.embed_tokens)
        self.logits_scaling = float(config.logits_scaling)

    @classmethod
    def attention_options(cls, config) -> dict:
        return {**super().attention_options(config), "scale": float(config.attention_multiplier)}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling  # a division, as transformers: the same rounding

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random config of this family for the model conformance case (an HF config dict with
        its ``model_type``): multipliers unlike 1 so that each one changes the result."""
        return dict(model_type="granite", vocab_size=512, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5, embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5,
                    logits_scaling=4.0, tie_word_embeddings=True)
