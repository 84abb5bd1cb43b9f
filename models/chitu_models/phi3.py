"""Phi-3 and Phi-3.5 (mini, medium): Llama's decoder, with qkv_proj and gate_up_proj fused in the
checkpoint, optional partial rotary, and LongRoPE for the long-context models.

LongRoPE's long factors serve the whole context where it passes original_max_position_embeddings,
the short ones otherwise (``chitu_core.layers.rotary.inv_freq_table`` says why and where that agrees
with transformers). The sliding window Phi-3 configs set (2047 for the 4k models, past the context
for the 128k ones) is Mistral's: every layer attends within it (contract 1.6's attention variant).
"""

from collections.abc import Iterable

import torch

from chitu_core.layers import BuildContext, RotaryEmbedding, rope_config
from chitu_models.llama import CONFORMANCE_SIZES, MistralForCausalLM, head_dim, unfuse


class Phi3ForCausalLM(MistralForCausalLM):
    @classmethod
    def build_rotary(cls, config, ctx: BuildContext) -> RotaryEmbedding:
        # The table is for the context served: that picks LongRoPE's factors.
        return RotaryEmbedding(head_dim(config), cls.max_model_len(config), rope_config(config), ctx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], presharded: bool = False) -> None:
        super().load_weights(weights if presharded else unfuse(self, weights), presharded)

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Phi-3 config (partial rotary, a sliding window shorter than the case's prompts)
        for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="phi3", partial_rotary_factor=0.5, sliding_window=8, pad_token_id=0,
                    bos_token_id=1)
