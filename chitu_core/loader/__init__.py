"""Loading HF model directories: config, safetensors checkpoints, tokenizer."""

from chitu_core.loader.hf import HFModelDir, open_model_dir

__all__ = ["HFModelDir", "open_model_dir"]
