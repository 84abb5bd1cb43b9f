"""Gemma 2 and Gemma 3 (text): Llama's decoder with Gemma's norms and attention variants.

What differs from Llama: every RMSNorm stores its weight as the offset from one and rounds once
(RMSNorm ``offset``, contract 1.6); each sublayer's output is normed again before it joins the
residual stream (four norms a layer); the embeddings are scaled by sqrt(hidden_size); attention is
scaled by query_pre_attn_scalar ** -0.5; the MLP is GELU-tanh; some layers see a sliding window
(``config.layer_types``). Gemma 2 caps attention logits and final logits (tanh soft-capping); Gemma 3
norms q and k per head and rotates its sliding layers with a local RoPE base, its full layers with
the global one (``rope_parameters`` per layer type).
"""

from dataclasses import replace
from types import SimpleNamespace

import torch

from chitu_core.layers import BuildContext, RMSNorm, RotaryEmbedding, rope_config
from chitu_core.layers.stage import build_lm_head
from chitu_core.model import KVGeometry
from chitu_models.llama import (
    CONFORMANCE_SIZES,
    DecoderAttention,
    DecoderLayer,
    DecoderModel,
    LlamaForCausalLM,
    head_dim,
)

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaDecoderLayer(DecoderLayer):
    """input_layernorm -> attention -> post_attention_layernorm, added to the stream; then
    pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm, added to the stream."""

    fuse_boundaries = False  # the post-sublayer norms take whole outputs
    norm_offset = True

    def __init__(self, config, self_attn, mlp, ctx: BuildContext):
        super().__init__(config, self_attn, mlp, ctx)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, offset=True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, offset=True)

    def forward(self, positions, hidden, residual, step):
        # hidden + residual is the stream; each norm with a residual adds the pending output into it first.
        hidden, residual = (self.input_layernorm(hidden), hidden) if residual is None else self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, step))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def layer_types(config) -> list[str]:
    """Each layer's attention: ``config.layer_types``, else Gemma 2's alternation (sliding first)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        types = [SLIDING if i % 2 == 0 else FULL for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"config.layer_types must name {config.num_hidden_layers} layers, each {SLIDING!r} or "
                         f"{FULL!r}; got {types}")
    return list(types)


class Gemma2ForCausalLM(LlamaForCausalLM):
    contract_version = "1.6"
    decoder_layer = GemmaDecoderLayer
    qk_norm = False

    def __init__(self, config, ctx: BuildContext):
        super(LlamaForCausalLM, self).__init__()
        rotaries = self.build_rotaries(config, ctx)
        types = layer_types(config)
        opts = self.attention_options(config)
        window = getattr(config, "sliding_window", None)

        def layer(i: int) -> DecoderLayer:
            attention = DecoderAttention(config, i, rotaries[types[i]], ctx, **opts,
                                         window=window if types[i] == SLIDING else None)
            return self.decoder_layer(config, attention, self.build_mlp(config, i, ctx), ctx)

        self.model = DecoderModel(config, ctx, rotaries[FULL], layer, norm_offset=True,
                                  embed_scale=config.hidden_size**0.5)
        self.local_rotary = rotaries[SLIDING] if rotaries[SLIDING] is not rotaries[FULL] else None
        self.lm_head = build_lm_head(config, ctx, self.model.embed_tokens)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def build_rotaries(cls, config, ctx: BuildContext) -> dict[str, RotaryEmbedding]:
        """One table for every layer (Gemma 2)."""
        rotary = cls.build_rotary(config, ctx)
        return {SLIDING: rotary, FULL: rotary}

    @classmethod
    def attention_options(cls, config) -> dict:
        bias = getattr(config, "attention_bias", False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": cls.qk_norm, "norm_offset": True,
                "scale": config.query_pre_attn_scalar**-0.5, "softcap": getattr(config, "attn_logit_softcapping", None)}

    @classmethod
    def kv_geometry(cls, config, tp_size: int) -> KVGeometry:
        geometry = super().kv_geometry(config, tp_size)
        variants = {"sliding_window"} if SLIDING in layer_types(config) and getattr(config, "sliding_window", None) else set()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            variants.add("softcap")
        return replace(geometry, attention_variants=frozenset(variants))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Gemma 2 config (a sliding layer then a full one, window shorter than the case's
        prompts; attention and final soft-capping) for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="gemma2", head_dim=64, query_pre_attn_scalar=48, sliding_window=8,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pad_token_id=0, bos_token_id=1)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (``Gemma3ForCausalLM``, model_type gemma3_text)."""

    qk_norm = True

    @classmethod
    def max_model_len(cls, config) -> int:
        params = dict(getattr(config, "rope_parameters", None) or {})
        if FULL not in params:
            return super().max_model_len(config)
        full = rope_config(SimpleNamespace(rope_parameters=params[FULL], max_position_embeddings=config.max_position_embeddings))
        return full.max_positions(config.max_position_embeddings)

    @classmethod
    def build_rotaries(cls, config, ctx: BuildContext) -> dict[str, RotaryEmbedding]:
        """The sliding layers' table from the local base, the full layers' from the global one (with
        its scaling): ``rope_parameters`` keyed by layer type, or flat with ``rope_local_base_freq``."""
        params = dict(getattr(config, "rope_parameters", None) or {})
        n, hd = config.max_position_embeddings, head_dim(config)
        if FULL in params:
            ropes = {t: rope_config(SimpleNamespace(rope_parameters=params[t], max_position_embeddings=n))
                     for t in (SLIDING, FULL)}
        else:
            local = {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
            ropes = {SLIDING: rope_config(SimpleNamespace(rope_parameters=local, max_position_embeddings=n)),
                     FULL: rope_config(config)}
        return {t: RotaryEmbedding(hd, n, rope, ctx) for t, rope in ropes.items()}

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Gemma 3 text config (q/k norm, a sliding layer with the local RoPE base, a full
        one with linear scaling) for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="gemma3_text", head_dim=64, query_pre_attn_scalar=48,
                    sliding_window=8, layer_types=[SLIDING, FULL], pad_token_id=0, bos_token_id=1,
                    rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                     FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})
