"""Weight-loader helpers: attach loaders to parameters, check shapes with messages people can act on."""

from collections.abc import Callable

import torch
from torch import nn

from chitu_core.errors import ModelLoadError


class ShapeMismatch(ModelLoadError):
    """A checkpoint tensor's shape disagrees with the model built from config.json."""


def set_loader(param: nn.Parameter, loader: Callable, shard_ids: tuple = (None,), *,
               local_part: Callable | None = None, load_local: Callable | None = None) -> None:
    """Attach ``loader(param, tensor, shard_id)``, which loads a whole checkpoint tensor; ``shard_ids``
    lists the shards that must all load.

    A parameter split for tensor parallelism also declares the two halves of ``loader``:
    ``local_part(param, tensor, shard_id)``, the part of a whole checkpoint tensor this rank holds
    (checked against the whole shape, sliced as the tensor is stored), and ``load_local(param, part,
    shard_id)``, which copies such a part into place (at its offset in a fused parameter).
    ``python -m chitu_core.convert --tp`` writes ``local_part``'s results, and the loader gives them
    to ``load_local``. A parameter without them is replicated: every rank loads the whole tensor."""
    if (local_part is None) != (load_local is None):
        raise TypeError("set_loader: give both local_part and load_local, or neither")
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_ids = shard_ids  # type: ignore[attr-defined]
    param.local_part, param.load_local = local_part, load_local  # type: ignore[attr-defined]


def check_shape(got: torch.Size, expected: tuple[int, ...], what: str) -> None:
    if tuple(got) != tuple(expected):
        raise ShapeMismatch(f"{what}: checkpoint tensor has shape {list(got)}, the model built from config.json expects {list(expected)}")


def narrow_rank(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of ``t`` along ``dim``, each rank holding ``size`` rows."""
    return t.narrow(dim, rank * size, size)


def default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a whole (replicated) tensor."""
    check_shape(loaded.shape, tuple(param.shape), "replicated parameter")
    param.data.copy_(loaded)
