"""The one table of pass thresholds: a metric per family of cases, a threshold per dtype.

Every case belongs to a family (``FAMILIES``); a family fixes the metric and its threshold in
each dtype, the dtype of the case (the matrix column). A backend may widen a threshold only by
declaring it (``Backend.tolerances()``, keyed by family or op name and dtype); the report lists
every declared one beside its default. ``docs/conformance-thresholds.md`` is generated from
this module (``python -m chitu_core.conformance --thresholds-table``).
"""

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import torch

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes the suite knows, in matrix column order."""


@dataclass(frozen=True)
class Threshold:
    """When a case passes. Which fields matter depends on ``metric`` (see ``METRICS``)."""

    metric: str
    limit: float = 0.0
    rtol: float = 0.0
    atol: float = 0.0

    def describe(self) -> str:
        if self.metric == "close":
            return f"rtol {self.rtol:.2g}, atol {self.atol:.2g}"
        if self.metric == "nmse":
            return f"nmse {self.limit:.2g}, each element within {self.rtol:.2g} of max abs ref"
        if self.metric == "argmax":
            tol = ", ".join(f"{name} {value:.2g}" for name, value in (("rtol", self.rtol), ("atol", self.atol)) if value)
            return f"exact up to ties within {tol}" if tol else "exact, lowest index among ties"
        if self.metric == "zscore":
            return f"z-score {self.limit:.2g}"
        return "exact"


METRICS: dict[str, str] = {
    "close": "every element: |got - ref| <= atol + rtol * |ref|.",
    "nmse": "normalized mean squared error sum((got - ref)^2) / sum(ref^2) <= limit, and no element off by more "
            "than rtol * max|ref| (so a few unwritten or garbage elements cannot hide in the mean).",
    "exact": "equal element for element (integers, indices, copies, masks, collectives of exact values).",
    "argmax": "one index per row. With rtol = atol = 0 it must be the reference's argmax, the lowest index among "
              "exact ties; otherwise any index whose reference score is within atol + rtol * |max| of the row's "
              "maximum is accepted (rounding may legitimately reorder near-ties).",
    "zscore": "N draws with fixed seeds: for every token, |count - N p| <= limit * sqrt(N p (1 - p)), p the reference "
              "probability; drawing a token of probability 0 fails.",
}
COMMON_RULES = "For every metric: NaN never passes; an infinity must match the reference's in sign and place."


@dataclass(frozen=True)
class Family:
    """A group of cases judged alike: the ops (or surfaces) in it, why, and the thresholds."""

    metric: str
    members: tuple[str, ...]
    why: str
    thresholds: Mapping[torch.dtype, Threshold]


def _per_dtype(metric: str, f32: dict, bf16: dict, f16: dict) -> dict[torch.dtype, Threshold]:
    return {torch.float32: Threshold(metric, **f32), torch.bfloat16: Threshold(metric, **bf16),
            torch.float16: Threshold(metric, **f16)}


def _float32(metric: str, **values: float) -> dict[torch.dtype, Threshold]:
    """For families whose cases the contract fixes at float32 (the sampling ops)."""
    return {torch.float32: Threshold(metric, **values)}


# Elementwise results rounded once or twice to the output dtype (torch.testing's defaults, float16 widened
# for its two roundings: the float32 norm cast to float16, then the product with the weight).
_ROUNDED = _per_dtype("close", dict(rtol=1.3e-6, atol=1e-5), dict(rtol=1.6e-2, atol=1e-5), dict(rtol=2e-3, atol=1e-5))
# Outputs that are float32 by contract whatever the operand dtype.
_FLOAT32_OUT = _per_dtype("close", dict(rtol=1.3e-6, atol=1e-5), dict(rtol=1.3e-6, atol=1e-5), dict(rtol=1.3e-6, atol=1e-5))
_EXACT = _per_dtype("exact", {}, {}, {})
# Products with float32 accumulation: the output's rounding (bfloat16: 2**-9 relative, a mean square of
# 1.3e-6; float16: 2**-12) with room for blocked reductions; float32 leaves room for reduction order, not TF32.
_ACCUMULATED = _per_dtype("nmse", dict(limit=1e-9, rtol=1e-4), dict(limit=5e-5, rtol=3e-2), dict(limit=5e-6, rtol=4e-3))
# Products whose operands are widened exactly and whose output is float32 by contract: float32's threshold in every column.
_FLOAT32_ACCUMULATED = _per_dtype("nmse", *[dict(limit=1e-9, rtol=1e-4)] * 3)

FAMILIES: dict[str, Family] = {
    "norm": Family("close", ("rms_norm", "fused_add_rms_norm", "all_reduce_add_rms_norm", "offset_rms_norm",
                            "fused_add_offset_rms_norm", "layer_norm"),
                   "float32 normalisation times the weight, rounded once (or the normalised row rounded to the "
                   "dtype before the weight, as transformers' Llama norm does)", _ROUNDED),
    "rotary": Family("close", ("rotary_embedding",), "float32 rotation rounded once", _ROUNDED),
    "activation": Family("close", ("silu_and_mul", "gelu_and_mul"), "activation and product, each rounded", _ROUNDED),
    "logits": Family("close", ("apply_temperature", "apply_penalties", "log_softmax"),
                     "float32 outputs by contract, whatever the operand dtype", _FLOAT32_OUT),
    "filter": Family("exact", ("apply_top_k_top_p", "apply_min_p"),
                     "kept logits are copies, removed ones -inf; cases keep every boundary far from rounding",
                     _float32("exact")),
    "gather": Family("exact", ("embedding",), "rows are copied", _EXACT),
    "matmul": Family("nmse", ("linear",), "float32 accumulation, output rounded", _ACCUMULATED),
    "float32_matmul": Family("nmse", ("linear_float32",), "x widened exactly, float32 weight, products and sums "
                             "in float32, float32 output whatever x's dtype", _FLOAT32_ACCUMULATED),
    "fused_matmul": Family("nmse", ("rms_norm_linear", "linear_add", "mla_inputs", "linear_all_reduce_add"),
                           "a norm (or a residual) around a linear, float32 accumulation: the normed input, the "
                           "product and the gated activation may each be rounded (as unfused ops round them) or kept "
                           "in float32 until the output; mla_inputs: per-head products beside a norm and rotations; "
                           "linear_all_reduce_add: each rank's product rounded, then their sum", _ACCUMULATED),
    "route": Family("close", ("moe_route",), "ids exact and weights float32 by contract, the k entries of a row "
                    "compared in id order; softmax or sigmoid, a sum and a division in float32; cases keep every "
                    "top-k and group boundary far from rounding",
                    _per_dtype("close", *[dict(rtol=1e-5, atol=1e-7)] * 3)),
    "experts": Family("nmse", ("fused_experts", "fused_experts_fp8"), "two GEMMs with float32 accumulation; the "
                      "activation rounded to the dtype between them (unfused, the GEMM outputs too), the weighted sum "
                      "of a token's slots in float32, output rounded: up to five roundings where a linear has one; "
                      "FP8 weights are dequantized exactly, so they round no more",
                      _per_dtype("nmse", dict(limit=1e-9, rtol=1e-4), dict(limit=1e-4, rtol=3e-2),
                                 dict(limit=1e-5, rtol=4e-3))),
    "quant_matmul": Family("nmse", ("int4_linear", "int8_linear", "fp8_linear", "gguf_linear", "int4_rms_norm_linear",
                                    "int4_linear_add", "quant/* (quantized)"),
                           "dequantized weights are exact, products accumulate in float32 (1.18's fusions around "
                           "them may round as fused_matmul's do); with dynamic "
                           "activation quantization a value that lies within rounding of an int8/FP8 boundary may "
                           "round the other way in a kernel than in the reference (one such value moves the NMSE "
                           "by about 1e-6)",
                           _per_dtype("nmse", dict(limit=3e-6, rtol=2e-3), dict(limit=1e-4, rtol=3e-2),
                                      dict(limit=1e-5, rtol=4e-3))),
    "quant": Family("nmse", ("quant/unquantized",), "the unquantized method against itself on reference ops in float64",
                    _ACCUMULATED),
    "attention": Family("nmse", ("attention/*",), "paged attention against dense float64 attention; cache writes "
                        "checked separately (only the new tokens' blocks change, nothing outside the cache)",
                        _per_dtype("nmse", dict(limit=1e-9, rtol=1e-4), dict(limit=5e-5, rtol=3e-2),
                                   dict(limit=5e-6, rtol=4e-3))),
    "argmax": Family("argmax", ("greedy_sample",), "the contract says: lowest index among ties",
                     _per_dtype("argmax", {}, {}, {})),
    "sample": Family("argmax", ("random_sample",), "argmax of probs / exponentials computed in float32",
                     _float32("argmax", rtol=1e-6)),
    "sampler": Family("zscore", ("sampler",), "the whole Sampler (penalties, temperature, top-k, top-p, min-p, "
                      "counter-based noise) against the float64 reference distribution; 20000 fixed seeds",
                      _float32("zscore", limit=5.0)),
    "collective": Family("exact", ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"),
                         "two ranks on the backend's process group; values are exact in every dtype", _EXACT),
    "model_logits": Family("nmse", ("model/*/logits",), "each installed architecture's small random config, prefill "
                           "and decode steps, against the reference ops and attention in float64",
                           _per_dtype("nmse", dict(limit=1e-8, rtol=1e-3), dict(limit=5e-3, rtol=0.25),
                                      dict(limit=1e-4, rtol=0.05))),
    "model_greedy": Family("argmax", ("model/*/greedy",), "greedy tokens, teacher-forced with the reference's; a token "
                           "whose reference logit is within atol of the best counts as a tie",
                           _per_dtype("argmax", dict(atol=1e-3), dict(atol=0.25), dict(atol=0.05))),
    "model_transformers": Family("nmse", ("model/*/transformers",), "the model on the reference ops in float64 against "
                                 "transformers' own model in float64, same weights and tokens: judges the model plugin, "
                                 "the same on every backend", _float32("nmse", limit=1e-10, rtol=1e-4)),
}

OP_FAMILY: dict[str, str] = {op: name for name, fam in FAMILIES.items() for op in fam.members if "*" not in op}


def default(family: str, dtype: torch.dtype) -> Threshold:
    return FAMILIES[family].thresholds[dtype]


class ThresholdBook:
    """Default thresholds plus a backend's declarations ((family or op name, dtype) -> Threshold or a dict of
    the fields to change). A declaration for an op beats one for its family."""

    def __init__(self, declared: Mapping | None = None):
        self.declared: dict[tuple[str, torch.dtype], Threshold] = {}
        for (key, dtype), value in (declared or {}).items():
            family = key if key in FAMILIES else OP_FAMILY.get(key)
            if family is None or dtype not in FAMILIES[family].thresholds:
                raise ValueError(f"tolerances(): ({key!r}, {dtype}) names no family or op of the suite with cases in "
                                 f"that dtype; families: {', '.join(FAMILIES)}")
            base = default(family, dtype)
            if isinstance(value, Threshold):
                if value.metric != base.metric:
                    raise ValueError(f"tolerances(): ({key!r}, {dtype}) changes the metric {base.metric!r} to "
                                     f"{value.metric!r}; only its values may be declared")
                threshold = value
            else:
                unknown = set(value) - {f.name for f in fields(Threshold)} | ({"metric"} & set(value))
                if unknown:
                    raise ValueError(f"tolerances(): ({key!r}, {dtype}) sets {sorted(unknown)}; "
                                     f"declare limit, rtol or atol")
                threshold = replace(base, **value)
            self.declared[(key, dtype)] = threshold

    def get(self, op: str, family: str, dtype: torch.dtype) -> tuple[Threshold, bool]:
        """(threshold, whether it was declared by the backend) for a case of ``op`` in ``family``."""
        for key in (op, family):
            if (key, dtype) in self.declared:
                return self.declared[(key, dtype)], True
        return default(family, dtype), False

    def declarations(self) -> list[dict]:
        """Each declared threshold beside its default, for the report."""
        rows = []
        for (key, dtype), threshold in self.declared.items():
            family = key if key in FAMILIES else OP_FAMILY[key]
            rows.append({"key": key, "dtype": dtype_name(dtype), "default": default(family, dtype).describe(),
                         "declared": threshold.describe()})
        return rows


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def thresholds_markdown() -> str:
    """The thresholds table as docs/conformance-thresholds.md holds it."""
    lines = [
        "# Conformance thresholds",
        "",
        "<!-- Generated by `python -m chitu_core.conformance --thresholds-table` from",
        "     chitu_core/conformance/thresholds.py; edit that module, then regenerate. -->",
        "",
        "Every case of the conformance suite is compared with the reference implementation run in float64 on",
        "the CPU. Each case belongs to a family; the family fixes the metric and, per dtype (the matrix column),",
        "its threshold. A backend may widen a threshold only by declaring it in `Backend.tolerances()`; the",
        "report lists every declared threshold beside its default.",
        "",
        COMMON_RULES,
        "",
        "A threshold of `—`: the family has no case in that dtype (the contract fixes the sampling ops at float32).",
        "",
        "## Metrics",
        "",
        "| metric | passes when |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {_cell(text)} |" for name, text in METRICS.items()]
    lines += ["", "## Families", "", "| family | cases | metric | " + " | ".join(dtype_name(d) for d in DTYPES) + " | why |",
              "|---|---|---|" + "---|" * len(DTYPES) + "---|"]
    for name, fam in FAMILIES.items():
        cells = " | ".join(_cell(fam.thresholds[d].describe()) if d in fam.thresholds else "—" for d in DTYPES)
        members = ", ".join(f"`{m}`" for m in fam.members)
        lines.append(f"| `{name}` | {members} | `{fam.metric}` | {cells} | {_cell(fam.why)} |")
    return "\n".join(lines) + "\n"
