"""Small builders for tests: tiny random-weight HF models of real configs, saved with save_pretrained."""

from pathlib import Path

import torch

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def config_for(arch: str, **overrides):
    """A tiny transformers config of ``arch`` ("llama", "llama3", "llama-tied", "mistral", "qwen2", "qwen3")."""
    import transformers as tf

    base = dict(TINY, **overrides)
    if arch == "llama":
        return tf.LlamaConfig(**base)
    if arch == "llama3":
        return tf.LlamaConfig(rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0, **base)
    if arch == "llama-tied":
        return tf.LlamaConfig(tie_word_embeddings=True, **base)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=None, **base)
    if arch == "qwen2":
        return tf.Qwen2Config(**base)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=16, **base)
    raise ValueError(arch)


def build_model(path: Path, arch: str = "llama", seed: int = 0, dtype=torch.float32, **overrides):
    """Create a random-weight model, save it to ``path``; returns the transformers model (eval)."""
    from transformers import AutoModelForCausalLM

    config = config_for(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # Widen the random init so logits are far from ties and greedy paths are well defined.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Chitu serves large language models on many kinds of hardware.",
    "Héllo wörld, naïve café, 東京 and Zürich: multi-byte text matters.",
]


def save_tokenizer(path: Path, vocab_size: int = 400):
    """Train a small byte-level BPE tokenizer with a chat template and save it beside a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
    return fast
