"""Report sections of kernel sweeps run on the lent machines (``plugins/nvidia/scripts/*_sweep.py``), and of a
decode step by module (``bench profile``)."""

from typing import Any


def attention_sweep_lines(sweep: dict[str, Any]) -> list[str]:
    """``attention_sweep.py``'s JSON: decode attention per shape and tile configuration, against the byte
    floor of the keys and values a call reads."""
    lines = [f"{sweep['device']}, copy bandwidth {sweep['copy_gbps']:.0f} GB/s; bf16, head_dim 128, blocks of 16 "
             "tokens in scattered order, caches rotated past the L2 cache, graph replays.", "",
             "| shape | key tile KB | warps | key-loop stages | splits | us | floor us | of floor | agrees with the first |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sweep["rows"]:
        stages = r["stages"] if r["stages"] is not None else "default"
        lines.append(f"| {r['shape']} | {r['key_tile_kb']} | {r['warps']} | {stages} | {r['splits']} | {r['us']:.2f} "
                     f"| {r['floor_us']:.2f} | {100 * r['of_floor']:.0f}% | {'yes' if r['agrees'] else 'NO'} |")
    return lines


def breakdown_lines(result: dict[str, Any]) -> list[str]:
    """``bench profile --json``: a decode step's time by module, as a markdown table."""
    lines = [f"{result['model']}, batch {result['batch']} after {result['input_len']} prompt tokens, {result['backend']} "
             f"{result['dtype']}: {result['step_us']:.1f} us of {result['time']} time a decode step "
             f"(mean of {result['steps']}), {result['other_us']:.1f} us of it outside the modules below.", "",
             "| module | kind | calls | us a step | share | MB a step | GB/s |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mb = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.2f}"
        gbps = "-" if r["gbps"] is None else f"{r['gbps']:.0f}"
        lines.append(f"| `{r['site']}` | {r['kind']} | {r['calls']:g} | {r['us']:.1f} | {r['share']:.1%} | {mb} | {gbps} |")
    return lines
