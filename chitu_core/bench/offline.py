"""``python -m chitu_core.bench offline``: throughput and step times of one fixed batch.

B random prompts of exactly I token ids go to the engine at once and each
generates O tokens (ignore_eos). The benchmark drives ``engine.step()`` itself
and times every step with ``perf_counter``; under ``profile_steps`` the runner
syncs the device after the forward and reports its time in
``runner.last_forward_seconds``. The step that gives the last request its first
token ends the prefill; the steps after it are decode steps. A step's time
outside the forward is everything else the engine does in it: scheduling,
building the inputs, sampling, the host copy, bookkeeping and detokenization.
"""

import argparse
import gc
import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from chitu_core.bench import peer_llamacpp
from chitu_core.bench.floor import (RoutedExperts, aggregate_floor, copy_bandwidth, decode_kv_bytes, gather_floors,
                                    parameter_count, weight_bytes_read)
from chitu_core.bench.peer import choose_peer, run_hf
from chitu_core.distributed.pipeline import micro_batches
from chitu_core.engine.llm import LLM
from chitu_core.loader.gguf import default_model_file, resolve_model
from chitu_core.loader.hf import open_model_dir
from chitu_core.plugins.discovery import get_backend
from chitu_core.sampling.params import SamplingParams


PEER_NAMES = {"none": None, "hf": "transformers", "llama.cpp": peer_llamacpp.NAME}


@dataclass
class StepTime:
    wall_s: float
    forward_s: float


@dataclass
class BatchRun:
    steps: list[StepTime]
    prefill_steps: int  # steps until every request had its first token
    prefill_s: float  # from adding the requests to the end of the last prefill step
    prefill_tokens: int  # output tokens out by then (B, unless some requests decoded meanwhile)
    total_s: float
    output_tokens: int


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> BatchRun:
    """Run the prompts to completion, one timed step at a time."""
    engine = llm.engine
    start = time.perf_counter()
    seqs = [engine.add_request(f"{tag}-{i}", p, params.model_copy(update={"seed": i})).seqs[0] for i, p in enumerate(prompts)]
    steps: list[StepTime] = []
    prefill_steps, prefill_end, prefill_tokens = 0, start, 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        steps.append(StepTime(t1 - t0, engine.runner.last_forward_seconds))
        if not prefill_steps and all(s.output_token_ids for s in seqs):
            prefill_steps, prefill_end = len(steps), t1
            prefill_tokens = sum(len(s.output_token_ids) for s in seqs)
    end = time.perf_counter()
    output_tokens = sum(len(s.output_token_ids) for s in seqs)
    return BatchRun(steps, prefill_steps, prefill_end - start, prefill_tokens, end - start, output_tokens)


def _outside_share(steps: list[StepTime]) -> float:
    wall = sum(s.wall_s for s in steps)
    return max(0.0, wall - sum(s.forward_s for s in steps)) / wall if wall else 0.0


def _floor(engine, batch: int, input_len: int, output_len: int, routed_bytes: float | None = None,
           all_expert_bytes: int = 0) -> dict[str, Any]:
    """Bytes a mean decode step must read and the floor they set at the bandwidth measured now. For a
    MoE model, ``routed_bytes`` (the experts a decode step's tokens were routed to, from an eager run)
    replaces the ``all_expert_bytes`` of every routed expert."""
    # This rank's device: synchronize() alone would wait on device 0, and time only the launches elsewhere.
    bandwidth = copy_bandwidth(engine.device, lambda: engine.backend.synchronize(engine.device_index))
    weights = weight_bytes_read(engine.model)
    moe = {}
    if routed_bytes is not None:
        weights = weights - all_expert_bytes + round(routed_bytes)
        moe = {"expert_bytes_all": all_expert_bytes, "expert_bytes_routed_mean": round(routed_bytes)}
    cached_layers = sum(c.numel() > 0 for c in engine.runner.kv_caches)  # a pipeline stage's own layers
    per_token = engine.attention.bytes_per_block() * cached_layers // engine.attention.block_size
    kv = decode_kv_bytes(per_token, batch, input_len, output_len)
    step_s = (weights + kv) / bandwidth
    return {"copy_gbps": round(bandwidth / 1e9, 1), "weight_bytes": weights, "kv_bytes_mean": round(kv), **moe,
            "step_ms": round(step_s * 1e3, 4), "decode_tok_per_s": round(batch / step_s, 3)}


def routed_expert_bytes(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int] | None:
    """For a MoE model: the mean bytes of routed experts a decode step of these prompts reads (from one
    more run, eager, so that the routing can be observed), and the bytes of all routed experts."""
    engine = llm.engine
    routed = RoutedExperts(engine.model)
    if not routed:
        return None
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        with routed:
            run_batch(llm, prompts, params, "routing")
    finally:
        engine.runner.graphs = graphs
    return routed.bytes_per_step(len(prompts)), routed.all_expert_bytes()


def _measure(run: BatchRun, batch: int, input_len: int) -> dict[str, Any]:
    decode = run.steps[run.prefill_steps:]
    decode_s = run.total_s - run.prefill_s
    ms = [s.wall_s * 1e3 for s in decode]
    profiled = any(s.forward_s for s in run.steps)
    return {
        "output_tokens": run.output_tokens,
        "num_steps": len(run.steps),
        "prefill_steps": run.prefill_steps,
        "decode_steps": len(decode),
        "total_s": round(run.total_s, 6),
        "output_tok_per_s": round(run.output_tokens / run.total_s, 3),
        "prefill_s": round(run.prefill_s, 6),
        "prefill_tok_per_s": round(batch * input_len / run.prefill_s, 3),
        "decode_s": round(decode_s, 6),
        "decode_tok_per_s": round((run.output_tokens - run.prefill_tokens) / decode_s, 3) if decode else None,
        "decode_step_mean_ms": round(statistics.fmean(ms), 4) if ms else None,
        "decode_step_median_ms": round(statistics.median(ms), 4) if ms else None,
        "decode_forward_mean_ms": round(statistics.fmean(s.forward_s * 1e3 for s in decode), 4) if decode and profiled else None,
        "outside_forward_share": round(_outside_share(run.steps), 4) if profiled else None,
        "decode_outside_forward_share": round(_outside_share(decode), 4) if decode and profiled else None,
    }


def run_offline(args: argparse.Namespace) -> dict[str, Any] | None:
    """Load the model (an HF directory or a GGUF file; none: the embedded default's GGUF), warm up, run
    the measured batch ``--runs`` times and report the run of median decode rate (what --json prints).
    Then the peer, on the same prompts: ``--peer hf`` transformers, as ``peer.choose_peer`` decides for a
    quantized run; ``--peer llama.cpp`` llama.cpp on the same GGUF file at batch 1 (``peer_llamacpp``).
    Where the peer cannot run: ``peer: null`` and ``peer_unavailable``, the reason. With ``--load-format
    dummy`` ours and transformers draw random weights on the device from config.json alone, each its
    own: only speed compares. Under torchrun every rank runs the batch and measures its own floor; rank
    0 returns the report (with ``floor_ranks``), the others None."""
    dummy = args.load_format == "dummy"
    model = args.model or str(default_model_file())
    # The directory the engine reads: a GGUF converted (cached) as the engine converts it, anything else as is.
    model_dir = resolve_model(model, keep_quantized="gguf" in get_backend(args.device).quant_methods())
    hf = open_model_dir(model_dir, require_weights=not dummy).config
    llm = LLM(
        model, device=args.device, dtype=args.dtype, load_format=args.load_format, load_progress=False,
        profile_steps=args.profile, max_model_len=args.input_len + args.output_len, max_num_seqs=max(args.batch_size, 1),
        num_threads=args.threads, enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
        compile_forward=args.compile_forward,
        quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
    )
    engine = llm.engine
    B, I, O = args.batch_size, args.input_len, args.output_len
    params = SamplingParams(max_tokens=O, temperature=args.temperature, ignore_eos=True)
    # Other prompts for the warm-up, so that the measured prefill finds nothing in the prefix cache.
    warm_prompts = random_prompts(B, I, engine.vocab_size, args.seed + 1)
    for w in range(args.warmup):
        run_batch(llm, warm_prompts, params.model_copy(update={"max_tokens": min(O, 4)}), f"warmup{w}")
    measured = []
    for r in range(args.runs):
        prompts = random_prompts(B, I, engine.vocab_size, args.seed + 100 * r)
        measured.append(_measure(run_batch(llm, prompts, params, f"bench{r}"), B, I))
    rates = [m["decode_tok_per_s"] or m["output_tok_per_s"] for m in measured]
    median = sorted(range(len(measured)), key=lambda i: rates[i])[len(measured) // 2]
    report = {
        "model": model,
        "architecture": hf.architectures[0],
        "load_format": args.load_format,
        "model_config": {
            "num_hidden_layers": hf.num_hidden_layers, "hidden_size": hf.hidden_size,
            "intermediate_size": hf.intermediate_size, "num_attention_heads": hf.num_attention_heads,
            "num_key_value_heads": hf.num_key_value_heads, "vocab_size": hf.vocab_size,
            "num_parameters": parameter_count(engine.model),
        },
        "backend": engine.backend.name,
        # a backend in a documented emulation mode (its kernel configuration on another vendor's device)
        "emulated": bool(getattr(engine.backend, "emulated", lambda: False)()),
        "device": str(engine.device),
        "device_name": engine.backend.device_name(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.quant.describe(),
        "threads": torch.get_num_threads(),
        "graphs": engine.runner.graphs is not None,
        "compile_forward": args.compile_forward,
        "async_scheduling": engine.async_scheduling,
        "batch_size": B, "input_len": I, "output_len": O, "temperature": args.temperature, "warmup": args.warmup,
        "input_tokens": B * I,
        "runs": args.runs,
        **measured[median],
        "runs_decode_tok_per_s": [m["decode_tok_per_s"] for m in measured],
    }
    moe = routed_expert_bytes(llm, random_prompts(B, I, engine.vocab_size, args.seed + 100 * median), params)
    floor = _floor(engine, B, I, O, *(moe or ()))
    parallel = engine.parallel
    if parallel.world.world_size > 1:  # every rank measured its own; rank 0 reports them all
        floors = gather_floors(parallel, {"rank": parallel.world.rank, "tp_rank": parallel.tp_rank,
                                          "pp_rank": parallel.pp_rank, "device": str(engine.device), **floor})
        if floors is None:
            return None
        report["floor_ranks"] = floors
        floor = aggregate_floor(floors, B, len(micro_batches(B, parallel.pp_size, decode=True)))
    report["floor"] = floor
    if report["decode_tok_per_s"]:
        report["floor_fraction"] = round(report["decode_tok_per_s"] / floor["decode_tok_per_s"], 4)
    if args.peer == "none":
        return report
    name = PEER_NAMES[args.peer]
    report["peer_name"] = name
    device, dtype, backend, index = engine.device, engine.dtype, engine.backend, engine.device_index
    del engine, llm
    gc.collect()
    if parallel.world.world_size > 1:
        why = f"{name} runs on one device; this run has several ranks"
    elif args.peer == "llama.cpp":
        why = peer_llamacpp.missing() if peer_llamacpp.is_gguf(model) else peer_llamacpp.not_gguf_reason(model)
    else:
        choice = choose_peer(getattr(hf, "quantization_config", None), args.quantization, device, dtype, dummy)
        why = choice if isinstance(choice, str) else None
    if why is not None:
        report["peer"], report["peer_unavailable"] = None, why
        return report
    prompts = random_prompts(B, I, hf.vocab_size, args.seed)
    try:
        if args.peer == "llama.cpp":
            peer = peer_llamacpp.run_llamacpp(model, prompts, O, report["threads"], args.peer_runs)
        else:
            sync = lambda: backend.synchronize(index)  # noqa: E731
            peer = {"name": name, **run_hf(model_dir, device, dtype, prompts, O, args.peer_runs, sync, dummy=dummy,
                                           peer=choice, compile_batch_one=args.peer_mode == "fastest")}
    except Exception as exc:  # the peer's failure is reported, ours still stands
        peer = {"name": name, "mode": "failed", "error": f"{type(exc).__name__}: {exc}"[:500], "output_tok_per_s": None,
                "decode_tok_per_s": None}
    if peer["decode_tok_per_s"]:
        if args.peer == "hf":  # llama.cpp reads the file's quantized blocks, not the bytes our floor counts
            peer["floor_fraction"] = round(peer["decode_tok_per_s"] / floor["decode_tok_per_s"], 4)
        if report["decode_tok_per_s"]:
            report["speedup_over_peer"] = round(report["decode_tok_per_s"] / peer["decode_tok_per_s"], 3)
            if peer.get("batch_size", B) != B:  # llama.cpp's one sequence against each of ours
                report["per_sequence_speedup_over_peer"] = round(
                    report["decode_tok_per_s"] / B / peer["decode_tok_per_s"], 3)
    report["peer"] = peer
    return report


def render(r: dict[str, Any]) -> str:
    c = r["model_config"]
    lines = [
        f"model    {r['model']}: {r['architecture']}, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"heads {c['num_attention_heads']}/{c['num_key_value_heads']} kv, vocab {c['vocab_size']}, "
        f"{c['num_parameters'] / 1e6:.1f}M parameters" + (", dummy weights" if r.get("load_format") == "dummy" else ""),
        f"backend  {r['backend']} ({r['device']}{', emulated on ' + r['device_name'] if r.get('emulated') else ''}), "
        f"{r['dtype']}, {r['threads']} threads"
        + (", forward compiled" if r.get("compile_forward") else "")
        + (f", weights {r['quantization']}" if r.get("quantization", "unquantized") != "unquantized" else ""),
        f"batch    {r['batch_size']} x {r['input_len']} input tokens -> {r['output_len']} output tokens each, "
        f"temperature {r['temperature']}, {r['warmup']} warm-up run(s)",
        f"total    {r['total_s']:.3f} s for {r['output_tokens']} output tokens: {r['output_tok_per_s']:.1f} tok/s",
        f"prefill  {r['prefill_s']:.3f} s in {r['prefill_steps']} step(s): {r['prefill_tok_per_s']:.1f} input tok/s",
    ]
    if r["decode_steps"]:
        line = (f"decode   {r['decode_s']:.3f} s in {r['decode_steps']} steps: {r['decode_tok_per_s']:.1f} tok/s; "
                f"per step mean {r['decode_step_mean_ms']:.2f} ms, median {r['decode_step_median_ms']:.2f} ms")
        if r["decode_forward_mean_ms"] is not None:
            line += f" (forward {r['decode_forward_mean_ms']:.2f} ms)"
        lines.append(line + (f"; median of {r['runs']} runs {r['runs_decode_tok_per_s']}" if r["runs"] > 1 else ""))
    if r["outside_forward_share"] is not None:
        lines.append(f"outside the forward: {r['outside_forward_share']:.1%} of step time"
                     + (f" ({r['decode_outside_forward_share']:.1%} in decode steps)" if r["decode_steps"] else ""))
    f = r["floor"]
    line = (f"floor    {f['step_ms']:.3f} ms a decode step = {f['decode_tok_per_s']:.1f} tok/s: "
            f"{f['weight_bytes'] / 1e9:.3f} GB weights + {f['kv_bytes_mean'] / 1e9:.3f} GB KV at {f['copy_gbps']:.0f} GB/s copy")
    if "expert_bytes_routed_mean" in f:
        line += (f" (weights count the routed experts' {f['expert_bytes_routed_mean'] / 1e9:.3f} GB a step, "
                 f"of {f['expert_bytes_all'] / 1e9:.3f} GB of experts)")
    if "floor_fraction" in r:
        line += f"; this run {r['floor_fraction']:.1%} of it"
    lines.append(line)
    if "floor_ranks" in r:
        lines[-1] += " (all ranks: the slowest of each pipeline stage, the stages in turn)"
        lines += [f"  rank {g['rank']} ({g['device']}, tp {g['tp_rank']}, pp {g['pp_rank']}): {g['step_ms']:.3f} ms = "
                  f"{g['weight_bytes'] / 1e9:.3f} GB weights + {g['kv_bytes_mean'] / 1e9:.3f} GB KV at "
                  f"{g['copy_gbps']:.0f} GB/s" for g in r["floor_ranks"]]
    if "peer" in r:
        lines.append(_peer_line(r))
    return "\n".join(lines)


def _peer_line(r: dict[str, Any]) -> str:
    p = r["peer"]
    name = (p or {}).get("name") or r.get("peer_name", "transformers")  # reports older than the name say transformers
    if p is None:
        return f"peer     {name} not run: {r['peer_unavailable']}"
    if p["mode"] == "failed":
        return f"peer     {name} failed: {p['error']}"
    line = f"peer     {name} ({p['mode']}): {p['output_tok_per_s']:.1f} tok/s in all"
    if p["decode_tok_per_s"]:
        line += f", decode {p['decode_tok_per_s']:.1f} tok/s"
        if "floor_fraction" in p:
            line += f" ({p['floor_fraction']:.1%} of the floor)"
    if "speedup_over_peer" in r:
        line += f"; chitu/{name} decode {r['speedup_over_peer']:.2f}x"
    if "per_sequence_speedup_over_peer" in r:
        line += (f" (chitu's batch of {r['batch_size']} in all against {name}'s one sequence; "
                 f"per sequence {r['per_sequence_speedup_over_peer']:.2f}x)")
    if p.get("weights") == "own random":
        line += f"; weights differ ({name} drew its own): speed only"
    elif p.get("weights", "checkpoint") != "checkpoint":  # llama.cpp: what it made of the file
        line += f"; {name} on {p['weights']}"
    return line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model directory or GGUF file (default: the embedded SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--device", default="auto", help="backend name, or auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights drawn on the device from config.json alone (a directory from "
                        "`random-model --config-only`); with --peer hf, transformers draws its own")
    parser.add_argument("--quantization", default=None, choices=["fp8", "int8", "int4"],
                        help="quantize the 16-bit (or dummy) weights while loading (quantized checkpoints need no flag)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts in the batch (B)")
    parser.add_argument("--input-len", type=int, default=128, help="tokens per prompt (I)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (O)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up runs of the same batch shape, 4 tokens each")
    parser.add_argument("--threads", type=int, default=None, help="host threads (default: the backend's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random prompts")
    parser.add_argument("--runs", type=int, default=1, help="measured runs; the report shows the one of median decode rate")
    parser.add_argument("--peer", choices=list(PEER_NAMES), default="none",
                        help="hf: also run transformers on the same model, device and prompts, and compare "
                        "(quantized: as transformers runs the format, or a line saying why not; docs/quantization.md); "
                        "llama.cpp: llama.cpp on the same GGUF file, the first prompt at batch 1, on --threads "
                        "host threads (needs llama-cpp-python: pip install 'chitu-core[bench-llamacpp]')")
    parser.add_argument("--peer-runs", type=int, default=1, help="measured runs of the peer (median)")
    parser.add_argument("--peer-mode", choices=("fastest", "eager"), default="fastest",
                        help="hf: fastest = its fastest mode for the batch (at batch 1 a static cache, which generate "
                        "compiles); eager = eager generate with its dynamic cache at every batch (how transformers runs "
                        "by default); the report names the mode")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="time each step's forward (one more device sync a step)")
    parser.add_argument("--enforce-eager", action="store_true", help="no decode graphs")
    parser.add_argument("--compile-forward", action="store_true",
                        help="compile the model's forward with the backend's compiler (CPU: torch.compile) before measuring")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="launch each decode step before the host has the previous one's tokens (default: on)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="ranks a pipeline stage (under torchrun; default: the world over the stages)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages (under torchrun)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE: each tensor-parallel rank holds whole routed experts (1/tp of them)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    for name in ("batch_size", "input_len", "output_len", "runs", "peer_runs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    report = run_offline(args)
    if report is not None:  # None on the ranks other than 0 under torchrun
        print(json.dumps(report) if args.json else render(report), flush=True)
    if torch.distributed.is_initialized():  # under torchrun: leave together, so that no rank sees another vanish
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0
