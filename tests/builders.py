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


def build_chat_model(path: Path, arch: str = "llama-tied"):
    """A tiny random model with the tokenizer of ``save_tokenizer`` (its <s>/</s> as BOS/EOS) and
    chat template; returns (transformers model, tokenizer)."""
    hf = build_model(path, arch, bos_token_id=0, eos_token_id=1)
    return hf, save_tokenizer(path)


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: HF's rotate-halves Q/K rows to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_of(config) -> dict:
    """An HF config's RoPE settings, rope_theta included, whichever transformers version wrote them."""
    rope = {**(getattr(config, "rope_scaling", None) or {}), **(getattr(config, "rope_parameters", None) or {})}
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def llama_cpp_rope_freqs(config) -> torch.Tensor:
    """llama.cpp's rope_freqs.weight for a "llama3" rope_scaling (convert_hf_to_gguf.py, LlamaModel)."""
    import math

    rope = rope_of(config)
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high, old = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def write_llama_gguf(path: Path, model, tokenizer=None, half: bool = False, arch: str = "llama") -> Path:
    """Write a transformers Llama as llama.cpp would: its tensor names (from gguf's own name map), Q/K
    permuted, norms F32 and matrices F32 (or F16 with ``half``), Llama 3 scaling as rope_freqs, and the
    byte-level BPE ``tokenizer`` (from ``save_tokenizer``) with its chat template as metadata."""
    import gguf
    import numpy as np

    config = model.config
    rope = rope_of(config)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(config).numpy())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = w.detach().float()
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, config.num_key_value_heads)
        stem, suffix = name.rsplit(".", 1)
        array = w.numpy().astype(np.float16 if half and w.dim() == 2 else np.float32)
        writer.add_tensor(f"{names.get_name(stem)}.{suffix}", array)
    if tokenizer is not None:
        import json

        merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        special = set(tokenizer.all_special_tokens)
        tokens += [f"[PAD{i}]" for i in range(len(tokens), config.vocab_size)]  # llama.cpp pads to the embedding's rows
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in special else 5 if t.startswith("[PAD") else 1 for t in tokens])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        writer.add_bos_token_id(tokenizer.bos_token_id)
        writer.add_eos_token_id(tokenizer.eos_token_id)
        writer.add_eot_token_id(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        writer.add_add_bos_token(False)
        writer.add_chat_template(tokenizer.chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
