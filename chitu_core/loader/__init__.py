"""Loading models: HF directories (config, safetensors checkpoints, tokenizer), and GGUF files
converted once into cached HF directories (``resolve_model``)."""

from chitu_core.loader.gguf import embedded_model_name, resolve_model
from chitu_core.loader.hf import HFModelDir, open_model_dir

__all__ = ["HFModelDir", "embedded_model_name", "open_model_dir", "resolve_model"]
