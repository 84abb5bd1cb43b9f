"""Hook specifications: what several plugins may contribute at once. This module is the contract.

A hook plugin is a module (or object) registered under the entry-point group
``chitu_core.hooks``. It sets ``CHITU_CONTRACT_VERSION = "MAJOR.MINOR"`` and
implements any of the hooks below, decorated with ``chitu_core.plugins.hookspecs.hookimpl``.
"""

from collections.abc import Callable, Mapping

import pluggy

PROJECT = "chitu_core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def chitu_override_ops(backend_name: str) -> Mapping[str, Callable] | None:
    """Ops to use instead of backend ``backend_name``'s own (or instead of its fallbacks).

    Return a mapping from op name (``chitu_core.ops.OP_NAMES``) to a function with
    the op's contract signature, or None to leave that backend alone. When two
    plugins override the same op, the one registered last wins; the choice is
    shown by ``python -m chitu_core.plugins``.
    """


@hookspec
def chitu_quant_methods() -> list[type] | None:
    """Quantization methods (``chitu_core.quantization.QuantMethod`` subclasses) to register."""
