"""Finding, filtering, loading and checking plugins."""

import dataclasses
import functools
import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass

import pluggy
from stevedore import driver, extension

from chitu_core.backend import Availability, Backend
from chitu_core.errors import BackendNotFound, BackendUnavailable, ModelLoadError, PluginError
from chitu_core.ops.table import Ops, resolve_ops
from chitu_core.plugins import hookspecs
from chitu_core.version import check_contract

BACKENDS_GROUP = "chitu_core.backends"
MODELS_GROUP = "chitu_core.models"
HOOKS_GROUP = "chitu_core.hooks"


@dataclass(frozen=True)
class PluginEntry:
    """One entry point of ours, with the distribution that declares it."""

    group: str
    name: str
    target: str
    dist_name: str
    dist_version: str
    rivals: tuple[str, ...] = ()  # other distributions registering the same name in the group

    @property
    def origin(self) -> str:
        return f"{self.dist_name} {self.dist_version}"


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def plugin_filter() -> set[str] | None:
    """The names CHITU_PLUGINS allows (entry-point or distribution names), or None for all."""
    names = {_normalize(n) for n in os.environ.get("CHITU_PLUGINS", "").split(",") if n.strip()}
    return names or None


def entries(group: str, filtered: bool = True) -> list[PluginEntry]:
    """Entry points of ``group`` that CHITU_PLUGINS allows (all if not ``filtered``), first
    distribution on sys.path winning."""
    allowed = plugin_filter() if filtered else None
    found: dict[str, PluginEntry] = {}
    for ep in importlib.metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        entry = PluginEntry(group, ep.name, ep.value, dist.metadata["Name"] if dist else "?", dist.version if dist else "?")
        if allowed is not None and _normalize(entry.name) not in allowed and _normalize(entry.dist_name) not in allowed:
            continue
        if entry.name in found:
            first = found[entry.name]
            found[entry.name] = dataclasses.replace(first, rivals=first.rivals + (entry.origin,))
        else:
            found[entry.name] = entry
    return sorted(found.values(), key=lambda e: e.name)


def _entry(group: str, name: str) -> PluginEntry | None:
    return next((e for e in entries(group) if e.name == name), None)


def _filtered_out(group: str, name: str) -> PluginEntry | None:
    """The entry ``name`` of ``group`` if it is installed but CHITU_PLUGINS leaves it out."""
    if plugin_filter() is None:
        return None
    return next((e for e in entries(group, filtered=False) if e.name == name), None)


def _forget_stale_group(entry: PluginEntry) -> None:
    """Drop stevedore's in-process list of ``entry``'s group if it lacks ``entry``.

    stevedore keeps each group's entry points for the life of the process; a plugin installed or put
    on sys.path after the group's first lookup is seen by importlib.metadata (``entries``) but not by it.
    """
    cached = extension.ExtensionManager.ENTRY_POINT_CACHE.get(entry.group)
    if cached is not None and not any(ep.name == entry.name and ep.value == entry.target for ep in cached):
        del extension.ExtensionManager.ENTRY_POINT_CACHE[entry.group]


def _load(entry: PluginEntry) -> object:
    """Import one entry point through stevedore; import errors become a PluginError naming it."""
    if entry.rivals:
        raise PluginError(
            f"{entry.group} name {entry.name!r} is registered by {entry.origin} and by {', '.join(entry.rivals)}; "
            f"uninstall all but one of them"
        )
    _forget_stale_group(entry)
    try:
        return driver.DriverManager(entry.group, entry.name, invoke_on_load=False).driver
    except Exception as exc:  # the plugin's own import failure, whatever it raised
        raise PluginError(
            f"plugin {entry.name!r} ({entry.group}) from {entry.origin} failed to import: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def load_backend_class(name: str) -> type[Backend]:
    """Import backend ``name`` only, and check it. Raises BackendNotFound if it is not installed."""
    entry = _entry(BACKENDS_GROUP, name)
    if entry is None and (hidden := _filtered_out(BACKENDS_GROUP, name)):
        raise BackendNotFound(
            f"backend {name!r} from {hidden.origin} is installed, but CHITU_PLUGINS={os.environ['CHITU_PLUGINS']} "
            f"leaves it out; add {name} to CHITU_PLUGINS or unset it"
        )
    if entry is None:
        installed = [e.name for e in entries(BACKENDS_GROUP)]
        hint = f" (CHITU_PLUGINS={os.environ['CHITU_PLUGINS']} excludes others)" if plugin_filter() else ""
        raise BackendNotFound(
            f"no backend named {name!r} is installed (installed backends: {', '.join(installed) or 'none'}{hint}); "
            f"install the distribution that provides it (this project's own backends are published as chitu-<name>)"
        )
    cls = _load(entry)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise PluginError(f"backend entry point {name!r} from {entry.origin} is not a chitu_core.backend.Backend subclass")
    check_contract("backend", name, entry.origin, getattr(cls, "contract_version", None))
    return cls


def availability(backend: Backend) -> Availability:
    """``backend.is_available()``, with an exception it raises turned into the reason it is unavailable."""
    try:
        return backend.is_available()
    except Exception as exc:  # the contract says never raise; a plugin that does is unavailable, and named
        entry = _entry(BACKENDS_GROUP, backend.name)
        origin = f" from {entry.origin}" if entry else ""
        return Availability(False, f"is_available() of backend {backend.name!r}{origin} raised "
                                   f"{type(exc).__name__}: {exc}")


def get_backend(device: str = "auto") -> Backend:
    """The backend for ``device``: a backend name, or "auto" for the highest-priority available one."""
    if device != "auto":
        backend = load_backend_class(device)()
        status = availability(backend)
        if not status.available:
            entry = _entry(BACKENDS_GROUP, device)
            origin = f" (from {entry.origin})" if entry else ""
            raise BackendUnavailable(f"backend {device!r}{origin} is installed but cannot run here: {status.reason}")
        return backend
    candidates: list[Backend] = []
    problems: list[str] = []
    for entry in entries(BACKENDS_GROUP):
        try:
            backend = load_backend_class(entry.name)()
            status = availability(backend)
        except PluginError as exc:
            problems.append(str(exc))
            continue
        if status.available:
            candidates.append(backend)
        else:
            problems.append(f"{entry.name}: {status.reason}")
    if not candidates:
        detail = "; ".join(problems) or "no backend is installed"
        raise BackendNotFound(f"device='auto' found no available backend ({detail}); install one, e.g. `pip install chitu-cpu`")
    return max(candidates, key=lambda b: b.priority)


def load_model_class(architecture: str) -> type:
    """The model class registered for an HF ``architectures`` name."""
    entry = _entry(MODELS_GROUP, architecture)
    if entry is None and (hidden := _filtered_out(MODELS_GROUP, architecture)):
        raise ModelLoadError(
            f"architecture {architecture!r} from {hidden.origin} is installed, but "
            f"CHITU_PLUGINS={os.environ['CHITU_PLUGINS']} leaves it out; add {architecture} to CHITU_PLUGINS or unset it"
        )
    if entry is None:
        installed = ", ".join(e.name for e in entries(MODELS_GROUP)) or "none (pip install chitu-models)"
        raise ModelLoadError(f"architecture {architecture!r} is not supported by any installed model plugin; installed: {installed}")
    cls = _load(entry)
    check_contract("model", architecture, entry.origin, getattr(cls, "contract_version", None))
    return cls


@dataclass
class HookRegistry:
    """The pluggy manager with every accepted hook plugin, and the refusals."""

    manager: pluggy.PluginManager
    loaded: list[PluginEntry]
    failures: dict[str, str]


@functools.lru_cache(maxsize=1)
def hook_registry() -> HookRegistry:
    """Load hook plugins once per process (see hookspecs for what they may contribute)."""
    from chitu_core.quantization import register_quant_method

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    loaded, failures = [], {}
    for entry in entries(HOOKS_GROUP):
        try:
            plugin = _load(entry)
            check_contract("hook plugin", entry.name, entry.origin, getattr(plugin, "CHITU_CONTRACT_VERSION", None))
            pm.register(plugin, name=entry.name)
        except PluginError as exc:
            failures[entry.name] = str(exc)
            continue
        loaded.append(entry)
    for impl in pm.hook.chitu_quant_methods.get_hookimpls():
        try:
            for cls in impl.function() or []:
                register_quant_method(cls, origin=impl.plugin_name)
        except Exception as exc:  # a plugin's own failure: refuse the plugin, keep the others
            failures[impl.plugin_name] = f"chitu_quant_methods() failed: {type(exc).__name__}: {exc}"
            pm.unregister(name=impl.plugin_name)
            loaded = [e for e in loaded if e.name != impl.plugin_name]
    return HookRegistry(pm, loaded, failures)


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide pluggy manager with all accepted hook plugins registered."""
    return hook_registry().manager


def op_overrides(backend_name: str) -> dict[str, tuple[str, Callable]]:
    """op name -> (hook plugin name, fn) for ops hook plugins override on ``backend_name``."""
    out: dict[str, tuple[str, Callable]] = {}
    for impl in plugin_manager().hook.chitu_override_ops.get_hookimpls():  # registration order: the last registered wins
        try:
            ops = impl.function(backend_name=backend_name) or {}
        except Exception as exc:  # name the plugin rather than blame the backend
            raise PluginError(
                f"hook plugin {impl.plugin_name!r} failed in chitu_override_ops({backend_name!r}): "
                f"{type(exc).__name__}: {exc}; uninstall it or leave it out with CHITU_PLUGINS"
            ) from exc
        for op, fn in ops.items():
            out[op] = (impl.plugin_name, fn)
    return out


def backend_ops(backend: Backend) -> Ops:
    """The resolved op table of ``backend``: hook overrides, then native ops, then reference."""
    return resolve_ops(backend.name, backend.native_ops(), op_overrides(backend.name))
