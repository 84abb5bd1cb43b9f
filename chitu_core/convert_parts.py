"""The model skeletons ``convert`` plans from and the tensor-parallel split it writes: the model of a
checkpoint built on the ``meta`` device as the engine would build it (``build_skeleton``), once per
rank for ``--tp`` (``RankParts``), whose loaders say which part of each tensor a rank holds; and the
writer of safetensors shards (``ShardWriter``)."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from chitu_core.distributed.communicator import Communicator
from chitu_core.attention.build import build_attention
from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.linear import LinearBase
from chitu_core.loader.hf import INDEX_FILE, HFModelDir
from chitu_core.model import CausalLM
from chitu_core.ops.table import resolve_ops
from chitu_core.plugins.discovery import load_model_class
from chitu_core.quantization.registry import all_quant_methods
from chitu_core.quantization.select import QuantSpec, apply_layer_choices


class SkeletonBackend:
    """A backend that declares no attention (``build_attention`` then builds the core's reference) and
    runs every quantization method, with no preferences: what a skeleton is built with."""

    name = "skeleton"

    def attention_backends(self) -> dict:
        return {}

    def mla_attention_backends(self) -> dict:
        return {}

    def quant_methods(self) -> frozenset[str]:
        return frozenset(all_quant_methods())

    def quant_preferences(self, method: str) -> dict:
        return {}


def build_skeleton(model_dir: HFModelDir, quant: QuantSpec | None = None, comm: Communicator | None = None) -> CausalLM:
    """The model of ``model_dir`` from its plugin, every tensor on the ``meta`` device: unquantized on
    one rank, or as the engine builds it for rank ``comm.rank`` of ``comm.world_size`` to load a
    checkpoint quantized as ``quant`` says."""
    cls = load_model_class(model_dir.architecture)
    meta = torch.device("meta")
    dtype = model_dir.config_dtype() or torch.bfloat16
    quant, comm = quant or QuantSpec(), comm or Communicator.single()
    with meta:  # tables computed at construction (RoPE's) are meta as well: nothing is allocated
        geometry = cls.kv_geometry(model_dir.config, comm.world_size)
        attention = build_attention(SkeletonBackend(), geometry, None, dtype, meta)
        ctx = BuildContext(resolve_ops("reference", {}), attention, comm, dtype, meta, quant)
        model = cls(model_dir.config, ctx)
    unfused: dict[str, tuple[str, ...]] = {}  # as the engine: fused name -> its checkpoint parts
    for fused, part, _ in model.stacked_params:
        unfused[fused.strip(".")] = unfused.get(fused.strip("."), ()) + (part.strip("."),)
    apply_layer_choices(model, quant, unfused)
    return model



# --- which rank holds what ------------------------------------------------------------------------


class RankParts:
    """The part of each converted tensor that each of ``size`` tensor-parallel ranks holds, taken by
    the loaders of the model built for that rank (on ``meta``, as the engine builds it to load a
    checkpoint quantized as ``quant`` says): a split parameter's ``local_part``, or the whole tensor
    for a replicated one."""

    def __init__(self, model_dir: HFModelDir, quant: QuantSpec, size: int):
        try:
            self.models = [build_skeleton(model_dir, quant, Communicator(None, size, rank)) for rank in range(size)]
        except (ValueError, ModelLoadError) as exc:  # a dimension that does not divide (linear._divide), or
            # a rank's share of the experts that the format cannot hold (FusedMoE, through the method)
            raise ChituError(f"{model_dir.architecture} cannot be split over {size} tensor-parallel ranks: {exc}") from None
        self.params = [dict(m.named_parameters(remove_duplicate=False)) for m in self.models]  # tied ones too

    def split(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor``, the converted checkpoint's tensor ``name``, as each rank holds it (views of it)."""
        parts = []
        for model, params in zip(self.models, self.params):
            param_name, shard_id = model.map_weight_name(name)
            param = params.get(param_name)
            if param is None:
                raise ChituError(f"tensor {name!r} loads into {param_name!r}, which the model built to load the "
                                 "converted checkpoint does not have")
            local_part = getattr(param, "local_part", None)
            if local_part is not None:
                try:
                    parts.append(local_part(param, tensor, shard_id))
                except ChituError as exc:
                    raise ChituError(f"tensor {name!r}: {exc}") from None
            elif tuple(tensor.shape) == tuple(param.shape):
                parts.append(tensor)  # replicated
            else:
                layer = type(model.get_submodule(param_name.rpartition(".")[0])).__name__
                raise ChituError(
                    f"tensor {name!r} cannot be split for tensor parallelism by convert: {layer} loads it into "
                    f"{param_name} {list(param.shape)} without declaring the part a rank holds (local_part, see "
                    "chitu_core.layers.weights.set_loader); convert without --tp, and the engine splits it at load")
        return parts

    def linears(self) -> dict[str, LinearBase]:
        """Rank 0's linear layers (every rank's have the same shapes and fused offsets)."""
        return {name: m for name, m in self.models[0].named_modules() if isinstance(m, LinearBase)}


# --- writing ---------------------------------------------------------------------------------------


class ShardWriter:
    """Tensors into safetensors shards of at most ``max_bytes`` each (a larger tensor gets one of its
    own), named as ``save_pretrained`` names them once the last is written (``finish``)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[Path] = []
        self.shard_of: dict[str, int] = {}  # tensor name -> shard number
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.shard_of or name in self.pending:
            raise ChituError(f"two tensors of the converted checkpoint are both named {name!r}")
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        file = self.directory / f"shard-{len(self.files):05d}.partial"
        save_file(self.pending, file, metadata={"format": "pt"})
        self.shard_of.update(dict.fromkeys(self.pending, len(self.files)))
        self.files.append(file)
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        """Write the last shard, name them all, and write the index if there are several; returns their count."""
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for file, final in zip(self.files, names):
            file.rename(self.directory / final)
        if n > 1:
            weight_map = {tensor: names[i] for tensor, i in self.shard_of.items()}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return n


