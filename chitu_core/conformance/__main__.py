"""`python -m chitu_core.conformance --backend NAME`: run the suite, print the support matrix.

Exit status: 0 when no case failed, 1 when one did, 2 when the backend could not be loaded.
"""

import argparse
import sys

from chitu_core.conformance.case import PerfOptions
from chitu_core.conformance.report import environment, markdown, to_csv, to_json, write
from chitu_core.conformance.runner import Session, build_cases, load_target, parse_dtypes
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
    args = parser.parse_args(argv)
    if not args.thresholds_table and not args.backend:
        parser.error("--backend is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.thresholds_table:
        sys.stdout.write(thresholds_markdown())
        return 0
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

    results = Session(target, cases).run_all(progress)
    env = environment(target)
    md = markdown(results, env, perf=args.perf)
    text = {"md": lambda: md, "json": lambda: to_json(results, env), "csv": lambda: to_csv(results, env)}[args.format]()
    write(text, args.output)
    if args.output:
        sys.stdout.write(md)
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
