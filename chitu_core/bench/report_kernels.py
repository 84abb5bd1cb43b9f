"""Report sections of kernel sweeps and checks run on the lent machines (``plugins/nvidia/scripts/*_sweep.py``,
``prefill_graphs_check.py``, ``quant_check.py``), and of a decode step by module (``bench profile``)."""

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
    quant = result.get("quantization", "unquantized")
    weights = "" if quant == "unquantized" else f", weights {quant}"
    lines = [f"{result['model']}, batch {result['batch']} after {result['input_len']} prompt tokens, {result['backend']} "
             f"{result['dtype']}{weights}: {result['step_us']:.1f} us of {result['time']} time a decode step "
             f"(mean of {result['steps']}), {result['other_us']:.1f} us of it outside the modules below.", "",
             "| module | kind | calls | us a step | share | MB a step | GB/s |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mb = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.2f}"
        gbps = "-" if r["gbps"] is None else f"{r['gbps']:.0f}"
        lines.append(f"| `{r['site']}` | {r['kind']} | {r['calls']:g} | {r['us']:.1f} | {r['share']:.1%} | {mb} | {gbps} |")
    return lines


def prefill_graphs_lines(check: dict[str, Any]) -> list[str]:
    """``plugins/nvidia/scripts/prefill_graphs_check.py``: greedy tokens with and without prefill graphs, and one
    prefill step's wall time, eager against replayed."""
    lines = [f"{check['device']}, torch {check['torch']}. Float32 greedy tokens (8 prompts of 3 to 262 tokens, 12 "
             "tokens each) with prefill graphs against without, whole prompts in one step and in chunks of 48 tokens "
             "beside decodes:", "", "| architecture | chunks | graphs on | equal sequences | largest logprob difference |",
             "|---|---|---|---|---|"]
    for r in check["tokens"]:
        lines.append(f"| {r['arch']} | {r['chunks'] or 'whole'} | {r['graphs_on']} | {r['equal']} / {r['of']} "
                     f"| {r['max_logprob_diff']:.2e} |")
    lines += ["", "One prefill step of n prompts of 128 tokens, Llama-3.1-8B config, dummy bfloat16 weights: wall ms "
              "from launch to its tokens on the host (median of 6):", "",
              "| prompts | tokens | eager ms | graph ms | eager / graph |", "|---|---|---|---|---|"]
    for r in check["steps"]:
        lines.append(f"| {r['requests']} | {r['tokens']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} "
                     f"| {r['eager_ms'] / r['graph_ms']:.2f}x |")
    return lines


def quant_check_table(check: dict[str, Any]) -> list[str]:
    """``quant_check.py``'s JSON: each in-situ method against the bf16 model (last-token logits NMSE of four
    prompts, greedy tokens equal before the first divergence), and the FP8 KV cache's blocks and tokens."""
    lines = ["| variant | method | weights GB | logits NMSE vs bf16 (bound) | greedy tokens equal before divergence "
             "(of 32, each prompt) | KV blocks |", "|---|---|---|---|---|---|",
             f"| bf16 | unquantized | {check['bf16']['weight_gb']:.2f} | - | - | {check['bf16']['blocks']} |"]
    for name in ("fp8", "int8", "int4"):
        if name in check:
            r = check[name]
            lines.append(f"| {name} | {r['quant']} | {r['weight_gb']:.2f} | {r['nmse']:.2e} ({r['bound']:g}: "
                         f"{'ok' if r['ok'] else 'FAILED'}) | {r['agree']} | - |")
    if "kv_fp8" in check:
        kv = check["kv_fp8"]
        tie = "divergences on near-ties" if kv["near_tie_ok"] else "a divergence off a near-tie: FAILED"
        lines.append(f"| fp8 KV cache | bf16 weights | - | {kv['nmse_first']:.2e} | {kv['agree']} ({tie}) | "
                     f"{kv['blocks']} ({kv['ratio']:.2f}x) |")
    return lines
