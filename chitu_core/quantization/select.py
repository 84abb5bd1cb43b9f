"""Which quantization method a model runs with: from the checkpoint, or in situ from a flag.

A checkpoint's ``quantization_config`` (config.json) names its format in ``quant_method``; each
registered method says which formats it reads (``QuantMethod.claims``). ``--quantization
fp8|int8|int4`` instead quantizes a 16-bit checkpoint (or dummy weights) while loading. Layers the
format leaves unquantized (``ignore`` / ``modules_to_not_convert`` / ``ignored_layers``) are
rebuilt unquantized before loading. A method the backend does not run is a one-line error. A
compressed-tensors config without ``config_groups`` quantizes only the KV cache (``kv_scales``).
"""

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from chitu_core.errors import ChituError
from chitu_core.quantization.base import QuantMethod, UnquantizedMethod
from chitu_core.quantization.registry import all_quant_methods, get_quant_method

# --quantization NAME -> (method, options): what in-situ quantization produces.
IN_SITU = {
    "fp8": ("fp8", {"weight_block_size": [128, 128]}),
    "int8": ("int8", {}),
    "int4": ("awq", {"group_size": 128, "zero_point": True}),
}


@dataclass
class QuantSpec:
    """The method a model's linear layers are built with."""

    method: str = "unquantized"
    options: dict[str, Any] = field(default_factory=dict)
    in_situ: bool = False
    ignored: tuple[str, ...] = ()  # module-name patterns left unquantized
    checkpoint_config: dict[str, Any] = field(default_factory=dict)  # the quantization_config it came from

    def new_method(self, overrides: Mapping[str, Any] | None = None) -> QuantMethod:
        return get_quant_method(self.method)({**self.options, **(overrides or {})}, self.in_situ)

    def describe(self) -> str:
        how = " (in situ)" if self.in_situ else ""
        return f"{self.method}{how} {self.options}" if self.options else f"{self.method}{how}"


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` as a dict, or None."""
    quantization_config = getattr(hf_config, "quantization_config", None)
    if quantization_config is None:
        return None
    if isinstance(quantization_config, Mapping):
        return dict(quantization_config)
    to_dict = getattr(quantization_config, "to_dict", None)
    return to_dict() if to_dict else dict(vars(quantization_config))


def _quantizes_weights(qc: Mapping[str, Any]) -> bool:
    """False for a compressed-tensors config without ``config_groups``: it quantizes the KV cache only
    (``kv_cache_scheme``, read by ``chitu_core.quantization.kv_scales``), the weights stay as they are."""
    return qc.get("quant_method") != "compressed-tensors" or bool(qc.get("config_groups"))


def _ignored(qc: Mapping[str, Any]) -> tuple[str, ...]:
    names = []
    for key in ("ignore", "modules_to_not_convert", "ignored_layers"):
        names += list(qc.get(key) or ())
    return tuple(names)


def select_quantization(hf_config: Any, requested: str | None, backend) -> QuantSpec:
    """The QuantSpec for a model: the checkpoint's format, or ``requested`` in situ; checked against
    what ``backend`` runs, with its ``quant_preferences`` merged into the options."""
    qc = checkpoint_quant_config(hf_config)
    if qc is not None and not _quantizes_weights(qc):
        qc = None
    if qc is not None and requested:
        raise ChituError(f"the checkpoint is already quantized ({qc.get('quant_method')!r}); --quantization "
                         f"{requested} quantizes 16-bit checkpoints only: leave it out")
    if requested:
        if requested not in IN_SITU:
            raise ChituError(f"unknown --quantization {requested!r}; choose one of {', '.join(IN_SITU)}")
        name, options = IN_SITU[requested]
        spec = QuantSpec(name, dict(options), in_situ=True)
    elif qc is not None:
        fmt = qc.get("quant_method")
        claimants = [cls for cls in all_quant_methods().values() if cls.claims(qc)]
        if not claimants:
            raise ChituError(f"config.json's quantization_config has quant_method {fmt!r}, which no installed "
                             f"quantization method reads; known methods: {', '.join(sorted(all_quant_methods()))}")
        cls = claimants[0]
        spec = QuantSpec(cls.name, cls.options_from_checkpoint(qc), ignored=_ignored(qc), checkpoint_config=qc)
    else:
        return QuantSpec()
    if spec.method not in backend.quant_methods():
        raise ChituError(f"backend {backend.name!r} does not run quantization method {spec.method!r} "
                         f"(it runs: {', '.join(sorted(backend.quant_methods()))}); use another device or an "
                         "unquantized checkpoint")
    spec.options.update(backend.quant_preferences(spec.method))
    return spec


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    # A plain name matches the module itself or any module under or ending with it ("lm_head", "mlp.gate").
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


def apply_layer_choices(model: nn.Module, spec: QuantSpec, unfused: Mapping[str, tuple[str, ...]] = {}) -> list[str]:
    """Rebuild the linear layers of ``model`` whose method differs from the model-wide one: unquantized
    where ``spec.ignored`` names them, with their own options where the method's ``layer_options``
    gives some; and the vocabulary tables the checkpoint stores quantized (``table_options``; a tied
    LM head then shares its embedding's). A fused layer (``qkv_proj``) matches when any of its checkpoint parts (``unfused``:
    fused name -> part names, e.g. q_proj, k_proj, v_proj) does. Returns the rebuilt layers' names."""
    from chitu_core.layers.embedding import LMHead, VocabEmbedding
    from chitu_core.layers.linear import LinearBase

    if spec.method == "unquantized":
        return []
    cls = get_quant_method(spec.method)
    rebuilt = []
    for name, module in model.named_modules():
        if isinstance(module, VocabEmbedding) and getattr(module, "tied", None) is None and spec.checkpoint_config:
            if (options := cls.table_options(spec.checkpoint_config, name)) is not None:
                module.set_quant_method(spec.new_method(options))
                rebuilt.append(name)
            continue
        if not isinstance(module, LinearBase):
            continue
        short = name.rsplit(".", 1)[-1]
        parts = tuple(name[: -len(short)] + part for part in unfused.get(short, ()))
        if any(_matches(c, p) for c in (name, *parts) for p in spec.ignored):
            module.set_quant_method(UnquantizedMethod())
            rebuilt.append(name)
        elif spec.checkpoint_config and (options := cls.layer_options(spec.checkpoint_config, name, parts)) is not None:
            module.set_quant_method(spec.new_method(options))
            rebuilt.append(name)
    for name, module in model.named_modules():
        if isinstance(module, LMHead) and module.tied is not None and module.tied.quant is not None:
            module.share_quantized_table()
            rebuilt.append(name)
    return rebuilt
