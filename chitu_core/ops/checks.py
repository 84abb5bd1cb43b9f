"""Checking each op's outputs against its contract as it returns: shape, dtype, device, memory.

``checked_ops(ops)`` wraps every op of an ``Ops`` table; after each call the outputs must have the
shapes and dtypes ``OUTPUTS`` derives from the arguments (``spec`` in code form), live on the
device of the op's first tensor argument, have no dimension of size > 1 with stride 0 (an expanded
view a later in-place write would corrupt) and share no memory with an argument (ops return new
tensors). A violation raises ``OpContractError`` naming the op and where it came from, instead of
letting the next op fail on it. The conformance suite always checks; an engine checks under
``CHITU_CHECK_OPS=1`` (``table.with_checks_if_asked``); otherwise nothing is wrapped.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from chitu_core.errors import ChituError
from chitu_core.ops.spec import OP_NAMES, OpSet

Tensor = torch.Tensor
Outputs = list[tuple[tuple[int, ...], torch.dtype]]


class OpContractError(ChituError):
    """An op returned something its contract (``chitu_core.ops.spec``) does not allow."""


def _like(name: str) -> Callable[[Mapping[str, Any]], Outputs]:
    return lambda a: [(tuple(a[name].shape), a[name].dtype)]


def _halved(a: Mapping[str, Any]) -> Outputs:  # act_and_mul: [..., 2I] -> [..., I]
    x = a["x"]
    return [((*x.shape[:-1], x.shape[-1] // 2), x.dtype)]


def _rows(name: str, dtype: torch.dtype | None = None) -> Callable[[Mapping[str, Any]], Outputs]:
    """[B, V] -> [B, V] in ``dtype`` (None: the input's own), or, for samplers, [B] int64."""
    if dtype is torch.int64:
        return lambda a: [(tuple(a[name].shape[:-1]), torch.int64)]
    return lambda a: [(tuple(a[name].shape), dtype or a[name].dtype)]


def _matmul(weight: str, n_dim: int) -> Callable[[Mapping[str, Any]], Outputs]:
    """x: [..., K] -> [..., N] in x.dtype, N being ``weight.shape[n_dim]``."""
    return lambda a: [((*a["x"].shape[:-1], a[weight].shape[n_dim]), a["x"].dtype)]


OUTPUTS: dict[str, Callable[[Mapping[str, Any]], Outputs]] = {
    "rms_norm": _like("x"),
    "fused_add_rms_norm": lambda a: _like("x")(a) * 2,
    "rotary_embedding": lambda a: _like("q")(a) + _like("k")(a),
    "silu_and_mul": _halved,
    "gelu_and_mul": _halved,
    "linear": _matmul("weight", 0),
    "embedding": lambda a: [((*a["ids"].shape, a["weight"].shape[-1]), a["weight"].dtype)],
    "greedy_sample": _rows("logits", torch.int64),
    "apply_temperature": _rows("logits", torch.float32),
    "apply_top_k_top_p": _rows("logits", torch.float32),
    "apply_min_p": _rows("logits", torch.float32),
    "apply_penalties": _rows("logits", torch.float32),
    "random_sample": _rows("probs", torch.int64),
    "log_softmax": _rows("logits", torch.float32),
    "moe_route": lambda a: [((a["router_logits"].shape[0], a["top_k"]), torch.float32),
                            ((a["router_logits"].shape[0], a["top_k"]), torch.int64)],
    "fused_experts": _like("x"),
    "int4_linear": _matmul("qweight", 1),
    "int8_linear": _matmul("weight", 0),
    "fp8_linear": _matmul("weight", 0),
    "gguf_linear": _matmul("qweight", 0),
    "fused_experts_fp8": _like("x"),
    "offset_rms_norm": _like("x"),  # contract 1.6
    "fused_add_offset_rms_norm": lambda a: _like("x")(a) * 2,
    "layer_norm": _like("x"),
    "rms_norm_linear": lambda a: [((*a["x"].shape[:-1], a["weight"].shape[0] // (2 if a.get("activation") else 1)),
                                   a["x"].dtype)],  # contract 1.9
    "linear_add": lambda a: [(tuple(a["residual"].shape), a["x"].dtype)],
    "mla_inputs": lambda a: [((*a["q"].shape[:2], a["w_uk"].shape[2] + a["cos_sin_cache"].shape[-1]), a["q"].dtype),
                             (tuple(a["kv"].shape), a["q"].dtype)],  # contract 1.10
    "linear_float32": lambda a: [((*a["x"].shape[:-1], a["weight"].shape[0]), torch.float32)],  # contract 1.11
    "int4_rms_norm_linear": lambda a: [((*a["x"].shape[:-1], a["qweight"].shape[1] // (2 if a.get("activation") else 1)
                                         ), a["x"].dtype)],  # contract 1.18
    "int4_linear_add": lambda a: [(tuple(a["residual"].shape), a["x"].dtype)],
}
"""op -> (arguments by name -> [(shape, dtype)] of each output): what ``spec`` says each op returns.
A new op of the contract adds its rule here (``tests/test_hardening.py`` checks every op has one)."""

_PARAMS = {op: tuple(inspect.signature(getattr(OpSet, op)).parameters)[1:] for op in OP_NAMES}


def _problem(out: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None,
             args: list[Tensor]) -> str:
    """What is wrong with one output ("" if nothing)."""
    if not isinstance(out, Tensor):
        return f"is a {type(out).__name__}, not a tensor"
    if tuple(out.shape) != tuple(shape):
        return f"has shape {list(out.shape)}, the contract gives {list(shape)}"
    if out.dtype != dtype:
        return f"has dtype {out.dtype}, the contract gives {dtype}"
    if device is not None and out.device != device:
        return f"is on {out.device}, its inputs on {device}"
    if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
        return f"has stride 0 in a dimension of size > 1 (shape {list(out.shape)}, strides {list(out.stride())})"
    if out.numel():
        ptr = out.untyped_storage().data_ptr()
        if any(a.numel() and a.untyped_storage().data_ptr() == ptr for a in args):
            return "shares memory with an input (ops return new tensors)"
    return ""


def check_outputs(op: str, args: tuple, kwargs: Mapping[str, Any], result: object, origin: str = "") -> None:
    """Raise OpContractError unless ``result`` is what op ``op`` may return for these arguments."""
    rule = OUTPUTS.get(op)
    if rule is None:
        return
    named = dict(zip(_PARAMS[op], args), **kwargs)
    wants = rule(named)
    names = ("output",) if len(wants) == 1 else tuple(f"output {i}" for i in range(len(wants)))
    outs = (result,) if len(wants) == 1 else result
    where = f"op {op!r}{f' ({origin})' if origin else ''}"
    if len(wants) > 1 and not (isinstance(outs, tuple) and len(outs) == len(wants)):
        raise OpContractError(f"{where} broke its contract: it returned {type(result).__name__}, "
                              f"the contract gives a tuple of {len(wants)} tensors")
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    device = tensors[0].device if tensors else None
    for out, (shape, dtype), name in zip(outs, wants, names):
        if problem := _problem(out, shape, dtype, device, tensors):
            raise OpContractError(f"{where} broke its contract: its {name} {problem}")


class _Switch:
    on = True


def _checked(op: str, fn: Callable, origin: str, switch: _Switch) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        result = fn(*args, **kwargs)
        if switch.on:
            check_outputs(op, args, kwargs, result, origin)
        return result

    call.unchecked = fn
    return call


def checked_ops(ops):
    """A copy of the op table ``ops`` whose every op checks its outputs (see the module)."""
    from chitu_core.ops.table import Ops

    switch = _Switch()
    impls = {op: _checked(op, getattr(ops, op), f"{s.kind}, from {s.origin}", switch)
             for op, s in ops.sources.items()}
    checked = Ops(impls, ops.sources)
    checked.checks = switch
    return checked


@contextlib.contextmanager
def checks_paused(ops) -> Iterator[None]:
    """Within the block, a checked table's ops skip their checks (for timing); other tables are untouched."""
    switch = getattr(ops, "checks", None)
    if switch is None:
        yield
        return
    switch.on = False
    try:
        yield
    finally:
        switch.on = True
