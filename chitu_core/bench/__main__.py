"""``python -m chitu_core.bench {offline,profile,agree,random-model,serve,report} ...``; ``--help`` on each says more."""

import argparse
import sys

from chitu_core.bench import agree, breakdown, offline, random_model, report, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chitu_core.bench", description="Chitu benchmarks.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each module adds its own arguments and sets `run`.
    offline.add_arguments(commands.add_parser("offline", help="throughput and step times of one fixed batch"))
    breakdown.add_arguments(commands.add_parser("profile", help="where a decode step's time goes, by the model's modules"))
    agree.add_arguments(commands.add_parser("agree", help="greedy tokens against llama.cpp's on the same GGUF file"))
    random_model.add_arguments(commands.add_parser("random-model", help="write a random-weight model, or its config alone, of a named config"))
    serve.add_arguments(commands.add_parser("serve", help="latency and throughput of an OpenAI-compatible server"))
    report.add_arguments(commands.add_parser("report", help="one markdown page from a directory of results"))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
