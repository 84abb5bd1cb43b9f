"""What is installed: every backend, model architecture, quant method and hook plugin, with status."""

from typing import Any

from chitu_core.errors import PluginError
from chitu_core.ops.spec import OP_NAMES
from chitu_core.plugins.discovery import (
    BACKENDS_GROUP,
    HOOKS_GROUP,
    MODELS_GROUP,
    availability,
    backend_ops,
    entries,
    hook_registry,
    load_backend_class,
    load_model_class,
)
from chitu_core.quantization import quant_method_names
from chitu_core.version import CONTRACT_VERSION, __version__


def _backend_report(entry) -> dict[str, Any]:
    row: dict[str, Any] = {"name": entry.name, "distribution": entry.dist_name, "version": entry.dist_version}
    try:
        backend = load_backend_class(entry.name)()
        status = availability(backend)
        ops = backend_ops(backend)
    except PluginError as exc:
        return {**row, "loaded": False, "available": False, "error": str(exc)}
    except Exception as exc:  # a backend whose declarations raise
        return {**row, "loaded": False, "available": False, "error": f"{type(exc).__name__}: {exc}"}
    attention = list(backend.attention_backends()) or ["reference (fallback)"]
    return {
        **row,
        "loaded": True,
        "available": status.available,
        "reason": status.reason,
        "device_type": backend.device_type,
        "priority": backend.priority,
        "contract_version": backend.contract_version,
        "device_count": backend.device_count() if status.available else 0,
        "dtypes": [str(d).removeprefix("torch.") for d in backend.supported_dtypes()],
        "attention": attention,
        "process_group_backend": backend.process_group_backend(),
        "quant_methods": sorted(backend.quant_methods()),
        "graph_runner": backend.graph_runner() is not None,
        "ops": {name: ops.sources[name].kind for name in OP_NAMES},
        "fallback_ops": ops.fallbacks(),
        "overridden_ops": {n: s.origin for n, s in ops.sources.items() if s.kind == "override"},
    }


def _model_report(entry) -> dict[str, Any]:
    row: dict[str, Any] = {"architecture": entry.name, "distribution": entry.dist_name, "version": entry.dist_version}
    try:
        load_model_class(entry.name)
    except PluginError as exc:
        return {**row, "loaded": False, "error": str(exc)}
    return {**row, "loaded": True}


def inventory() -> dict[str, Any]:
    """Everything ``python -m chitu_core.plugins`` shows, as plain data."""
    hooks = hook_registry()
    backends = [_backend_report(e) for e in entries(BACKENDS_GROUP)]
    models = [_model_report(e) for e in entries(MODELS_GROUP)]
    hook_rows = [
        {"name": e.name, "distribution": e.dist_name, "version": e.dist_version, "loaded": True}
        for e in hooks.loaded
    ] + [
        {"name": e.name, "distribution": e.dist_name, "version": e.dist_version, "loaded": False, "error": hooks.failures[e.name]}
        for e in entries(HOOKS_GROUP)
        if e.name in hooks.failures
    ]
    failures = [
        {"group": group, "name": r.get("name") or r.get("architecture"), "distribution": r["distribution"], "error": r["error"]}
        for group, rows in ((BACKENDS_GROUP, backends), (MODELS_GROUP, models), (HOOKS_GROUP, hook_rows))
        for r in rows
        if not r["loaded"]
    ]
    return {
        "chitu_core_version": __version__,
        "contract_version": CONTRACT_VERSION,
        "backends": backends,
        "models": models,
        "quant_methods": [{"name": n, "origin": o} for n, o in sorted(quant_method_names().items())],
        "hook_plugins": hook_rows,
        "failures": failures,
    }
