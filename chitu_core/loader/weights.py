"""Loading checkpoint tensors into a model's (possibly fused, possibly sharded) parameters."""

from collections.abc import Iterable

import torch

from chitu_core.errors import ModelLoadError
from chitu_core.layers.weights import ShapeMismatch, default_loader


def load_into(model, weights: Iterable[tuple[str, torch.Tensor]], presharded: bool = False) -> None:
    """Load every (checkpoint name, tensor) into ``model``; then check nothing is missing.

    Each parameter's ``weight_loader(param, tensor, shard_id)`` does the copy (slicing for
    tensor parallelism); fused parameters must receive every shard in ``param.shard_ids``.
    ``presharded``: the tensors are this rank's parts already (``python -m chitu_core.convert --tp``),
    so a split parameter's ``load_local`` copies each as it is, into place (``set_loader``).
    Errors name the checkpoint tensor and what was expected.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {name: set() for name in params}
    tied_aliases = _tied_aliases(model, params)
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if model.skip_weight(ckpt_name) or ckpt_name in tied_aliases:
            continue
        name, shard_id = model.map_weight_name(ckpt_name)
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        local = getattr(param, "load_local", None) if presharded else None
        loader = local or getattr(param, "weight_loader", default_loader)
        try:
            loader(param, tensor, shard_id)
        except ShapeMismatch as exc:
            raise ShapeMismatch(f"tensor {ckpt_name!r}: {exc}") from None
        loaded[name].add(shard_id)
    if unexpected:
        raise ModelLoadError(
            f"the checkpoint has {len(unexpected)} tensor(s) the model does not know, e.g. "
            f"{', '.join(unexpected[:5])}; is config.json's architecture right for these weights?"
        )
    missing = [
        _checkpoint_name(model, name, sid)
        for name, param in params.items()
        for sid in getattr(param, "shard_ids", (None,))
        if sid not in loaded[name]
    ]
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:8])}")
    model.process_weights_after_loading()


def _tied_aliases(model, params: dict) -> set[str]:
    """Checkpoint names of parameters that are tied to another (e.g. lm_head.weight)."""
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return all_names - set(params)


def _checkpoint_name(model, name: str, shard_id) -> str:
    """The checkpoint name that would load (name, shard_id): stacked_params inverted, else the
    parameter's own name with its shard id (e.g. "…experts.w13 [ExpertShard(expert=3, part='up')]")."""
    for fused, part, sid in model.stacked_params:
        if fused in name and sid == shard_id:
            return name.replace(fused, part)
    return name if shard_id is None else f"{name} [{shard_id!r}]"
