"""Reading compressed-tensors ``quantization_config``s (llm-compressor's checkpoints) for 8-bit methods.

Such a config says ``"quant_method": "compressed-tensors"`` and describes the quantization in
``config_groups``: each group names its target modules and holds ``weights`` and, for W8A8,
``input_activations`` argument dicts (num_bits, type "int" or "float", symmetric, strategy, dynamic,
...); the storage ``format`` is set for the whole config or per group. The 8-bit formats keep one
value per byte: "int-quantized", "float-quantized", "naive-quantized" (the packed 4-bit formats
belong to other methods). The ``ignore`` list is handled by ``select`` like the other formats'.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from chitu_core.errors import ChituError

EIGHT_BIT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Scheme:
    """One config group: its weights' and input activations' arguments, and where it sits (for errors)."""

    where: str  # e.g. "quantization_config.config_groups.group_0"
    weights: Mapping[str, Any]
    input_activations: Mapping[str, Any] | None


def eight_bit_schemes(qc: Mapping[str, Any]) -> list[Scheme] | None:
    """The config's groups if it is a compressed-tensors config stored in an 8-bit format, else None."""
    if qc.get("quant_method") != "compressed-tensors" or not isinstance(qc.get("config_groups"), Mapping):
        return None
    schemes = []
    for name, group in qc["config_groups"].items():
        if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
            return None
        if (group.get("format") or qc.get("format")) not in EIGHT_BIT_FORMATS:
            return None
        schemes.append(Scheme(f"quantization_config.config_groups.{name}", group["weights"],
                              group.get("input_activations")))
    return schemes or None


def weight_type(qc: Mapping[str, Any]) -> str | None:
    """"int" or "float" when every group of an 8-bit-format compressed-tensors config stores weights
    of that type; None otherwise (not such a config, or mixed types)."""
    schemes = eight_bit_schemes(qc)
    types = {s.weights.get("type") for s in schemes} if schemes else set()
    return types.pop() if len(types) == 1 else None


def single_scheme(qc: Mapping[str, Any]) -> Scheme:
    """The one scheme every group shares (targets aside); groups that differ are an error."""
    schemes = eight_bit_schemes(qc) or []
    relevant = ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic")

    def key(args: Mapping[str, Any] | None):
        return None if args is None else tuple(args.get(f) for f in relevant)

    first = schemes[0]
    for scheme, group in zip(schemes, qc["config_groups"].values()):
        if list(group.get("targets") or ()) != ["Linear"]:
            raise ChituError(f"{scheme.where}.targets is {group.get('targets')!r}; only ['Linear'] (every linear "
                             "layer not in 'ignore') is supported")
    for other in schemes[1:]:
        if key(other.weights) != key(first.weights) or key(other.input_activations) != key(first.input_activations):
            raise ChituError(f"{other.where} quantizes differently from {first.where}; checkpoints that mix "
                             "schemes across layers are not supported")
    return first


def require(args: Mapping[str, Any], field: str, allowed: tuple, where: str, what: str) -> Any:
    """args[field], which must be one of ``allowed``; otherwise an error naming the field and value."""
    value = args.get(field)
    if value not in allowed:
        raise ChituError(f"{where}.{field} is {value!r}; {what} reads {' or '.join(map(repr, allowed))} there")
    return value
