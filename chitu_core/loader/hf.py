"""An HF model directory: config.json, single or sharded safetensors, tokenizer and chat template.

Errors name the file and say what to do: a missing config, an architecture no
installed plugin supports (the installed ones are listed), a truncated or
corrupt safetensors file, an index that names a file that is not there.

A directory pre-sharded for N tensor-parallel ranks (``python -m chitu_core.convert --tp N``) has
config.json, the tokenizer and the other small files at the top, ``"chitu_tensor_parallel":
{"size": N}`` in config.json, and rank r's weights, already sliced, in ``rank-{r}/`` (safetensors
and, where there are several, their index). ``HFModelDir.for_rank`` picks a rank's files.
"""

import json
import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from chitu_core.errors import ModelLoadError

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
COMPLETE_CONFIG_MARKER = "chitu-gguf.json"  # a GGUF conversion's marker; "complete_config": true lets config.json skip transformers
TENSOR_PARALLEL_FIELD = "chitu_tensor_parallel"  # config.json: {"size": N} in a directory pre-sharded by convert --tp


def rank_dir(path: Path, rank: int) -> Path:
    """Where rank ``rank``'s weights are in a pre-sharded directory."""
    return path / f"rank-{rank}"


@dataclass
class HFModelDir:
    path: Path
    config: object  # transformers.PretrainedConfig, or a JsonConfig for a complete config.json
    weight_files: list[Path]  # for a pre-sharded directory: the files of ``rank`` (none before ``for_rank``)
    sharded_for: int | None = None  # the tensor-parallel size it was pre-sharded for, or None
    rank: int | None = None

    @property
    def presharded(self) -> bool:
        return self.sharded_for is not None

    def for_rank(self, rank: int, world_size: int) -> "HFModelDir":
        """The directory as rank ``rank`` of ``world_size`` loads it: itself, or, when pre-sharded, with
        that rank's weight files, which must have been sharded for ``world_size`` ranks."""
        if not self.presharded:
            return self
        if world_size != self.sharded_for:
            n = self.sharded_for
            fix = f"with --tp {world_size}" if world_size > 1 else "without --tp"
            raise ModelLoadError(
                f"{self.path} is pre-sharded for {n} tensor-parallel ranks (python -m chitu_core.convert --tp {n}) but "
                f"this run has {world_size}: run it on {n} ranks, or convert the original checkpoint again {fix}")
        directory = rank_dir(self.path, rank)
        if not directory.is_dir():
            raise ModelLoadError(f"{self.path} is pre-sharded for {self.sharded_for} ranks but has no {directory.name}/; "
                                 "convert the original checkpoint again")
        files = _weight_files(directory)
        for f in files:
            read_header(f)
        return replace(self, weight_files=files, rank=rank)

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
        """The tokenizer saved beside the weights (with its chat template), or None if there is none:
        the light one (``chitu_core.loader.tokenizer``) where it reproduces transformers', else
        transformers' AutoTokenizer."""
        if not any((self.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return None
        from chitu_core.loader.tokenizer import LightTokenizer

        light = LightTokenizer.load(self.path)
        if light is not None:
            return light
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the checkpoint, file by file, with a tqdm progress bar."""
        if self.presharded and self.rank is None:
            raise ModelLoadError(f"{self.path} is pre-sharded for {self.sharded_for} tensor-parallel ranks: "
                                 "choose the rank whose weights to read (HFModelDir.for_rank)")
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
    neither looked for nor checked, and ``weight_files`` is empty. So it is for a pre-sharded
    directory, until ``for_rank`` picks a rank's files."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory; pass an HF model directory (config.json + *.safetensors)")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json; pass an HF model directory saved with save_pretrained")
    config = _complete_config(path)
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(path)
        except (ValueError, KeyError, OSError) as exc:
            raise ModelLoadError(f"transformers cannot read {path / 'config.json'}: {exc}") from None
    sharded_for = _sharded_for(path, config)
    if not require_weights or sharded_for is not None:
        return HFModelDir(path, config, [], sharded_for)
    files = _weight_files(path)
    for f in files:
        read_header(f)
    return HFModelDir(path, config, files)


class JsonConfig(SimpleNamespace):
    """config.json's fields as attributes (nested objects stay dicts), for a directory whose
    config.json holds every field transformers' config class would default (see ``_complete_config``)."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def _complete_config(path: Path) -> JsonConfig | None:
    """config.json read without transformers where the directory's writer marked it complete (a GGUF
    conversion's marker file says ``"complete_config": true``), else None."""
    marker = path / COMPLETE_CONFIG_MARKER
    try:
        complete = marker.is_file() and json.loads(marker.read_text()).get("complete_config") is True
    except (OSError, ValueError):
        complete = False
    if not complete:
        return None
    try:
        fields = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'} ({exc}); delete {path} to convert the model again") from None
    return JsonConfig(**fields)


def _sharded_for(path: Path, config) -> int | None:
    field = getattr(config, TENSOR_PARALLEL_FIELD, None)
    if field is None:
        return None
    size = field.get("size") if isinstance(field, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ModelLoadError(f"{path / 'config.json'}: {TENSOR_PARALLEL_FIELD} is {field!r}, not "
                             '{"size": N} with N a positive integer')
    return size


def eos_token_ids(path: str | Path, hf_config, tokenizer=None) -> set[int]:
    """generation_config.json's eos_token_id (an id or a list), else config.json's, else the tokenizer's."""
    ids = getattr(hf_config, "eos_token_id", None)
    file = Path(path) / "generation_config.json"
    try:
        ids = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id") or ids
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:  # as transformers did: use the others
        log.warning("ignoring %s, which is not a readable JSON object (%s)", file, exc)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    return set(ids if isinstance(ids, list) else [] if ids is None else [ids])
