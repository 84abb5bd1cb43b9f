"""Load a backend, list its cases, ask what it supports, run the rest, and keep one result per case."""

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch

from chitu_core.conformance.attention_cases import attention_cases
from chitu_core.conformance.case import Case, Outcome, PerfOptions, Target
from chitu_core.conformance.collective_cases import collective_cases
from chitu_core.conformance.compare import Verdict
from chitu_core.conformance.mla_cases import mla_cases
from chitu_core.conformance.rotary_attention_cases import rotary_attention_cases
from chitu_core.conformance.model_cases import model_cases
from chitu_core.conformance.op_cases import op_cases
from chitu_core.conformance.quant_cases import quant_cases
from chitu_core.conformance.sampling_cases import sampler_cases
from chitu_core.conformance.thresholds import DTYPES, ThresholdBook, dtype_name
from chitu_core.ops.checks import checked_ops
from chitu_core.plugins.discovery import backend_ops, get_backend

STATUSES = ("pass", "fallback", "fail", "unsupported", "skipped")


@dataclass
class CaseResult:
    """One case's result, as the reports carry it."""

    row: str
    dtype: str
    label: str
    family: str
    status: str  # one of STATUSES
    source: str = ""  # native, override, fallback, native+fallback (a case running several ops) or packed
    metric: str = ""
    error: float | None = None
    bound: float | None = None
    threshold: str = ""
    declared: bool = False  # the threshold is the backend's declaration, not the default
    detail: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    time_us: float | None = None
    gbps: float | None = None
    tflops: float | None = None


def load_target(name: str, perf: PerfOptions | None = None) -> Target:
    """The backend named ``name``, its resolved ops and its declared thresholds."""
    backend = get_backend(name)
    ops = checked_ops(backend_ops(backend))  # every op call of every case checks its outputs' shapes and dtypes
    return Target(backend, ops, backend.device(), ThresholdBook(backend.tolerances()), perf)


def parse_dtypes(text: str) -> tuple[torch.dtype, ...]:
    names = {dtype_name(d): d for d in DTYPES}
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise ValueError(f"unknown dtype(s) {', '.join(unknown)}; the suite knows {', '.join(names)}")
    return tuple(d for d in DTYPES if dtype_name(d) in chosen)


def build_cases(target: Target, dtypes: tuple[torch.dtype, ...] = DTYPES, ops: str = "") -> list[Case]:
    """Every case for ``dtypes``, those whose row or op matches one of the comma-separated globs ``ops``."""
    patterns = [p.strip() for p in ops.split(",") if p.strip()]

    def chosen(row: str, op: str) -> bool:
        return not patterns or any(fnmatch.fnmatchcase(row, p) or fnmatch.fnmatchcase(op, p) for p in patterns)

    cases = (op_cases(dtypes, perf=target.perf is not None) + attention_cases(target.backend, dtypes)
             + rotary_attention_cases(target.backend, dtypes) + mla_cases(target.backend, dtypes)
             + sampler_cases(dtypes) + collective_cases(target.backend, dtypes) + quant_cases(target.backend, dtypes)
             + model_cases(dtypes, chosen))  # only the architectures asked for are loaded
    return [c for c in cases if chosen(c.row, c.op)]


class Session:
    """Runs the cases of one target; cases sharing a batch run together the first time one is asked for."""

    def __init__(self, target: Target, cases: list[Case]):
        self.target, self.cases = target, cases
        self._done: dict[int, CaseResult] = {}

    def run_all(self, on_result=None) -> list[CaseResult]:
        results = []
        for case in self.cases:
            results.append(self.result(case))
            if on_result is not None:
                on_result(results[-1])
        return results

    def has_result(self, case: Case) -> bool:
        return id(case) in self._done

    def result(self, case: Case) -> CaseResult:
        if id(case) not in self._done:
            self._done[id(case)] = self._first_look(case) or self._run(case)
        return self._done[id(case)]

    def _first_look(self, case: Case) -> CaseResult | None:
        """The result of a case that is not run: skipped, declined, or not supported."""
        if case.skip:
            return self._result(case, "skipped", detail=case.skip)
        if case.declined:
            return self._result(case, "unsupported", detail=case.declined)
        try:
            supported = self.target.backend.supports(case.op, case.dtype, dict(case.params))
        except Exception as exc:  # a declaration that raises is the backend's failure
            return self._result(case, "fail", detail=f"supports() raised {type(exc).__name__}: {exc}")
        if not supported:
            return self._result(case, "unsupported", detail="declined by supports()")
        return None

    def _run(self, case: Case) -> CaseResult:
        if case.batch is None:
            return self._from_outcome(case, _guarded_run(case, self.target))
        members = [c for c in self.cases if c.batch is case.batch and id(c) not in self._done]
        runnable = []
        for c in members:
            if (early := self._first_look(c)) is not None:
                self._done[id(c)] = early
            else:
                runnable.append(c)
        try:
            outcomes = case.batch.run_all(self.target, runnable)
        except Exception as exc:  # the harness's side of a batch failing: every member fails with it
            outcomes = [Outcome(Verdict.fail(f"raised {type(exc).__name__}: {exc}"))] * len(runnable)
        for c, outcome in zip(runnable, outcomes):
            self._done[id(c)] = self._from_outcome(c, outcome)
        return self._done[id(case)]

    def _from_outcome(self, case: Case, outcome: Outcome) -> CaseResult:
        v = outcome.verdict
        status = "fail" if not v.ok else "fallback" if "fallback" in outcome.source else "pass"
        result = self._result(case, status, outcome.source, v.error, v.bound, v.detail)
        if outcome.perf is not None:
            result.time_us, result.gbps, result.tflops = outcome.perf.median_us, outcome.perf.gbps, outcome.perf.tflops
        return result

    def _result(self, case: Case, status: str, source: str = "", error=None, bound=None, detail="") -> CaseResult:
        threshold, declared = self.target.book.get(case.row, case.family, case.dtype)
        if not source and case.row in self.target.ops.sources:
            source = self.target.ops.sources[case.row].kind
        return CaseResult(case.row, dtype_name(case.dtype), case.label, case.family, status, source,
                          threshold.metric, error, bound, threshold.describe(), declared, detail, dict(case.params))


def _guarded_run(case: Case, target: Target) -> Outcome:
    try:
        return case.run(target)
    except Exception as exc:  # whatever a backend raises outside the call the case guards
        return Outcome(Verdict.fail(f"raised {type(exc).__name__}: {exc}"))
