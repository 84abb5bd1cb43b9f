"""Named model configs for random-weight benchmark models: transformers config fields, by name."""

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
}
