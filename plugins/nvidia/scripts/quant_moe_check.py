"""GPU check of FP8 routed experts (contract 1.3) on DeepSeek-V2-Lite's full-size config, in one run.

DeepSeek-V2-Lite's config (written out below) with random weights (load_format="dummy", the same seed
every time, so both variants start from the same bfloat16 weights), bfloat16 on one GPU:

  (a) correctness: in-situ fp8 (128x128 blocks: every linear and now every routed expert, through
      ``fused_experts_fp8``) against the model kept in bfloat16: last-token logits NMSE of four
      64-token prompts, with a bound;
  (b) speed: decode at batch 1 and 32 (input 128, output 256), bfloat16 and fp8, as the bench runs it
      (``chitu_core.bench.offline.run_offline``: warm-up, three runs, the median), each against the
      bench's byte floor (the weights a decode step reads, routed experts counted as routed, plus the
      KV cache, over the copy bandwidth measured in the same run).

Run on the lent machine from the repository root, after installing as gpu_bench.sh does:
    python plugins/nvidia/scripts/quant_moe_check.py
Writes quant_moe_check.json under $OUT (or here); prints a short table last; exits 1 if (a) fails.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "."))
STEPS, PROMPT_LEN = 16, 64
BATCHES, INPUT_LEN, OUTPUT_LEN = (1, 32), 128, 256
# Logits NMSE against bfloat16. Weights are uniform(-a, a) (load_format=dummy), whose e4m3 round-to-nearest
# error relative to their mean square is about (2**-4)**2 / 3 = 1.3e-3 (quant_check.py's count); 27 layers of
# attention, shared and routed experts, bounded by 32x that as quant_check.py bounds Llama-3.1-8B's 32 layers.
BOUND = 32 * 1.3e-3

DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite config.json (the fields the engine reads)
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
    "bos_token_id": 100000, "eos_token_id": 100001, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
}


def nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).square().sum() / want.square().sum())


def first_logits(path: str, prompts, quantization=None) -> dict:
    """Last-token logits of each prompt's prefill, and what the experts were held in."""
    from chitu_core import LLM, SamplingParams

    llm = LLM(path, device="nvidia", dtype="bfloat16", load_format="dummy", quantization=quantization,
              max_model_len=512, max_num_seqs=len(prompts), load_progress=False)
    model, logits = llm.engine.model, []
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: (out := compute_logits(h), logits.append(out.float().cpu()))[0]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0.0))
    experts = next(m for m in model.modules() if type(m).__name__ == "FusedMoE")
    result = dict(first=logits[0], experts=f"{experts.quant_method.name} {str(experts.w13.dtype)[6:]}",
                  weight_gb=sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
                  fallback=llm.engine.ops.fallbacks())
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def decode_speed(path: str, batch: int, quantization=None) -> dict:
    from chitu_core.bench.offline import run_offline

    args = argparse.Namespace(
        model=path, device="nvidia", dtype="bfloat16", load_format="dummy", batch_size=batch, input_len=INPUT_LEN,
        output_len=OUTPUT_LEN, temperature=0.0, warmup=1, runs=3, seed=0, profile=False, threads=None,
        enforce_eager=False, async_scheduling=True, quantization=quantization, peer="none", peer_runs=1)
    report = run_offline(args)
    gc.collect()
    torch.cuda.empty_cache()
    return {"decode_tok_per_s": report["decode_tok_per_s"], "floor_tok_per_s": report["floor"]["decode_tok_per_s"],
            "floor_fraction": report.get("floor_fraction"), "weight_bytes": report["floor"]["weight_bytes"],
            "step_ms": report["decode_step_median_ms"]}


def main() -> int:
    path = tempfile.mkdtemp(prefix="dsv2lite-")
    Path(path, "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 100000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(4)]
    ref, fp8 = first_logits(path, prompts), first_logits(path, prompts, "fp8")
    error = nmse(fp8["first"], ref["first"])
    report = {"device": torch.cuda.get_device_name(), "nmse": error, "bound": BOUND, "ok": error <= BOUND,
              "experts": {"bf16": ref["experts"], "fp8": fp8["experts"]},
              "weight_gb": {"bf16": ref["weight_gb"], "fp8": fp8["weight_gb"]}, "fallback": fp8["fallback"],
              "speed": {}}
    for batch in BATCHES:
        for name, quantization in (("bf16", None), ("fp8", "fp8")):
            report["speed"][f"{name} B={batch}"] = decode_speed(path, batch, quantization)
            print(f"{name} B={batch}: {report['speed'][f'{name} B={batch}']}", flush=True)
    (OUT / "quant_moe_check.json").write_text(json.dumps(report, indent=1))
    print(f"device: {report['device']}; experts: bf16 run {ref['experts']}, fp8 run {fp8['experts']}; "
          f"weights {ref['weight_gb']:.1f} -> {fp8['weight_gb']:.1f} GB; fallback ops (fp8): {fp8['fallback']}")
    print(f"(a) logits NMSE fp8 vs bf16: {error:.2e} (bound {BOUND:.2e}): {'ok' if error <= BOUND else 'FAIL'}")
    print(f"(b) decode, input {INPUT_LEN}, output {OUTPUT_LEN}")
    print("| variant | batch | decode tok/s | step ms | floor tok/s | of floor |")
    print("|---|---|---|---|---|---|")
    for key, r in report["speed"].items():
        name, batch = key.split(" B=")
        fraction = f"{r['floor_fraction']:.1%}" if r["floor_fraction"] is not None else "-"
        print(f"| {name} | {batch} | {r['decode_tok_per_s']:.1f} | {r['step_ms']:.2f} | {r['floor_tok_per_s']:.1f} | "
              f"{fraction} |")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
