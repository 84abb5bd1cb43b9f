"""``python -m chitu_core.bench random-model --like NAME --out DIR``: a random-weight HF model
directory (config.json, generation_config.json, safetensors) of a named config, made with
transformers' ``from_config`` and ``save_pretrained``. No tokenizer: prompts are token ids.

With ``--config-only`` the directory gets config.json and generation_config.json alone, no
weights: the engine runs it with ``load_format="dummy"`` (``bench offline --load-format dummy``),
drawing random weights on the device, so that full-size configs need no weights on disk."""

import argparse
import copy
from pathlib import Path

import torch

from chitu_core.bench.configs import CONFIGS


def hf_config(name: str):
    """The transformers config of ``CONFIGS[name]``."""
    from transformers import AutoConfig

    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    fields = copy.deepcopy(CONFIGS[name])  # transformers fills in nested dicts (rope) in place
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def write_random_model(name: str, out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       device: str = "cpu") -> int:
    """Save a random-weight model of config ``name`` to ``out``; returns its parameter count.
    ``device``: the torch device the weights are drawn on (an accelerator draws billions fast)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    return model.num_parameters()


def write_config_only(name: str, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Save config.json (its ``architectures`` and ``dtype`` set) and generation_config.json of
    config ``name`` to ``out``: no weights."""
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = hf_config(name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = dtype
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--like", required=True, choices=sorted(CONFIGS), help="the named config to copy")
    parser.add_argument("--out", required=True, type=Path, help="directory to write")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the saved weights (default: bfloat16, as the real checkpoints)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-device", default="cpu", help="torch device to draw the weights on (default: cpu)")
    parser.add_argument("--config-only", action="store_true",
                        help="write config.json and generation_config.json only, no weights: a directory for "
                        "--load-format dummy")
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    if args.config_only:
        write_config_only(args.like, args.out, getattr(torch, args.dtype))
        print(f"wrote {args.out}: {args.like} config only, no weights ({args.dtype}); run it with --load-format dummy")
        return 0
    params = write_random_model(args.like, args.out, getattr(torch, args.dtype), args.seed, args.init_device)
    print(f"wrote {args.out}: random {args.like} ({params / 1e6:.1f}M parameters, {args.dtype})")
    return 0
