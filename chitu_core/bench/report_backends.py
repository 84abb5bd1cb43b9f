"""The report's sections for several backends on one device: a backend in emulation (its own kernel
configuration on another vendor's device, ``"emulated"`` in ``bench offline --json``) against the
device's own backend, in decode speed and in greedy tokens (``emulation.json``, written by
``plugins/nvidia/scripts/emulation_check.py``)."""

from pathlib import Path
from typing import Any


def _key(r: dict[str, Any]) -> tuple:
    return (Path(r["model"]).name, r["batch_size"], r["input_len"], r["output_len"], r["dtype"],
            r.get("quantization"), r["device_name"])


def emulation_table(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Each emulated run against the run of the device's own backend with the same model, batch,
    lengths, dtype and device; [] when there is none."""
    native = {_key(r): (n, r) for n, r in runs if not r.get("emulated")}
    rows = []
    for name, r in runs:
        if r.get("emulated") and _key(r) in native:
            base_name, base = native[_key(r)]
            rows.append(f"| {name} | {r['backend']} | {r['batch_size']} | {r['decode_tok_per_s']:.1f} "
                        f"| {100 * r['floor_fraction']:.1f}% | {base_name} ({base['backend']}) "
                        f"| {base['decode_tok_per_s']:.1f} | {r['decode_tok_per_s'] / base['decode_tok_per_s']:.3f} |")
    if not rows:
        return []
    return ["| run | backend (emulated) | batch | decode tok/s | of floor | device's own backend | its decode tok/s "
            "| ratio |", "|---|---|---|---|---|---|---|---|", *rows]


def emulation_tokens_lines(check: dict[str, Any]) -> list[str]:
    lines = [f"`emulation.json` on {check['device']}: {check['model']}; {check['steps']} greedy tokens for each of "
             f"{check['prompts']} prompts in one batch, with device graphs, against the {check['reference']} "
             "backend's on the same weights (float32 must be equal; bfloat16 is reported).", "",
             f"| backend | dtype | prompts equal to {check['reference']}'s | equal prefix of each | attention | graphs |",
             "|---|---|---|---|---|---|"]
    for r in check["results"]:
        lines.append(f"| {r['backend']} | {r['dtype']} | {r['equal']} of {check['prompts']} "
                     f"| {', '.join(map(str, r['prefixes']))} | {r['attention']} | {'yes' if r['graphs'] else 'no'} |")
    return lines
