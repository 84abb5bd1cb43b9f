"""GPU check of CPU experts (``cpu_experts``): the routed experts of some layers in host memory, run by the
CPU backend's ops on a worker thread, while attention, routers and shared experts run on the GPU.

Each variant starts from random weights (load_format="dummy") and is compared with the same engine after
its host experts are moved onto the GPU, so that both runs read the very same weights (dummy weights are
drawn per device: a second engine would get other values for the host-held tensors):

  (a) a small config (tiny-mixtral, float32), every layer's experts on the CPU: greedy tokens must be
      identical to the all-GPU run;
  (b) DeepSeek-V2-Lite's config in bfloat16, the experts of the second half of the layers on the CPU
      (14-26: 13 of the 26 MoE layers, about 14 GB of host memory): greedy tokens against the all-GPU
      run; where they part, the first divergence and the all-GPU run's logit margin there (its token's
      logit less the CPU run's token's logit) are reported, and a margin below NEAR_TIE counts as a
      near-tie (bfloat16 rounds differently on the two devices), not a failure;
  (c) decode tokens/s at batch 1 and 8: CPU experts (eager: decode graphs cannot hold host work), the
      same engine with every expert on the GPU (eager), and a fresh all-GPU engine with decode graphs.
      Decode tok/s = batch * (output_len - 1) / (time of output_len tokens - time of one token).

Run on the lent machine from the repository root, after installing as gpu_bench.sh does:
    python plugins/nvidia/scripts/cpu_experts_check.py --out /tmp/cpu_experts.json
Prints a short table and one JSON line last; writes the JSON to --out (default $OUT/cpu_experts_check.json);
exits 1 if (a) or (b) fails. ``--device cpu --like tiny-mixtral`` runs it anywhere (a smoke test).
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

NEAR_TIE = 0.05  # logits of dummy weights have std ~0.58; bfloat16 resolution there is ~0.004
PROMPT_LEN, NEW_TOKENS, NUM_PROMPTS = 32, 24, 3
BATCHES, INPUT_LEN, OUTPUT_LEN = (1, 8), 128, 32


def model_dir(name: str, dtype: torch.dtype) -> str:
    from chitu_core.bench.random_model import write_config_only

    path = tempfile.mkdtemp(prefix=f"{name}-")
    write_config_only(name, Path(path), dtype)
    return path


def build(path: str, device: str, dtype: str, cpu_experts: str | None):
    from chitu_core import LLM

    return LLM(path, device=device, dtype=dtype, load_format="dummy", cpu_experts=cpu_experts, max_model_len=512,
               max_num_seqs=max(BATCHES), kv_cache_memory=2 << 30, enable_prefix_caching=False, load_progress=False)


def moe_layers(llm) -> list:
    return [m for m in llm.engine.model.modules() if type(m).__name__ == "FusedMoE"]


def placement(llm) -> dict:
    def gb(params) -> float:
        return sum(p.numel() * p.element_size() for p in params) / 1e9

    params = list(llm.engine.model.parameters())
    host = [p for p in params if p.device.type == "cpu"]
    return {"layers_on_cpu": sum(m.host is not None for m in moe_layers(llm)), "moe_layers": len(moe_layers(llm)),
            "host_gb": round(gb(host), 2), "device_gb": round(gb(params) - gb(host), 2),
            "graphs": llm.engine.runner.graphs is not None}


def experts_to_device(llm) -> None:
    """Move every host-held expert tensor onto the engine's device: the layers then run as all-GPU ones."""
    for moe in moe_layers(llm):
        if moe.host is not None:
            for param in moe.parameters(recurse=False):
                param.data = param.data.to(llm.engine.device)
            moe.host = None


def greedy_with_logits(llm, prompts) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Each prompt alone (batch 1): its greedy tokens and the logits each token was chosen from."""
    from chitu_core import SamplingParams

    model, out = llm.engine.model, []
    compute_logits, logits = model.compute_logits, []
    model.compute_logits = lambda h: (x := compute_logits(h), logits.append(x[-1].float().cpu()))[0]
    for prompt in prompts:
        logits.clear()
        result = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        tokens = result[0].outputs[0].token_ids
        out.append((tokens, logits[: len(tokens)]))
    model.compute_logits = compute_logits
    return out


def compare(reference, got) -> list[dict]:
    """Per prompt: identical, or the first divergence with the reference's logit margin there."""
    rows = []
    for (ref_tokens, ref_logits), (tokens, _) in zip(reference, got):
        step = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
        if step is None:
            rows.append({"identical": True})
            continue
        logits = ref_logits[step]
        margin = float(logits[ref_tokens[step]] - logits[tokens[step]])
        rows.append({"identical": False, "first_divergence": step, "gpu_token": ref_tokens[step],
                     "cpu_experts_token": tokens[step], "margin": margin, "near_tie": margin < NEAR_TIE})
    return rows


def decode_speed(llm, batch: int) -> float:
    from chitu_core import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(1, 500, (INPUT_LEN,), generator=gen).tolist()} for _ in range(batch)]

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    timed(4)  # warm-up
    return batch * (OUTPUT_LEN - 1) / (timed(OUTPUT_LEN) - timed(1))


def free(device: str) -> None:
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


def check(name: str, dtype: str, spec_of, device: str, speed: bool) -> dict:
    """One config: the CPU-experts run, then the same engine with every expert on the device."""
    path = model_dir(name, getattr(torch, dtype))
    num_layers = json.loads(Path(path, "config.json").read_text())["num_hidden_layers"]
    spec = spec_of(num_layers)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (PROMPT_LEN,), generator=gen).tolist() for _ in range(NUM_PROMPTS)]
    llm = build(path, device, dtype, spec)
    report = {"config": name, "dtype": dtype, "cpu_experts": spec, "placement": placement(llm),
              "torch_threads": torch.get_num_threads(), "speed": {}}
    print(f"{name} {dtype}: cpu_experts={spec}: {report['placement']}", flush=True)
    on_cpu = greedy_with_logits(llm, prompts)
    if speed:
        report["speed"]["cpu experts, eager"] = {b: decode_speed(llm, b) for b in BATCHES}
    experts_to_device(llm)
    on_gpu = greedy_with_logits(llm, prompts)
    if speed:
        report["speed"]["all on device, eager"] = {b: decode_speed(llm, b) for b in BATCHES}
    report["prompts"] = compare(on_gpu, on_cpu)
    del llm
    free(device)
    if speed:
        llm = build(path, device, dtype, None)
        report["speed"]["all on device, graphs" if placement(llm)["graphs"] else "all on device (new engine)"] = {
            b: decode_speed(llm, b) for b in BATCHES}
        del llm
        free(device)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "cpu_experts_check.json")
    parser.add_argument("--device", default="nvidia")
    parser.add_argument("--like", default="deepseek-v2-lite", help="the bfloat16 config of (b) and (c)")
    parser.add_argument("--small", default="tiny-mixtral", help="the float32 config of (a)")
    args = parser.parse_args()

    small = check(args.small, "float32", lambda n: "all", args.device, speed=False)
    small["ok"] = all(row["identical"] for row in small["prompts"])
    big = check(args.like, "bfloat16", lambda n: f"{n - n // 2}-{n - 1}", args.device, speed=True)
    big["ok"] = all(row["identical"] or row["near_tie"] for row in big["prompts"])
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    report = {"device": device, "near_tie": NEAR_TIE, "small": small, "big": big, "ok": small["ok"] and big["ok"]}
    args.out.write_text(json.dumps(report, indent=1))

    print(f"device: {device}; torch threads on the host: {big['torch_threads']}")
    for r in (small, big):
        print(f"{r['config']} {r['dtype']}, cpu_experts={r['cpu_experts']} ({r['placement']['layers_on_cpu']} of "
              f"{r['placement']['moe_layers']} MoE layers, {r['placement']['host_gb']} GB on the host, "
              f"{r['placement']['device_gb']} GB on the device): {'ok' if r['ok'] else 'FAIL'}")
        for i, row in enumerate(r["prompts"]):
            print(f"  prompt {i}: " + ("identical" if row["identical"] else
                  f"first divergence at token {row['first_divergence']} (gpu {row['gpu_token']}, cpu experts "
                  f"{row['cpu_experts_token']}), margin {row['margin']:.4f}"
                  f"{' (near-tie)' if row['near_tie'] else ' (NOT a near-tie)'}"))
    print(f"decode tok/s, {big['config']} {big['dtype']}, input {INPUT_LEN}, output {OUTPUT_LEN}")
    print("| run | " + " | ".join(f"batch {b}" for b in BATCHES) + " |")
    print("|---|" + "---|" * len(BATCHES))
    for run, speeds in big["speed"].items():
        print(f"| {run} | " + " | ".join(f"{speeds[b]:.1f}" for b in BATCHES) + " |")
    print(json.dumps({"ok": report["ok"], "small_ok": small["ok"], "big_ok": big["ok"], "speed": big["speed"]}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
