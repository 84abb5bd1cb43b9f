"""Qwen2/2.5 (bias on q, k, v) and Qwen3 (per-head RMSNorm on q and k), on the Llama decoder."""

from chitu_models.llama import CONFORMANCE_SIZES, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config) -> dict:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Qwen2 config for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="qwen2")


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config) -> dict:
        bias = getattr(config, "attention_bias", False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Qwen3 config (q/k norm; head_dim unlike hidden_size / heads) for the model
        conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="qwen3", head_dim=32)
