"""An HF model directory: config.json, single or sharded safetensors, tokenizer and chat template.

Errors name the file and say what to do: a missing config, an architecture no
installed plugin supports (the installed ones are listed), a truncated or
corrupt safetensors file, an index that names a file that is not there.
"""

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from chitu_core.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


@dataclass
class HFModelDir:
    path: Path
    config: object  # transformers.PretrainedConfig
    weight_files: list[Path]

    @property
    def architecture(self) -> str:
        archs = getattr(self.config, "architectures", None) or []
        if not archs:
            raise ModelLoadError(f"{self.path / 'config.json'} names no architecture (the 'architectures' field is empty)")
        return archs[0]

    def config_dtype(self) -> torch.dtype | None:
        dtype = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def tokenizer(self):
        """The tokenizer saved beside the weights (with its chat template), or None if there is none."""
        if not any((self.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the checkpoint, file by file, with a tqdm progress bar."""
        total = sum(len(read_header(f)) for f in self.weight_files)
        with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
            for file in self.weight_files:
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
                        bar.update(1)


def read_header(file: Path) -> dict:
    """A safetensors file's tensor table, after checking the file holds all the data it describes."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{file} is not a safetensors file ({size} bytes, too short for a header); re-save or re-download it")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ModelLoadError(f"{file} is truncated: its header alone claims {header_len} bytes but the file has {size}; re-save or re-download it")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{file} has a corrupt safetensors header ({exc}); re-save or re-download it") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data_end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + header_len + data_end > size:
        raise ModelLoadError(
            f"{file} is truncated: its header describes {data_end} bytes of tensor data but only "
            f"{size - 8 - header_len} are present; re-save or re-download it"
        )
    return tensors


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise ModelLoadError(f"{index} lists shard(s) that are not in {path}: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (only safetensors checkpoints are supported; "
                             "load_format='dummy' runs random weights from config.json alone)")
    return files


def open_model_dir(path: str | Path, require_weights: bool = True) -> HFModelDir:
    """Read config.json and find the weight files; nothing heavy is loaded yet. With
    ``require_weights=False`` (load_format "dummy") config.json alone is enough: weight files are
    neither looked for nor checked, and ``weight_files`` is empty."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory; pass an HF model directory (config.json + *.safetensors)")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json; pass an HF model directory saved with save_pretrained")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"transformers cannot read {path / 'config.json'}: {exc}") from None
    if not require_weights:
        return HFModelDir(path, config, [])
    files = _weight_files(path)
    for f in files:
        read_header(f)
    return HFModelDir(path, config, files)
