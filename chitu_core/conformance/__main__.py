"""`python -m chitu_core.conformance --backend NAME`: run the suite, print the support matrix.

Exit status: 0 when no case failed, 1 when one did, 2 when the backend could not be loaded.

A suite can run in parts (``--ops``, one process each, side by side) and be reported as one:
``python -m chitu_core.conformance --merge part1.json part2.json --format md`` reads the parts' JSON
reports (``--format json``) of one backend on one device and prints the whole matrix.
"""

import argparse
import json
import sys

from chitu_core.conformance.case import PerfOptions
from chitu_core.conformance.report import environment, markdown, to_csv, to_json, write
from chitu_core.conformance.runner import CaseResult, Session, build_cases, load_target, parse_dtypes
from chitu_core.conformance.thresholds import thresholds_markdown
from chitu_core.errors import ChituError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m chitu_core.conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", help="the backend's entry-point name (see `python -m chitu_core.plugins`)")
    parser.add_argument("--ops", default="", help="comma-separated globs of rows or ops to run "
                        "(rms_norm, 'attention*', 'quant/*', all_reduce, sampler, 'model/*'); default: all")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16", help="comma-separated dtypes (matrix columns)")
    parser.add_argument("--perf", action="store_true", help="also time every case (median after warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="perf: calls before timing")
    parser.add_argument("--repeats", type=int, default=20, help="perf: timed calls")
    parser.add_argument("--format", choices=("md", "json", "csv"), default="md", help="report format")
    parser.add_argument("--output", help="write the report here (the markdown matrix still goes to stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--thresholds-table", action="store_true",
                        help="print the thresholds table (docs/conformance-thresholds.md) and exit")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="report these JSON reports of one backend's parts as one, instead of running cases")
    args = parser.parse_args(argv)
    if not args.thresholds_table and not args.merge and not args.backend:
        parser.error("--backend is required (or --merge)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.thresholds_table:
        sys.stdout.write(thresholds_markdown())
        return 0
    if args.merge:
        try:
            results, env = merged(args.merge)
        except ValueError as exc:
            print(f"conformance: {exc}", file=sys.stderr)
            return 2
        return report(results, env, args)
    try:
        dtypes = parse_dtypes(args.dtypes)
        target = load_target(args.backend, PerfOptions(args.warmup, args.repeats) if args.perf else None)
    except (ChituError, ValueError) as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return 2
    cases = build_cases(target, dtypes, args.ops)
    if not cases:
        print(f"conformance: no case matches --ops {args.ops!r} in {args.dtypes}", file=sys.stderr)
        return 2

    def progress(result) -> None:
        if not args.quiet:
            print(f"{result.status:>11}  {result.row} [{result.dtype}] {result.label}", file=sys.stderr, flush=True)

    return report(Session(target, cases).run_all(progress), environment(target), args)


def merged(paths: list[str]) -> tuple[list[CaseResult], dict]:
    """The cases of several JSON reports, in order, and their shared environment (the first part's;
    every part must name the same backend, device and versions)."""
    parts = []
    for path in paths:
        try:
            with open(path) as f:
                parts.append(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--merge {path}: not a JSON report of this suite ({exc}); make one with --format json")
    keys = ("backend", "device_name", "chitu_core", "torch", "commit")
    env = parts[0]["environment"]
    first = {k: env.get(k) for k in keys}
    for path, part in zip(paths[1:], parts[1:]):
        other = {k: part["environment"].get(k) for k in keys}
        if other != first:
            raise ValueError(f"--merge {path}: its environment {other} is not the first part's {first}; "
                             "merge the parts of one run only")
    return [CaseResult(**case) for part in parts for case in part["cases"]], env


def report(results: list[CaseResult], env: dict, args: argparse.Namespace) -> int:
    md = markdown(results, env, perf=args.perf or any(r.time_us is not None for r in results))
    text = {"md": lambda: md, "json": lambda: to_json(results, env), "csv": lambda: to_csv(results, env)}[args.format]()
    write(text, args.output)
    if args.output:
        sys.stdout.write(md)
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
