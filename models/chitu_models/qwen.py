"""Qwen2/2.5 (bias on q, k, v) and Qwen3 (per-head RMSNorm on q and k), on the Llama decoder."""

from chitu_models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config) -> dict:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config) -> dict:
        bias = getattr(config, "attention_bias", False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
