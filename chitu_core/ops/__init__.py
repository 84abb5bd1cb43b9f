"""The op contract: what every backend computes, and the reference that says what is right.

``spec`` documents each op (signature, shapes, dtypes, semantics) and lists
them in ``OP_NAMES``; ``reference`` implements every op in plain PyTorch, the
oracle for conformance and the fallback for any op a backend leaves out;
``table`` resolves a backend's ops (native, hook override or fallback) into
the ``Ops`` object layers call.
"""

from chitu_core.ops.spec import OP_NAMES, OpSet
from chitu_core.ops.table import Ops, resolve_ops

__all__ = ["OP_NAMES", "OpSet", "Ops", "resolve_ops"]
