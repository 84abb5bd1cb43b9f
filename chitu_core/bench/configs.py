"""Named model configs for random-weight benchmark models: transformers config fields, by name.

Each entry is the architecture of the public config.json of the model named above it (training-only
fields, auto_map and quantization_config left out). Newer entries give RoPE as transformers 5's
``rope_parameters``: the file's ``rope_scaling`` with its ``rope_theta`` folded in.
"""

from typing import Any

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

CONFIGS: dict[str, dict[str, Any]] = {
    # The shape of the tests' tiny models (tests/builders.py TINY).
    "tiny": dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
    ),
    # A tiny mixture of experts (the bench's tests of the MoE byte floor).
    "tiny-mixtral": dict(
        model_type="mixtral", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        num_local_experts=8, num_experts_per_tok=2,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
    ),
    # Qwen/Qwen3-1.7B
    "qwen3-1.7b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        max_window_layers=28, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        sliding_window=None, use_sliding_window=False, attention_bias=False, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645,
    ),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # mistralai/Mixtral-8x22B-v0.1
    "mixtral-8x22b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
        num_attention_heads=48, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=65536, rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # Qwen/Qwen1.5-MoE-A2.7B
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, decoder_sparse_step=1, norm_topk_prob=False,
        max_position_embeddings=8192, max_window_layers=21, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), sliding_window=32768, use_sliding_window=False,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643,
    ),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=40960, max_window_layers=48, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), sliding_window=None, use_sliding_window=False,
        attention_bias=False, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    ),
    # deepseek-ai/DeepSeek-V2-Lite
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        moe_intermediate_size=1408, first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1,
        topk_group=1, scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
        max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
        attention_bias=False, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
    ),
    # deepseek-ai/DeepSeek-V3 (its quantization_config, fp8 blocks of 128x128, left out: dense weights)
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        moe_intermediate_size=2048, first_k_dense_replace=3, moe_layer_freq=1, topk_method="noaux_tc", n_group=8,
        topk_group=4, scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        num_nextn_predict_layers=1, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    ),
}
