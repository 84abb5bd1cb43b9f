"""``python -m chitu_core.bench report DIR``: one markdown page from a directory of benchmark results.

DIR holds what the runs wrote (``plugins/nvidia/scripts/gpu_bench.sh`` writes them so):
``*.json`` from ``bench offline --json`` (recognised by their "floor"), ``serve-<placement>.json``
from ``bench serve --json`` (with ``--server-pid``, the server's peak memory under the table), ``gpu_check.json`` (model against transformers, decode profile), and
``conformance.md`` (and ``conformance-<name>.md``, other backends' or parts') from ``python -m
chitu_core.conformance --format md``, included as they are, ``emulation.json`` (emulation_check.py), and
``MADE_BY``, one line naming the script that made them (default: the GPU scripts), kernel sweeps' and
checks' outputs (``*_sweep*.txt``, ``*_check*.txt``: their tables), and ``agree.txt``
from ``bench agree`` (``agree-unpacked.txt`` from ``bench agree --unpacked``) and ``profile_step*.txt`` from
``plugins/nvidia/scripts/profile_step.py --out`` (graph-replayed steps: kernels, busy time, idle gaps),
included verbatim, and ``breakdown-*.json`` from ``bench profile --json`` (a decode step by module). Every
number on the page comes from those files; docs commit the page and the files together.
"""

import argparse
import json
from pathlib import Path
from typing import Any

from chitu_core.bench.report_backends import emulation_table, emulation_tokens_lines
from chitu_core.bench.report_kernels import (attention_sweep_lines, breakdown_lines, prefill_graphs_lines,
                                            quant_check_table)
from chitu_core.bench.report_scaleout import allreduce_lines, cpu_experts_lines, scaling_table, tokens_line
from chitu_core.bench.server_memory import render as render_memory


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def offline_table(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = ["| run | model | batch | in/out | decode tok/s (median of runs) | step ms | byte floor tok/s | of floor "
             "| peer decode tok/s | chitu / peer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs:
        f, p = r["floor"], r.get("peer") or {}
        model = Path(r["model"]).name
        peer = f"{_fmt(p.get('decode_tok_per_s'))} ({p.get('name', 'transformers')}: {p['mode']})" if p else "-"
        quant = (r.get("quantization") or "").split(" {")[0]  # "awq (in situ) {'group_size': 128}" -> "awq (in situ)"
        held = r["dtype"] + (f", {quant}" if quant and quant != "unquantized" else "")
        lines.append(
            f"| {name} | {model} ({r['model_config']['num_parameters'] / 1e6:.0f}M, {held}) | {r['batch_size']} "
            f"| {r['input_len']}/{r['output_len']} | {_fmt(r['decode_tok_per_s'])} ({', '.join(_fmt(x) for x in r['runs_decode_tok_per_s'])}) "
            f"| {_fmt(r['decode_step_median_ms'], '.2f')}{' (a group)' if _groups(f) else ''} "
            f"| {_fmt(f['decode_tok_per_s'])} ({_groups(f)}{f['weight_bytes'] / 1e9:.2f} GB + "
            f"{f['kv_bytes_mean'] / 1e9:.3f} GB at {f['copy_gbps']:.0f} GB/s) | {_fmt(100 * r.get('floor_fraction', 0), '.1f')}% "
            f"| {peer} | {_fmt(r.get('speedup_over_peer'), '.2f')}{'x' if r.get('speedup_over_peer') else ''} |")
    return lines


def _groups(floor: dict[str, Any]) -> str:
    """"2 x " where a pipeline's stages read their weights once per group in flight."""
    return f"{floor['groups']} x " if floor.get("groups", 1) > 1 else ""


def quant_check_lines(name: str, check: dict[str, Any]) -> list[str]:
    """A quantized model against its 16-bit self (``quant_moe_check.py``'s JSON): NMSE and decode speeds."""
    lines = [f"`{name}.json` on {check['device']}: last-token logits NMSE of the quantized model against the "
             f"16-bit one {check['nmse']:.2e} (bound {check['bound']:.2e}: {'ok' if check['ok'] else 'FAILED'}); "
             f"weights {', '.join(f'{k} {v:.1f} GB' for k, v in check['weight_gb'].items())}.", "",
             "| variant | batch | decode tok/s | step ms | byte floor tok/s | of floor |", "|---|---|---|---|---|---|"]
    for key, r in check["speed"].items():
        variant, batch = key.split(" B=")
        lines.append(f"| {variant} | {batch} | {_fmt(r['decode_tok_per_s'])} | {_fmt(r['step_ms'], '.2f')} | "
                     f"{_fmt(r['floor_tok_per_s'])} | {_fmt(100 * r['floor_fraction'], '.1f')}% |")
    return lines


def serve_table(serves: list[tuple[str, dict[str, Any]]], offline: dict[str, Any] | None) -> list[str]:
    base = offline["output_tok_per_s"] if offline else None
    lines = ["| engine placement | concurrency | client processes | requests | output tok/s | TTFT median ms "
             "| TPOT median ms | of offline (same batch, same run) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in serves:
        for x in r["results"]:
            share = f"{100 * x['output_tok_per_s'] / base:.1f}% of {base:.0f}" if base else "-"
            lines.append(f"| {name.removeprefix('serve-')} | {x['concurrency']} | {x.get('client_processes', 1)} "
                         f"| {x['completed']} of {r['input_len']}/{r['output_len']} | {x['output_tok_per_s']:.0f} "
                         f"| {_fmt((x['ttft_ms'] or {}).get('median'))} | {_fmt((x['tpot_ms'] or {}).get('median'), '.2f')} "
                         f"| {share} |")
    return lines


def model_table(check: dict[str, Any]) -> list[str]:
    """One row a reference dtype and prompt; where the check ran each prompt alone too (gpu_check.py since
    2026-11-29), its batch-1 decode steps' NMSE beside transformers bf16's on them."""
    decode = any("decode_nmse" in m for m in check["model_rows"])
    lines = ["| reference | prompt | last-token NMSE | teacher-forced steps not its argmax (over 1 bf16 ulp) "
             "| worst margin (ulps) | free-running equal prefix of 32 | its top-2 gap at the divergence (ulps) "
             "| ours in float32, NMSE | transformers bf16, NMSE |"
             + (" batch-1 decode steps 2-32, NMSE | transformers bf16 on them, NMSE |" if decode else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if decode else "")]
    for m in check["model_rows"]:
        gap = f"{m['divergence_gap']:.3g} ({m['divergence_gap_ulps']:.3g})" if "divergence_gap" in m else "-"
        lines.append(
            f"| transformers {m['dtype']} | {m['prompt_len']} | {m['last_logits_nmse']:.3g} | {m['forced_off']}/32 "
            f"({m['forced_off_over_ulp']}) | {m['worst_margin']:.3g} ({m['worst_margin_ulps']:.3g}) "
            f"| {m.get('equal_prefix', '-')} | {gap} | {_fmt(m.get('ours_fp32_nmse'), '.3g')} "
            f"| {_fmt(m.get('hf_bf16_nmse'), '.3g')} |"
            + (f" {_fmt(m.get('decode_nmse'), '.3g')} | {_fmt(m.get('hf_bf16_decode_nmse'), '.3g')} |" if decode else ""))
    return lines


def _parting(row: dict[str, Any]) -> str:
    if "gap_ulps" not in row:
        return ""
    sigmas = f", {row['gap_sigmas']:.1f}σ" if "gap_sigmas" in row else ""
    flips = ", bf16 flips too" if row.get("hf_bf16_flips") else ""
    routing = ""
    if row.get("routing_flips"):
        roots = row.get("routing_roots", row["routing_flips"])
        routing = f"; routing: {row['routing_flips']} flips, {row['routing_near_ties']} of {roots} roots near-ties"
        if row.get("routing_far_margins"):  # the others' margins, in sigmas of a difference (near-tie: <= 3)
            routing += " (others at " + ", ".join(f"{m:.1f}σ" for m in row["routing_far_margins"])
            if row.get("routing_far_errors"):  # our logits' error there, in sigmas of transformers-bf16's
                routing += "; our logits off by " + ", ".join(f"{e:.1f}σ" for e in row["routing_far_errors"])
            routing += ")"
        if row.get("routing_op_mismatches"):  # our routing op against float64 routing of our own logits
            routing += f"; {row['routing_op_mismatches']} positions routed otherwise than our logits say"
    elif "routing_flips" in row:
        routing = "; routing: no flip"
    return f" ({row['gap_ulps']:.2f}u{sigmas}{flips}{routing})"


def models_check_lines(results: list[dict[str, Any]]) -> list[str]:
    """Architectures in bfloat16 against transformers float32 (``plugins/nvidia/scripts/models_check.py``)."""
    lines = ["| architecture | ours bf16 NMSE (mean / median, prompts) | transformers bf16 NMSE | NMSE no worse "
             "| greedy: equal prefix of 64 "
             "(where they part: float32's top-2 gap in bf16 ulps, in sigmas of transformers-bf16's error; MoE: our "
             "routing flips against float64 on the shared tokens, and how many of those no earlier flip explains "
             "were near-ties) "
             "| transformers bf16: equal prefix | near-tie rule | batch of 16, fp32 / bf16 equal prefix | graphs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arch']} | error: {r['error'][:160]} | | | | | | | |")
            continue
        greedy = ", ".join(f"{x['equal_prefix']}" + _parting(x) for x in r["rows"])
        theirs = ", ".join(str(x["hf_bf16_equal_prefix"]) for x in r["rows"] if "hf_bf16_equal_prefix" in x) or "-"
        ours, theirs_nmse = f"{r['ours_nmse']:.3g}", f"{r['hf_bf16_nmse']:.3g}"
        if "ours_nmse_median" in r:  # since the median joined the mean (older pages: the mean of 32 prompts)
            ours += f" / {r['ours_nmse_median']:.3g}, {r['nmse_prompts']}"
            theirs_nmse += f" / {r['hf_bf16_nmse_median']:.3g}"
        j = r.get("nmse_judged")
        if j and j["prompts"] != r["nmse_prompts"]:  # MoE prompts left out of the verdict (models_check.judged_nmse)
            out = r["nmse_left_out"]
            ours = (f"{j['ours']:.3g} / {j['ours_median']:.3g}, {j['prompts']} of {r['nmse_prompts']} (all: {ours}; left "
                    f"out, last token routed otherwise than float64: ours {len(out['ours'])}, "
                    f"{r['nmse_left_out_explained']} of them near-ties; transformers bf16 {len(out['hf_bf16'])})")
            theirs_nmse = f"{j['hf_bf16']:.3g} / {j['hf_bf16_median']:.3g} (all: {theirs_nmse})"
        lines.append(f"| {r['arch']} | {ours} | {theirs_nmse} | {'yes' if r['nmse_ok'] else 'NO'} "
                     f"| {greedy} | {theirs} | {'ok' if r['greedy_ok'] else 'FAILED'} | {r['batch_fp32']} / {r['batch_bf16']} "
                     f"| {'yes' if r.get('graphs') else 'no'} |")
    return lines


def profile_lines(check: dict[str, Any]) -> list[str]:
    out = []
    for b in (1, 64):
        p = check.get(f"profile_b{b}")
        if p:
            top = ", ".join(f"`{k}` {v:.3f}" for k, v in p["top"])
            out.append(f"- batch {b}: {p['gpu_ms_per_step']:.2f} ms of GPU work a decode step, "
                       f"{p['launches_per_step']:.0f} kernels; the largest (ms a step): {top}")
    return out


def mla_inputs_lines(check: dict[str, Any]) -> list[str]:
    """``plugins/nvidia/scripts/mla_inputs_check.py``: a model's greedy tokens and step logits with and without
    contract 1.10's mla_inputs, prompt by prompt."""
    lines = [f"{check['device']}, `{check['config']}` with dummy weights in bfloat16, prompts decoded one at a time.", "",
             "| prompt | tokens equal | step logits NMSE, one path against the other | unfused top-2 gap where they part |",
             "|---|---|---|---|"]
    for i, r in enumerate(check["rows"]):
        gap = "-" if r["top2_gap_at_parting"] is None else f"{r['top2_gap_at_parting']:.3g}"
        lines.append(f"| {i} | {r['equal_tokens']} / {r['of']} | {r['step_logits_nmse']:.2e} | {gap} |")
    return lines


def render(directory: Path) -> str:
    files = sorted(directory.glob("*.json"))
    loaded = {f.stem: json.loads(f.read_text()) for f in files}
    offline = [(n, r) for n, r in loaded.items() if "floor" in r]
    serves = [(n, r) for n, r in loaded.items() if n.startswith("serve-") and "results" in r]
    check = loaded.get("gpu_check")
    head = f"# Benchmarks: {directory.name}"
    made_by = (directory / "MADE_BY").read_text().strip() if (directory / "MADE_BY").is_file() else \
        "`plugins/nvidia/scripts/gpu_bench.sh` (or `scaleout.sh`, several GPUs) made them on the lent machine"
    lines = [head, "", f"Generated by `python -m chitu_core.bench report {directory.as_posix()}` from the files beside "
             f"this page; {made_by}.", ""]
    if check:
        lines += [f"Device: {check['device']}; {check['versions']}; device-to-device copy "
                  f"{check['copy_gbps']:.0f} GB/s (gpu_check). Each offline run measures its own copy bandwidth "
                  "for its floor.", ""]
    if offline:
        peers = sorted({(r.get("peer") or {}).get("name", "transformers") for _, r in offline if r.get("peer")})
        weights = sorted({"the GGUF file's own weights" if str(r["model"]).endswith(".gguf") else
                          "random weights of the named config (`bench random-model`)" for _, r in offline})
        lines += [f"## Offline decode against {' and '.join(peers) or 'the'} {'peer' if len(peers) < 2 else 'peers'} "
                  "and the byte floor", "",
                  f"{' and '.join(weights)[:1].upper()}{' and '.join(weights)[1:]}, greedy, ignore_eos; the floor is the "
                  "bytes a mean decode step reads (weights it multiplies with, plus the KV cache) over the copy "
                  "bandwidth measured in that run.", "", *offline_table(offline), ""]
    if emulated := emulation_table(offline):
        lines += ["## Backends in emulation against the device's own", "",
                  "A backend in its documented emulation mode (`CHITU_EMULATE=<name>`: its own kernel configuration, "
                  "its vendor checks skipped) on this device, against the device's own backend in the same session.", "",
                  *emulated, ""]
    if "emulation" in loaded:
        lines += ["## Greedy tokens in emulation (`plugins/nvidia/scripts/emulation_check.py`)", "",
                  *emulation_tokens_lines(loaded["emulation"]), ""]
    if len(scaling_table(offline)) > 2:  # a multi-rank run with its one-rank run beside it
        lines += ["## Several ranks against one", "",
                  "Each multi-rank run (torchrun, one process a GPU; its floor: every rank's own bytes over its own "
                  "bandwidth, the slowest rank of each pipeline stage, the stages in turn; where a pipeline's decode "
                  "batch ran as groups in flight, \"2 x\" in the floor, its slowest stage reading its weights once per "
                  "group) against the one-rank run of the same model and batch.", "", *scaling_table(offline), ""]
    if "tokens" in loaded:
        lines += [tokens_line(loaded["tokens"]), ""]
    if "allreduce" in loaded:
        lines += ["## All-reduce latency (`plugins/nvidia/scripts/allreduce_bench.py`)", "",
                  *allreduce_lines(loaded["allreduce"]), ""]
    for name in (n for n in loaded if n == "attention_sweep" or n.startswith("attention_sweep-")):
        which = "" if name == "attention_sweep" else f", `{name}.json`"
        lines += [f"## Decode attention by tile configuration (`plugins/nvidia/scripts/attention_sweep.py`{which})", "",
                  *attention_sweep_lines(loaded[name]), ""]
    if "cpu_experts" in loaded:
        lines += ["## MoE experts on the CPU (`plugins/nvidia/scripts/cpu_experts_check.py`)", "",
                  *cpu_experts_lines(loaded["cpu_experts"]), ""]
    if "quant_check" in loaded:
        lines += ["## Quantized in situ against the bf16 model (`plugins/nvidia/scripts/quant_check.py`)", "",
                  *quant_check_table(loaded["quant_check"]), ""]
    if "prefill_graphs_check" in loaded:
        lines += ["## Prefill steps in graphs (`plugins/nvidia/scripts/prefill_graphs_check.py`)", "",
                  *prefill_graphs_lines(loaded["prefill_graphs_check"]), ""]
    if serves:
        total = next((r for n, r in offline if n.endswith("-total")), None)
        lines += ["## Serving (`bench serve`) against offline", "", *serve_table(serves, total), ""]
        memory = [f"{name}: {render_memory(r['server_memory'])}." for name, r in serves if r.get("server_memory")]
        lines += [*memory, ""] if memory else []
    if check and check.get("model_rows"):
        lines += ["## Llama-3.1-8B config, random weights, bfloat16, against transformers", "",
                  "Ours in bfloat16 against transformers on the same weights in bfloat16 and in float32 (its RoPE "
                  "frequencies kept in float32); the last two columns measure the implementation (ours in float32) "
                  "and bfloat16's own noise (transformers bfloat16) against transformers float32.", "",
                  *model_table(check), ""]
    for name, r in loaded.items():
        if name.endswith("models_check") and isinstance(r, list):
            lines += [f"## Architectures against transformers (`{name}.json`, `plugins/nvidia/scripts/models_check.py`)", "",
                      "Small random configs of each family, ours in bfloat16 against transformers float32 on the same "
                      "weights: last-token NMSE beside transformers' own bfloat16, its mean and median over 128 prompts, each no "
                      "worse (a mixture of experts: over the prompts whose last token both runs routed as float64 does, the "
                      "others counted and each of ours following from routing near-ties; older files: over all prompts, or the "
                      "mean of 32 prompts, or of 8); 64 greedy "
                      "tokens a prompt, equal or parting at a near-tie (docs/writing-a-model.md: float32's top-2 gap within 2 bf16 "
                      "ulps or 3 sigmas of transformers-bf16's error, or transformers-bf16 ranks them otherwise too; older files "
                      "hold the ulps alone); one prompt alone against inside a batch of 16.", "", *models_check_lines(r), ""]
    for name, r in loaded.items():
        if name.startswith("breakdown") and "rows" in r:
            lines += [f"## Decode step by module (`{name}.json`, `python -m chitu_core.bench profile`)", "",
                      "Eager decode steps under torch.profiler: each module's own kernel time (its nested modules' "
                      "taken out), its share of the step, the bytes it must read a step and the bandwidth that makes.",
                      "", *breakdown_lines(r), ""]
    if check and profile_lines(check):
        lines += ["## Decode profile (torch.profiler, graphs replayed)", "", *profile_lines(check), ""]
    if "mla_inputs_check" in loaded:
        lines += ["## Latent attention with and without `mla_inputs` (`plugins/nvidia/scripts/mla_inputs_check.py`)", "",
                  *mla_inputs_lines(loaded["mla_inputs_check"]), ""]
    for name, r in loaded.items():
        if "speed" in r and "nmse" in r:
            lines += ["## Quantized against 16-bit (in situ, same random weights)", "", *quant_check_lines(name, r), ""]
    for sweep in sorted(directory.glob("*_sweep*.txt")):
        lines += _sweep(sweep, "Kernel sweep")
    for check in sorted(directory.glob("*_check*.txt")):
        lines += _sweep(check, "Check")
    for step in sorted(directory.glob("profile_step*.txt")):
        lines += _verbatim(f"## A profiled decode step (`plugins/nvidia/scripts/profile_step.py`, `{step.name}`)", step)
    for agree in sorted(directory.glob("agree*.txt"), key=lambda f: (f.name != "agree.txt", f.name)):  # then --unpacked
        flag = " --unpacked" if agree.stem.endswith("unpacked") else ""
        lines += _verbatim(f"## Greedy agreement with llama.cpp (`python -m chitu_core.bench agree{flag}`)", agree)
    for conformance in sorted(directory.glob("conformance*.md"), key=lambda f: (f.name != "conformance.md", f.name)):
        body = conformance.read_text().strip().splitlines()
        lines += [*("#" + line if line.startswith("#") else line for line in body), ""]
    return "\n".join(lines).rstrip() + "\n"


def _sweep(path: Path, kind: str) -> list[str]:
    """A kernel sweep's or a check's output (``plugins/nvidia/scripts/<name>.py``, saved as ``<name>[-tag].txt``)
    under a heading naming ``kind``, the script and the file: its device line and its markdown table as they
    are; an output without a table (``quant_sweep.py``'s lines), its text in a code block."""
    script = path.stem.split("-")[0]
    heading = f"## {kind} (`plugins/nvidia/scripts/{script}.py`, `{path.name}`)"
    text = path.read_text().rstrip().splitlines()
    table = [line for line in text if line.startswith("|")]
    if not table:
        return _verbatim(heading, path)
    device = [line for line in text if line.startswith("device")][:1]
    return [heading, "", *device, *([""] if device else []), *table, ""]


def _verbatim(heading: str, path: Path) -> list[str]:
    """A section of the page: ``heading``, then the file's text as it is, in a code block."""
    return [heading, "", "```", *path.read_text().rstrip().splitlines(), "```", ""]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="a directory of result files")
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    if not args.directory.is_dir():
        raise SystemExit(f"{args.directory}: no such directory")
    print(render(args.directory), end="")
    return 0
