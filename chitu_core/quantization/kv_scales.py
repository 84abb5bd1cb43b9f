"""A checkpoint's own FP8 KV-cache scales: whether it declares an FP8 KV cache, and loading its per-layer
scales into the attention layers' ``kv_scale`` (the format is ``chitu_core.attention.fp8``'s).

Declarations, in config.json's ``quantization_config``:

- compressed-tensors (llm-compressor): ``kv_cache_scheme`` ``{"num_bits": 8, "type": "float", "strategy":
  "tensor", "dynamic": false, "symmetric": true}``; any other scheme (int8, per-head ``attn_head``
  scales, dynamic) is a one-line error naming the field.
- ModelOpt: ``"kv_cache_quant_algo": "FP8"``, at the top of quantization_config or in its
  ``quantization`` (hf_quant_config.json's layout); any other algorithm is a one-line error.

With ``kv_cache_dtype="auto"`` such a checkpoint gets the fp8 cache; ``"model"`` and ``"fp8"`` say so
explicitly and win. (``resolve_kv_cache_dtype`` also gives a GGUF file a float16 cache where it can.)

Scale tensors: one float per attention layer, 0-d or [1], named by the attention module's path
(``model.layers.N.self_attn``) and a suffix: ``.k_scale`` / ``.v_scale`` (llm-compressor, vLLM),
``.kv_scale`` (older checkpoints: one scale for keys and values), ``.k_proj.output_scale`` /
``.v_proj.output_scale`` (llm-compressor before k_scale/v_scale), ``.k_proj.k_scale`` / ``.v_proj.v_scale``
(ModelOpt). Each means what ``kv_scale`` means: x is stored as e4m3(x / scale) and read as stored * scale.
A layer is the module under that path that declares ``checkpoint_kv_scales``; names that lead to none
are left to the loader (which reports them as unexpected tensors).
"""

import logging
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.quantization.ct_config import require
from chitu_core.quantization.select import checkpoint_quant_config

log = logging.getLogger(__name__)

# Checkpoint name -> (attention module path, which scale: "k", "v", or "kv" for one scale of both); first match.
_NAMES = (
    (re.compile(r"(.+)\.k_proj\.k_scale$"), "k"),  # ModelOpt
    (re.compile(r"(.+)\.v_proj\.v_scale$"), "v"),
    (re.compile(r"(.+)\.k_proj\.output_scale$"), "k"),  # older llm-compressor
    (re.compile(r"(.+)\.v_proj\.output_scale$"), "v"),
    (re.compile(r"(.+)\.kv_scale$"), "kv"),
    (re.compile(r"(.+)\.k_scale$"), "k"),
    (re.compile(r"(.+)\.v_scale$"), "v"),
)
_WHAT = {"k": "key", "v": "value"}


def declared_kv_cache_dtype(hf_config: Any) -> str | None:
    """"fp8" where the checkpoint declares an FP8 KV cache (see the module), else None. A declared
    scheme this engine cannot hold is a ChituError naming the field."""
    qc = checkpoint_quant_config(hf_config)
    if qc is None:
        return None
    scheme = qc.get("kv_cache_scheme")
    if scheme is not None:
        where, what = "quantization_config.kv_cache_scheme", "the fp8 KV cache"
        if not isinstance(scheme, Mapping):
            raise ChituError(f"{where} is {scheme!r}; expected a dict such as {{'num_bits': 8, 'type': 'float', "
                             "'strategy': 'tensor', 'dynamic': False, 'symmetric': True}")
        args = {"symmetric": True, "dynamic": False, **scheme}  # compressed-tensors' defaults
        for field, allowed in (("type", ("float",)), ("num_bits", (8,)), ("strategy", ("tensor",)),
                               ("symmetric", (True,)), ("dynamic", (False,))):
            require(args, field, allowed, where, what)
        return "fp8"
    nested = qc.get("quantization")
    algo = qc.get("kv_cache_quant_algo", nested.get("kv_cache_quant_algo") if isinstance(nested, Mapping) else None)
    if algo is None:
        return None
    if algo != "FP8":
        raise ChituError(f"quantization_config's kv_cache_quant_algo is {algo!r}; the KV cache reads 'FP8' only")
    return "fp8"


def resolve_kv_cache_dtype(requested: str, hf_config: Any) -> tuple[str, ...]:
    """``EngineConfig.kv_cache_dtype`` -> what to ask the attention backend for (``set_kv_cache_dtype``), in
    order of preference: ``build_attention`` takes the first the backend accepts and asks for the last
    regardless (so a refusal of it is the error). "model" -> "auto" (the model dtype); "fp8", "float16",
    "bfloat16" -> themselves; "auto" -> "fp8" where the checkpoint declares an FP8 KV cache, for a GGUF file
    "float16" where the backend keeps one under a float32 model (llama.cpp's cache: contract 1.15), else
    "auto". An explicit "fp8" still checks the declared scheme, so per-head scales fail here, not mid-load."""
    if requested == "model":
        return ("auto",)
    declared = declared_kv_cache_dtype(hf_config)
    if requested != "auto":
        return (requested,)
    if declared:
        return (declared,)
    qc = checkpoint_quant_config(hf_config)
    return ("float16", "auto") if qc is not None and qc.get("quant_method") == "gguf" else ("auto",)


def load_kv_scales(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` without the KV-cache scales; those go into their layer's ``kv_scale`` once the last tensor
    is read (every tensor-parallel rank reads the same replicated scalars). Layers without an fp8 cache, or
    whose cache row no format defines a scale for (``checkpoint_kv_scales == ()``, latent attention), keep
    theirs and the tensors are dropped. Errors (ModelLoadError, one line, naming the tensor or layer): a
    scale that is not one positive finite value, a scale given twice, and a layer left without a scale
    that other layers have."""
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "checkpoint_kv_scales")}
    found: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # layer -> {"k"/"v": (checkpoint name, tensor)}
    for name, tensor in weights:
        hit = None if model.skip_weight(name) else _match(name, layers)
        if hit is None:
            yield name, tensor
            continue
        layer_name, which = hit
        given = found.setdefault(layer_name, {})
        for part in ("k", "v") if which == "kv" else (which,):
            if part in given:
                raise ModelLoadError(f"the checkpoint gives {layer_name}'s {_WHAT[part]} scale twice: "
                                     f"{given[part][0]!r} and {name!r}")
            given[part] = (name, tensor)
    if found:
        _apply(layers, found)


def _match(name: str, layers: Mapping[str, nn.Module]) -> tuple[str, str] | None:
    for pattern, which in _NAMES:
        m = pattern.match(name)
        if m:
            path = m.group(1)
            owners = [n for n in layers if n == path or n.startswith(path + ".")]
            return (owners[0], which) if len(owners) == 1 else None
    return None


def _apply(layers: Mapping[str, nn.Module], found: Mapping[str, Mapping[str, tuple[str, torch.Tensor]]]) -> None:
    used = {n: m for n, m in layers.items() if m.kv_scale is not None and m.checkpoint_kv_scales}
    unused = sorted(n for n in found if n not in used)
    if unused:
        layer = layers[unused[0]]
        why = ("the KV cache is in the model dtype" if layer.kv_scale is None else
               f"no checkpoint format defines a scale for {type(layer).__name__}'s cache row, which keeps 1.0")
        log.warning("the checkpoint's KV-cache scales of %d layer(s) (e.g. %s) are not used: %s", len(unused),
                    unused[0], why)
    for layer_name, layer in used.items():
        given = found.get(layer_name, {})
        missing = [p for p in layer.checkpoint_kv_scales if p not in given]
        if missing:
            some = next(iter(found))
            raise ModelLoadError(f"the checkpoint has KV-cache scales (e.g. for {some}) but no {_WHAT[missing[0]]} "
                                 f"scale for {layer_name}; a checkpoint gives every attention layer's, or none")
        values = torch.stack([_checked(*given[p]) for p in layer.checkpoint_kv_scales])
        layer.kv_scale.copy_(values.to(layer.kv_scale.device))


def _checked(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The scale as a 0-d float32 tensor, after checking it is one positive finite value."""
    if tensor.numel() != 1:
        raise ModelLoadError(f"KV-cache scale {name!r} has shape {list(tensor.shape)}; only per-tensor scales "
                             "(one value, 0-d or [1]) are supported")
    value = tensor.detach().reshape(()).to(torch.float32)
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ModelLoadError(f"KV-cache scale {name!r} is {float(tensor.reshape(()))}; a scale must be positive and finite")
    return value
