"""Quantization methods: every method a backend declares, run through its whole life on the backend.

For each method and each of its ``conformance_options()`` (over the backend's ``quant_preferences``:
each variant runs as labelled, whatever the engine would pick), a random float32 weight W [N, K] is quantized by the method's own
``quantize`` into checkpoint tensors; a layer on the backend's device (case dtype) and another on
the CPU both get those tensors, go through ``process_weights_after_loading`` and ``apply``: the
backend's with its resolved ops (or, where ``Backend.pack_linear`` takes the layer, contract 1.7,
through the backend's packed object), the oracle with the reference ops on float64 activations. A method
that cannot quantize (one written for contract 1.0) gets random values in every parameter instead
(floating ones from a normal law scaled by 1/sqrt(in_features), integer ones with random bits).
Methods registered but not declared by the backend are reported unsupported.
"""

from functools import partial

import torch
from torch import nn

from chitu_core.conformance.case import Case, Outcome, Target, nbytes, ops_source, raised, randn, time_call
from chitu_core.conformance.compare import Verdict, check_tensor, compare
from chitu_core.conformance.guards import guard
from chitu_core.ops.table import resolve_ops
from chitu_core.quantization import get_quant_method, quant_method_names
from chitu_core.quantization.params import copy_span

SHAPES = [(1, 64, 96, False), (7, 129, 33, True), (33, 512, 256, False), (16, 1024, 1024, True)]
QUANT_SHAPES = [(1, 256, 96, False), (7, 512, 40, True), (33, 1024, 264, False), (16, 4096, 512, True)]
"""Quantized formats need K to be whole groups or blocks (256 covers GGUF's K-quants) and N whole int32 words."""
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
    params = dict(list(layer.named_parameters()) + list(layer.named_buffers()))
    if set(values) != set(params):
        raise ValueError(f"quantize() returned tensors {sorted(values)}, the layer has parameters {sorted(params)}")
    with torch.no_grad():
        for name, t in params.items():
            copy_span(t, values[name].to(t.device), None, None, None, f"parameter {name!r}")


def run_quant_case(method_name: str, options: dict, shape: tuple, case: Case, target: Target) -> Outcome:
    m, k, n, bias = shape
    gen, device, dtype = case.generator(), target.device, case.dtype
    try:
        method_cls = get_quant_method(method_name)
        options = {**target.backend.quant_preferences(method_name), **options}  # each variant as labelled
        layer, oracle_layer = nn.Module(), nn.Module()
        method, oracle_method = method_cls(options), method_cls(options)
        method.create_weights(layer, k, n, dtype, device)
        oracle_method.create_weights(oracle_layer, k, n, dtype, torch.device("cpu"))
        try:
            values = oracle_method.quantize(randn(gen, n, k, scale=k**-0.5))
        except NotImplementedError:
            values = _fill(layer, gen, k)
        _load(layer, values)
        _load(oracle_layer, values)
        method.process_weights_after_loading(layer)
        oracle_method.process_weights_after_loading(oracle_layer)
        packed = target.backend.pack_linear(method, layer, dtype)  # contract 1.7: the backend's own layout, if it takes it
        with torch.no_grad():  # the oracle computes in float64 on the same values
            for t in list(oracle_layer.parameters()) + list(oracle_layer.buffers()):
                if t.is_floating_point():
                    t.data = t.data.double()
    except Exception as exc:  # the method's own failure is the case's result
        return raised(exc, f"quantization method {method_name!r}")
    x = randn(gen, m, k, dtype=dtype)
    b = randn(gen, n, dtype=dtype) if bias else None
    gx = guard(x, device, "padded")
    gb = guard(b, device) if bias else None
    want = oracle_method.apply(oracle_layer, x.double(), None if b is None else b.double(), REFERENCE_OPS)
    if packed is not None:
        call = lambda: packed(gx.view, None if gb is None else gb.view)  # noqa: E731
    else:
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
    source = "packed" if packed is not None else ops_source(target, method_cls.kernels)
    perf = None
    if target.perf is not None:
        held = packed.tensors().values() if packed is not None else list(layer.parameters()) + list(layer.buffers())
        weights = sum(nbytes(t) for t in held)
        perf = time_call(target, call, weights + nbytes(gx.view, got), 2 * m * n * k)
    return Outcome(verdict, source, perf)


def _describe(options: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items())


def quant_cases(backend, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    declared = set(backend.quant_methods())
    cases = []
    for name in sorted(set(quant_method_names()) | declared):
        try:
            variants = get_quant_method(name).conformance_options()
        except Exception:  # an unknown declared name: its case reports the error
            variants = [{}]
        shapes = SHAPES if name == "unquantized" else QUANT_SHAPES
        for options in variants:
            for dtype in dtypes:
                for shape in shapes:
                    m, k, n, bias = shape
                    params = {"method": name, "m": m, "k": k, "n": n, "bias": bias, **options}
                    declined = "" if name in declared else f"{name!r} is not in the backend's quant_methods()"
                    label = f"{_describe(options) + ' ' if options else ''}M={m} K={k} N={n}{' bias' if bias else ''}"
                    family = "quant" if name == "unquantized" else "quant_matmul"  # methods calling quantized ops
                    cases.append(Case(f"quant/{name}", "quant", family, dtype, params, label,
                                      partial(run_quant_case, name, options, shape), declined=declined))
    return cases
