"""Quantization methods: every method a backend declares, run through its whole life on the backend.

For each method, ``create_weights`` builds a layer on the backend's device in the case dtype and
another on the CPU in float64; every parameter is filled with random values (floating ones from a
normal law scaled by 1/sqrt(in_features), integer ones with random bits), copied to the float64
layer, and both go through ``process_weights_after_loading`` and ``apply``: the backend's with its
resolved ops, the oracle with the reference ops. For ``unquantized`` the oracle is the reference
dense matmul itself. Methods registered but not declared by the backend are reported unsupported.
"""

from functools import partial

import torch
from torch import nn

from chitu_core.conformance.case import Case, Outcome, Target, nbytes, randn, raised, time_call
from chitu_core.conformance.compare import Verdict, check_tensor, compare
from chitu_core.conformance.guards import guard
from chitu_core.ops.table import resolve_ops
from chitu_core.quantization import get_quant_method, quant_method_names

SHAPES = [(1, 64, 96, False), (7, 129, 33, True), (33, 512, 256, False), (16, 1024, 1024, True)]
REFERENCE_OPS = resolve_ops("reference", {})


def _fill(layer: nn.Module, gen: torch.Generator, in_features: int) -> dict[str, torch.Tensor]:
    """Random host values for every parameter and buffer of ``layer``, by name."""
    values = {}
    for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        if t.is_floating_point():
            values[name] = randn(gen, *t.shape, dtype=t.dtype, scale=in_features**-0.5)
        elif t.dtype == torch.bool:
            values[name] = torch.rand(t.shape, generator=gen) < 0.5
        else:
            info = torch.iinfo(t.dtype)
            values[name] = torch.randint(max(info.min, -(1 << 30)), min(info.max, 1 << 30), t.shape,
                                         generator=gen, dtype=torch.int64).to(t.dtype)
    return values


def _load(layer: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            t.copy_(values[name])


def run_quant_case(method_name: str, shape: tuple, case: Case, target: Target) -> Outcome:
    m, k, n, bias = shape
    gen, device, dtype = case.generator(), target.device, case.dtype
    try:
        method_cls = get_quant_method(method_name)
        layer, oracle_layer = nn.Module(), nn.Module()
        method, oracle_method = method_cls(), method_cls()
        method.create_weights(layer, k, n, dtype, device)
        oracle_method.create_weights(oracle_layer, k, n, torch.float64, torch.device("cpu"))
        values = _fill(layer, gen, k)
        _load(layer, values)
        _load(oracle_layer, values)
        method.process_weights_after_loading(layer)
        oracle_method.process_weights_after_loading(oracle_layer)
    except Exception as exc:  # the method's own failure is the case's result
        return raised(exc, f"quantization method {method_name!r}")
    x = randn(gen, m, k, dtype=dtype)
    b = randn(gen, n, dtype=dtype) if bias else None
    gx = guard(x, device, "padded")
    gb = guard(b, device) if bias else None
    want = oracle_method.apply(oracle_layer, x.double(), None if b is None else b.double(), REFERENCE_OPS)
    call = lambda: method.apply(layer, gx.view, None if gb is None else gb.view, target.ops)  # noqa: E731
    try:
        got = call()
    except Exception as exc:  # the backend's own failure is the case's result
        return raised(exc, f"{method_name}.apply")
    for name, g in (("x", gx), ("bias", gb)):
        if g is not None and (problem := g.changed()):
            return Outcome(Verdict.fail(f"{method_name}.apply wrote into its operand `{name}`: {problem}"))
    if problem := check_tensor(got, (m, n), dtype, device, "output"):
        return Outcome(Verdict.fail(problem))
    verdict = compare(got, want, target.threshold(case))
    kinds = {target.ops.sources[op].kind for op in method_cls.kernels}
    source = "fallback" if kinds == {"fallback"} else "native"
    perf = None
    if target.perf is not None:
        weights = sum(nbytes(t) for t in list(layer.parameters()) + list(layer.buffers()))
        perf = time_call(target, call, weights + nbytes(gx.view, got), 2 * m * n * k)
    return Outcome(verdict, source, perf)


def quant_cases(backend, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    declared = set(backend.quant_methods())
    cases = []
    for name in sorted(set(quant_method_names()) | declared):
        for dtype in dtypes:
            for shape in SHAPES:
                m, k, n, bias = shape
                params = {"method": name, "m": m, "k": k, "n": n, "bias": bias}
                declined = "" if name in declared else f"{name!r} is not in the backend's quant_methods()"
                cases.append(Case(f"quant/{name}", "quant", "quant", dtype, params,
                                  f"M={m} K={k} N={n}{' bias' if bias else ''}", partial(run_quant_case, name, shape),
                                  declined=declined))
    return cases
