"""The scale-out parts of a benchmark page: all-reduce latency (``allreduce_bench.py``'s JSON), the
fp32 token checks (``scaleout.sh``'s ``tokens.json``) and each multi-rank offline run against the
one-rank run of the same model, batch and dtype (the one whose file name ends most like its own)."""

from pathlib import Path
from typing import Any


def allreduce_lines(r: dict[str, Any]) -> list[str]:
    """The table of ``allreduce_bench.py``'s rows: bytes, then microseconds and correctness of each path it timed
    (keys ``<path>_us`` and ``<path>_correct``: the process group's collective library, and ``fast``)."""
    paths = [k.removesuffix("_us") for k in r["rows"][0] if k.endswith("_us")]
    label = {p: "fast path" if p == "fast" else p.upper() for p in paths}
    lines = [f"{r['world_size']} ranks on {r['device']}, bf16, microseconds per call (median of graph replays of 50 "
             "calls; each size first checked against the exact sum)", "",
             "| bytes | " + " | ".join(f"{label[p]} us" for p in paths) + " | fast path taken | all correct |",
             "|---|" + "---|" * (len(paths) + 2)]
    for x in r["rows"]:
        lines.append(f"| {x['bytes']} | " + " | ".join(str(x[f"{p}_us"]) for p in paths)
                     + f" | {x['fast_path']} | {all(x[f'{p}_correct'] for p in paths)} |")
    if r.get("boundary"):
        lines += ["", "The layer boundary (contract 1.5: all-reduce + residual add + RMSNorm) on bf16 [rows, 4096]: the "
                  "fast all-reduce then `fused_add_rms_norm` (composed), and the backend's one-kernel `add_rms_norm`; "
                  "the two outputs checked bit for bit against each other.", "",
                  "| rows | composed us | one kernel us | one kernel taken | bitwise equal |", "|---|---|---|---|---|"]
        lines += [f"| {x['rows']} | {x['composed_us']} | {x['fused_us']} | {x['fused']} | {x['equal']} |" for x in r["boundary"]]
    if r.get("linear"):
        lines += ["", "The row-parallel linear at batch 1 with its all-reduce and residual add (contract 1.13) "
                  "at one rank's share of Llama-3.1-8B's projections (bf16, one row; outputs x inputs): `linear`, "
                  "the fast all-reduce and the add (composed), and the backend's one-kernel `linear_add`; each "
                  "against float64 (NMSE), and the largest difference between the two.", "",
                  "| shape | composed us | one kernel us | one kernel taken | NMSE composed | NMSE one kernel | "
                  "largest difference |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {x['name']} {x['n']}x{x['k']} | {x['composed_us']} | {x['fused_us']} | {x['fused']} | "
                  f"{x['composed_nmse']:.2e} | {_sci(x['fused_nmse'])} | {x['max_diff']} |" for x in r["linear"]]
    return lines


def _sci(v) -> str:
    return "-" if v is None else f"{v:.2e}"


def cpu_experts_lines(r: dict[str, Any]) -> list[str]:
    """``cpu_experts_check.py``'s JSON: the token checks of each variant and the decode speeds."""
    lines = []
    for key in ("small", "big"):
        v = r[key]
        p = v["placement"]
        same = sum(x["identical"] for x in v["prompts"])
        ties = sum(bool(x.get("near_tie")) for x in v["prompts"])
        lines.append(f"- {v['config']} {v['dtype']}, `cpu_experts={v['cpu_experts']}` ({p['layers_on_cpu']} of "
                     f"{p['moe_layers']} MoE layers' experts on the host, {p['host_gb']} GB there): greedy tokens "
                     f"identical to all on the device for {same} of {len(v['prompts'])} prompts"
                     + (f", {ties} parting at a near-tie (margin < {r['near_tie']})" if ties else "")
                     + f": {'ok' if v['ok'] else 'FAILED'}")
    speed = r["big"]["speed"]
    batches = list(next(iter(speed.values())))
    lines += ["", f"Decode tok/s, {r['big']['config']} {r['big']['dtype']} on {r['device']} "
              f"({r['big']['torch_threads']} CPU threads):", "",
              "| run | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
    lines += [f"| {name} | " + " | ".join(f"{v[b]:.1f}" for b in batches) + " |" for name, v in speed.items()]
    return lines


def _layout(r: dict[str, Any]) -> str:
    ranks = r.get("floor_ranks") or []
    tp = len({g["tp_rank"] for g in ranks}) or 1
    pp = len({g["pp_rank"] for g in ranks}) or 1
    return f"{len(ranks) or 1} ranks (tp {tp} x pp {pp})"


def _suffix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def scaling_table(offline: list[tuple[str, dict[str, Any]]]) -> list[str]:
    singles = [(n, r) for n, r in offline if not r.get("floor_ranks")]
    lines = ["| run | layout | model | batch | decode tok/s | one-rank run | its decode tok/s | speedup | of its floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in offline:
        if not r.get("floor_ranks") or name.endswith("-total"):  # a "-total" run is the serve table's reference
            continue
        same = [(n, s) for n, s in singles if (Path(s["model"]).name, s["batch_size"], s["dtype"])
                == (Path(r["model"]).name, r["batch_size"], r["dtype"])]
        if not same:
            continue
        base_name, base = max(same, key=lambda ns: _suffix(ns[0], name))
        speedup = r["decode_tok_per_s"] / base["decode_tok_per_s"]
        lines.append(f"| {name} | {_layout(r)} | {Path(r['model']).name} | {r['batch_size']} | {r['decode_tok_per_s']:.1f} "
                     f"| {base_name} | {base['decode_tok_per_s']:.1f} | {speedup:.2f}x | {100 * r['floor_fraction']:.1f}% |")
    return lines


def tokens_line(checks: dict[str, bool]) -> str:
    return ("fp32 greedy tokens of `plugins/nvidia/scripts/tp_check.py` (three prompts, 24 tokens each): "
            + ", ".join(f"{k}: {'equal' if v else 'DIFFERENT'}" for k, v in checks.items()) + ".")
