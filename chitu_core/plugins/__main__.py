"""`python -m chitu_core.plugins [--json] [--strict]`: list installed backends, models, quant methods, hooks.

Exit status: 0, whatever was found; with ``--strict``, 1 when any plugin failed to load (for CI).
"""

import argparse
import json
import sys

from chitu_core.plugins.inventory import inventory


def render_text(inv: dict) -> str:
    lines = [f"chitu-core {inv['chitu_core_version']} (plugin contract {inv['contract_version']})", "", "Backends:"]
    for b in inv["backends"]:
        head = f"  {b['name']:<10} {b['distribution']} {b['version']}"
        if not b["loaded"]:
            lines.append(f"{head}  FAILED: {b['error']}")
            continue
        state = "available" if b["available"] else f"unavailable: {b['reason']}"
        lines.append(f"{head}  [{state}] priority={b['priority']} device_type={b['device_type']}")
        lines.append(f"{'':13}dtypes: {', '.join(b['dtypes'])}; attention: {', '.join(b['attention'])}; "
                     f"collectives: {b['process_group_backend']}; quant: {', '.join(b['quant_methods'])}; "
                     f"graphs: {'yes' if b['graph_runner'] else 'no'}")
        lines.append(f"{'':13}fallback ops (served by the reference): {', '.join(b['fallback_ops']) or 'none'}")
        for op, origin in b["overridden_ops"].items():
            lines.append(f"{'':13}op {op} overridden by hook plugin {origin}")
    if not inv["backends"]:
        lines.append("  none (install one, e.g. `pip install chitu-cpu`)")
    lines += ["", "Model architectures:"]
    for m in inv["models"]:
        status = "" if m["loaded"] else f"  FAILED: {m['error']}"
        lines.append(f"  {m['architecture']:<24} {m['distribution']} {m['version']}{status}")
    lines += ["", "Quantization methods:"] + [f"  {q['name']:<24} {q['origin']}" for q in inv["quant_methods"]]
    if inv["hook_plugins"]:
        lines += ["", "Hook plugins:"]
        for h in inv["hook_plugins"]:
            status = "" if h["loaded"] else f"  FAILED: {h['error']}"
            lines.append(f"  {h['name']:<24} {h['distribution']} {h['version']}{status}")
    if inv["failures"]:
        lines += ["", f"{len(inv['failures'])} plugin(s) failed to load (listed above)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chitu_core.plugins", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the inventory as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any plugin failed to load")
    args = parser.parse_args(argv)
    inv = inventory()
    print(json.dumps(inv, indent=2) if args.json else render_text(inv))
    return 1 if args.strict and inv["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
