"""Reports: the support matrix in markdown, and every case in JSON or CSV, with where they ran."""

import csv
import io
import json
import platform
import subprocess
import sys
from dataclasses import asdict, fields

import torch

from chitu_core.conformance.case import Target
from chitu_core.conformance.runner import CaseResult
from chitu_core.plugins.discovery import BACKENDS_GROUP, entries
from chitu_core.version import CONTRACT_VERSION, __version__


def git_commit() -> str:
    """``git rev-parse HEAD`` in the working directory, or "unknown"."""
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def environment(target: Target) -> dict:
    backend = target.backend
    entry = next((e for e in entries(BACKENDS_GROUP) if e.name == backend.name), None)
    return {
        "backend": backend.name,
        "backend_distribution": f"{entry.dist_name} {entry.dist_version}" if entry else "unknown",
        "backend_contract": backend.contract_version,
        "device": str(target.device),
        "device_name": backend.device_name(),
        "chitu_core": __version__,
        "contract": CONTRACT_VERSION,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": git_commit(),
        "declared_thresholds": target.book.declarations(),
    }


def _worst(results: list[CaseResult]) -> CaseResult | None:
    judged = [r for r in results if r.error is not None and r.bound is not None]
    return max(judged, key=lambda r: r.error / r.bound if r.bound else r.error, default=None)


def _error_text(r: CaseResult | None) -> str:
    if r is None or r.error is None:
        return ""
    if r.metric == "close":
        return f"{r.error:.2g}×tol"
    if r.metric == "nmse":
        return f"nmse {r.error:.1e} ≤ {r.bound:.0e}"
    if r.metric == "zscore":
        return f"z-score {r.error:.2g} ≤ {r.bound:g}"
    return "exact" if r.error == 0 else f"{r.error:g} wrong"


def cell(results: list[CaseResult]) -> str:
    """One matrix entry: the status of a row's cases in one dtype and the worst error against its bound."""
    if not results:
        return "—"
    n = len(results)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fallback", "fail", "unsupported", "skipped")}
    mark = " †" if any(r.declared for r in results) else ""
    if counts["fail"]:
        return f"**FAIL** {counts['fail']}/{n}{mark}"
    ran = [r for r in results if r.status in ("pass", "fallback")]
    if not ran:
        return "unsupported" if counts["unsupported"] else "skipped"
    status = "fallback" if counts["fallback"] else "pass"
    extra = f", {counts['unsupported']}/{n} unsupported" if counts["unsupported"] else ""
    return f"{status} ({_error_text(_worst(ran))}){extra}{mark}"


def matrix(results: list[CaseResult]) -> str:
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    rows = list(dict.fromkeys(r.row for r in results))
    all_dtypes = [d for d in ("float32", "bfloat16", "float16") if d in dtypes] + [d for d in dtypes
                                                                                 if d not in ("float32", "bfloat16", "float16")]
    lines = ["| op | source | " + " | ".join(all_dtypes) + " |", "|---|---|" + "---|" * len(all_dtypes)]
    for row in rows:
        mine = [r for r in results if r.row == row]
        sources = sorted({r.source for r in mine if r.source})
        cells = [cell([r for r in mine if r.dtype == d]).replace("|", "\\|") for d in all_dtypes]
        lines.append(f"| `{row}` | {', '.join(sources) or '—'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: list[CaseResult]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fallback", "unsupported", "skipped", "fail")}
    return f"{len(results)} cases: " + ", ".join(f"{n} {s}" for s, n in counts.items())


def markdown(results: list[CaseResult], env: dict, perf: bool = False) -> str:
    lines = [f"# Conformance: backend `{env['backend']}` ({env['backend_distribution']})", "",
             f"device {env['device']} ({env['device_name']}); chitu-core {env['chitu_core']} (contract "
             f"{env['contract']}); torch {env['torch']}; python {env['python']}; commit {env['commit']}", "",
             summary(results), "", matrix(results), "",
             "Source: native (the backend's), override (a hook plugin's), fallback (the core's reference; for the "
             "collectives, the default gloo process group), native+fallback (a case running several ops, some of "
             "them the reference's), packed (a quantized linear in the backend's own weight layout, contract 1.7). Cells: status (worst error against its threshold); — means the contract has no "
             "case in that dtype; † marks a threshold the backend declared. Thresholds: docs/conformance-thresholds.md."]
    if env["declared_thresholds"]:
        lines += ["", "## Declared thresholds", "", "| family or op | dtype | default | declared |", "|---|---|---|---|"]
        lines += [f"| `{d['key']}` | {d['dtype']} | {d['default']} | {d['declared']} |" for d in env["declared_thresholds"]]
    failed = [r for r in results if r.status == "fail"]
    if failed:
        lines += ["", "## Failures", ""] + [f"- `{r.row}` [{r.dtype}] {r.label}: {r.detail}" for r in failed]
    skipped = dict.fromkeys((r.row, r.detail) for r in results if r.status == "skipped")
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- `{row}`: {detail}" for row, detail in skipped]
    if perf:
        lines += ["", "## Performance", "", "| op | dtype | case | µs/call | GB/s | TFLOP/s |", "|---|---|---|---|---|---|"]
        for r in results:
            if r.time_us is not None:
                gbps = f"{r.gbps:.2f}" if r.gbps else ""
                tflops = f"{r.tflops:.3f}" if r.tflops else ""
                lines.append(f"| `{r.row}` | {r.dtype} | {r.label} | {r.time_us:.1f} | {gbps} | {tflops} |")
    return "\n".join(lines) + "\n"


def to_json(results: list[CaseResult], env: dict) -> str:
    return json.dumps({"environment": env, "cases": [asdict(r) for r in results]}, indent=1, default=str)


def to_csv(results: list[CaseResult], env: dict) -> str:
    out = io.StringIO()
    names = [f.name for f in fields(CaseResult)]
    head = ["backend", "device", "device_name", "chitu_core", "torch", "commit"]
    writer = csv.writer(out)
    writer.writerow(head + names)
    for r in results:
        row = asdict(r)
        row["params"] = json.dumps(row["params"], sort_keys=True)
        writer.writerow([env[h] for h in head] + [row[n] for n in names])
    return out.getvalue()


def write(text: str, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
