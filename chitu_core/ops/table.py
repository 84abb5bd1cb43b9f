"""Resolving a backend's op table: native ops, plugin overrides, reference fallbacks."""

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from chitu_core.errors import PluginError
from chitu_core.ops import reference
from chitu_core.ops.spec import OP_NAMES


@dataclass(frozen=True)
class OpSource:
    """Where a resolved op comes from: "native", "override" (a hook plugin) or "fallback"."""

    kind: str
    origin: str


class Ops:
    """The op table layers call: one attribute per name in ``OP_NAMES``.

    ``sources`` tells, for each op, whether the backend implements it, a hook
    plugin overrides it, or the core's reference serves it as a fallback.
    """

    def __init__(self, impls: Mapping[str, Callable], sources: Mapping[str, OpSource]):
        for name in OP_NAMES:
            setattr(self, name, impls[name])
        self.sources = dict(sources)

    def fallbacks(self) -> list[str]:
        """Names of the ops served by the reference implementation."""
        return [n for n, s in self.sources.items() if s.kind == "fallback"]


def resolve_ops(
    backend_name: str,
    native: Mapping[str, Callable],
    overrides: Mapping[str, tuple[str, Callable]] = {},
) -> Ops:
    """Build the op table: ``overrides`` (op -> (plugin name, fn)) beat ``native``, which beats
    the reference. Unknown op names are an error, so a typo never silently falls back."""
    for name in list(native) + list(overrides):
        if name not in OP_NAMES:
            raise PluginError(
                f"backend {backend_name!r} provides op {name!r}, which is not in the op contract; "
                f"known ops: {', '.join(OP_NAMES)}"
            )
    impls: dict[str, Callable] = {}
    sources: dict[str, OpSource] = {}
    for name in OP_NAMES:
        if name in overrides:
            origin, fn = overrides[name]
            impls[name], sources[name] = fn, OpSource("override", origin)
        elif name in native:
            impls[name], sources[name] = native[name], OpSource("native", backend_name)
        else:
            impls[name], sources[name] = getattr(reference, name), OpSource("fallback", "chitu_core.ops.reference")
    return Ops(impls, sources)


def checks_asked() -> bool:
    """Whether ``CHITU_CHECK_OPS`` asks for checked ops (set, and not "0"). A backend that drops runtime
    checks of its own for speed keeps them when this is true."""
    return os.environ.get("CHITU_CHECK_OPS", "") not in ("", "0")


def with_checks_if_asked(ops: Ops) -> Ops:
    """``ops`` itself, or under ``CHITU_CHECK_OPS=1`` a copy whose every op checks its outputs against
    the contract (``chitu_core.ops.checks``) and names the op that broke it. The default costs nothing."""
    if not checks_asked():
        return ops
    from chitu_core.ops.checks import checked_ops

    return checked_ops(ops)
