"""GPU check of model architectures against transformers, in one run.

For each architecture a small random config of its own kind is made on the GPU in float32 with
transformers (``from_config``) and saved: the MoE and MLA ones (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2, DeepSeek-V3) from the configs below; any other installed architecture from its class's
``conformance_config()`` (its family's features: soft-capping, sliding windows, partial rotary, ...)
at the sizes below. Then, on those same weights:

  (a) ours in bfloat16 (LLM(device="nvidia")) against transformers in float32: last-token logits NMSE of
      ``NMSE_PROMPTS`` prompts, its mean and its median each no worse than transformers' own bfloat16
      against its float32 (``judged_nmse``). For a mixture of experts a prompt whose last token either
      run routed to other experts than float64 is left out of both sides and counted: a router near-tie
      switched a whole expert there, in one run or the other, and such a few set the mean whichever run
      they fall in (over 32 prompts its verdict changed between machines); each of ours must follow from
      routing near-ties (as in (b)). The means and medians over all prompts are reported too;
  (b) 64 greedy tokens of 8 prompts, ours (bf16) against transformers (float32): equal, or the first
      divergence falls on a near-tie (``near_tie``: within two bf16 ulps, within three sigmas of
      transformers-bf16's own error there, or transformers-bf16 ranks the two otherwise too), or, for a
      mixture-of-experts model, follows routing near-ties (``routing_ties``: our bf16 routing chose other
      experts than float64's along the shared tokens, each time within three sigmas of bf16 noise);
  (c) batching: a prompt's 64 greedy tokens alone and inside a batch of 16 mixed-length prompts, in float32
      (equal) and in bfloat16 (reported: the equal prefix; other batch shapes round differently).

Run on the lent machine from the repository root, after installing as gpu_bench.sh does:
    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/models_check.py [--out NAME] [ARCH ...]
ARCH: a model_type below or an installed architecture (Gemma2ForCausalLM, ...); default the MoE ones.
Writes NAME.json (default models_check) under $OUT; prints a table last.
"""

import gc
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import routing_ties  # noqa: E402

DEV = torch.device("cuda")
OUT = Path(os.environ.get("OUT", "."))
VOCAB, STEPS, NMSE_PROMPTS = 2048, 64, 128
COMMON = dict(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
CONFIGS = {
    "mixtral": dict(COMMON, num_key_value_heads=2, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(COMMON, num_key_value_heads=4, intermediate_size=1024, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=256, shared_expert_intermediate_size=512, norm_topk_prob=False,
                      mlp_only_layers=[0], decoder_sparse_step=1),
    "qwen3_moe": dict(COMMON, num_key_value_heads=4, head_dim=64, intermediate_size=1024, num_experts=32,
                      num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
                      mlp_only_layers=[], decoder_sparse_step=1),
    "deepseek_v2": dict(COMMON, num_key_value_heads=8, intermediate_size=1024, q_lora_rank=None, kv_lora_rank=128,
                        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=16,
                        num_experts_per_tok=4, moe_intermediate_size=256, n_shared_experts=2, first_k_dense_replace=1,
                        moe_layer_freq=1, topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
                        n_group=1, topk_group=1, rope_scaling=YARN),
    "deepseek_v3": dict(COMMON, num_key_value_heads=8, intermediate_size=1024, q_lora_rank=192, kv_lora_rank=128,
                        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=16,
                        num_experts_per_tok=4, moe_intermediate_size=256, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, n_group=4, topk_group=2, rope_scaling=YARN),
}


SIZES = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096)
"""A conformance_config() scaled to the MoE configs' size (its features kept)."""


def config_of(arch: str):
    """The HF config of a model_type in CONFIGS, or of an installed architecture's conformance_config()."""
    from transformers import AutoConfig

    if arch in CONFIGS:
        return AutoConfig.for_model(arch, **CONFIGS[arch])
    from chitu_core.plugins.discovery import load_model_class

    values = dict(load_model_class(arch).conformance_config(), **SIZES)
    if "layer_types" in values:  # one entry a layer, the declared pattern repeated
        pattern = values["layer_types"]
        values["layer_types"] = [pattern[i % len(pattern)] for i in range(SIZES["num_hidden_layers"])]
    return AutoConfig.for_model(values.pop("model_type"), **values)


def nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).square().sum() / want.square().sum())


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def equal_prefix(a: list[int], b: list[int]) -> int:
    same = [x == y for x, y in zip(a, b)]
    return same.index(False) if False in same else len(same)


def near_tie(fp32: torch.Tensor, bf16: torch.Tensor) -> dict:
    """Where our free run parts from transformers' float32 one (both teacher-forced on our tokens there):
    a near-tie when float32's top-2 gap is within two bf16 ulps of the top logit, or within three standard
    deviations of transformers' own bfloat16 error on a difference of two logits at that step (sqrt(2) times
    the RMS of its error over the vocabulary), or when transformers' bfloat16 itself ranks the two otherwise."""
    top2 = fp32.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    sigma = float((bf16 - fp32).square().mean().sqrt()) * 2 ** 0.5
    flips = int(bf16.argmax()) != int(top2.indices[0])
    ulps = gap / float(bf16_ulp(top2.values[0]))
    return dict(gap_ulps=ulps, gap_sigmas=gap / max(sigma, 1e-30), hf_bf16_flips=flips,
                near_tie=ulps <= 2.0 or gap <= 3 * sigma or flips)


def build(arch: str) -> tuple[object, Path]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = config_of(arch)
    # transformers' SDPA attention drops the logit cap (its Gemma 2 offered SDPA until 5.24): eager where capped
    eager = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **eager)
    for name, buf in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros at init; make it matter
            buf.copy_(torch.rand_like(buf) * 0.1)
    hf.eval()
    path = Path(tempfile.mkdtemp(prefix=f"{arch}-"))
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, path


def prefill_logits(path: Path, prompts: list[list[int]]) -> tuple[torch.Tensor, tuple | None]:
    """Ours (bf16, eager) last-token logits of each prompt, from the prefill steps' rows, in order; for a
    mixture-of-experts model also, from the same run, ``routing_ties.our_routing``'s (routing, layers,
    router logits) along each prompt, else None."""
    from chitu_core import LLM, SamplingParams
    from chitu_core.layers.moe import FusedMoE

    llm = LLM(str(path), device="nvidia", dtype="bfloat16", max_model_len=512, enforce_eager=True, load_progress=False)
    model, captured, routed = llm.engine.model, [], None
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: (out := compute_logits(h), captured.append(out.float().clone()))[0]
    if any(isinstance(m, FusedMoE) for m in model.modules()):
        routed = routing_ties.our_routing(llm, prompts)
    else:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()
    rows = torch.cat(captured)  # prefill steps in order (one row a prompt, each finishing on its first token)
    if rows.shape[0] != len(prompts):
        raise RuntimeError(f"captured {rows.shape[0]} logits rows for {len(prompts)} prompts")
    return rows, routed


def judged_nmse(prompts, ours, theirs, routed, fp32, bf16) -> dict:
    """The NMSE verdict's prompts and figures. A mixture-of-experts prompt whose last token our run, or
    transformers-bf16's, routed to other experts than float64 in some layer leaves the comparison: that
    token's logits then differ by a whole expert's output (a discrete switch, not the precision the NMSE
    measures), whichever run it falls in. It is counted instead, and each of ours must follow from
    routing near-ties only (``routing_ties.explain`` over the prompt: every root flip a near-tie)."""
    n = len(prompts)
    ours_out, theirs_out, explained = [], [], []
    if routed is not None:
        routing, layers, logits = routed
        for i, p in enumerate(prompts):
            last = len(p) - 1
            exact = routing_ties.own_routing(fp32, layers, i, last)  # float64's experts for the last token
            if not all(map(torch.equal, (r[last] for r in routing[i]), exact)):
                ours_out.append(i)
                judged = routing_ties.explain(routing[i], layers, fp32, bf16, i, len(p), logits[i])
                explained.append(judged["routing_explains"])
            if not all(map(torch.equal, routing_ties.own_routing(bf16, layers, i, last), exact)):
                theirs_out.append(i)
    kept = [i for i in range(n) if i not in ours_out and i not in theirs_out]
    if not kept:
        raise RuntimeError(f"every one of {n} prompts' last token was routed otherwise than float64 by ours or "
                           "transformers-bf16: no prompt is left to judge the NMSE on")
    o, t = [ours[i] for i in kept], [theirs[i] for i in kept]
    figures = dict(prompts=len(kept), ours=sum(o) / len(o), hf_bf16=sum(t) / len(t), ours_median=statistics.median(o),
                   hf_bf16_median=statistics.median(t))
    ok = (figures["ours"] <= figures["hf_bf16"] and figures["ours_median"] <= figures["hf_bf16_median"]
          and all(explained))
    return dict(nmse_judged=figures, nmse_left_out=dict(ours=ours_out, hf_bf16=theirs_out),
                nmse_left_out_explained=sum(explained), nmse_ok=ok)


def greedy_and_batching(path: Path, dtype: str, prompts: list[list[int]], batch_prompts: list[list[int]]) -> dict:
    """Ours (graphs as served): 64 greedy tokens of each prompt, and of batch_prompts[0] alone and in the batch."""
    from chitu_core import LLM, SamplingParams

    llm = LLM(str(path), device="nvidia", dtype=dtype, max_model_len=512, max_num_seqs=32, load_progress=False)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    alone = llm.generate([{"prompt_token_ids": batch_prompts[0]}], params)[0].outputs[0].token_ids
    batched = llm.generate([{"prompt_token_ids": p} for p in batch_prompts], params)[0].outputs[0].token_ids
    same = [a == b for a, b in zip(alone, batched)]
    info = dict(graphs=llm.engine.runner.graphs is not None, attention=llm.engine.attention.name,
                fallback=llm.engine.ops.fallbacks())
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return dict(outs=outs, batch_equal_prefix=same.index(False) if False in same else len(same), **info)


def check(arch: str) -> dict:
    hf, path = build(arch)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 33, 64, 80, 100, 128, 200)]
    batch_prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in torch.randint(3, 200, (16,), generator=g)]
    extra = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
             for n in torch.randint(3, 250, (NMSE_PROMPTS - len(prompts),), generator=g)]
    first, routed = prefill_logits(path, prompts + extra)  # NMSE over all; greedy runs the first 8
    mine = greedy_and_batching(path, "bfloat16", prompts, batch_prompts)
    batch_fp32 = greedy_and_batching(path, "float32", prompts[:1], batch_prompts)["batch_equal_prefix"]
    rows = []
    # MoE routers' inputs, a call a prompt in prompts + extra order: float32 along each prompt (the first 8
    # with our tokens after it, for the greedy check), transformers-bf16 along each prompt and along the 8
    gate_fp32, gate_bf16, nmse_bf16 = (routing_ties.GateInputs(hf) for _ in range(3))
    with torch.inference_mode():
        with gate_fp32:
            fp32 = []
            for p, o in zip(prompts, mine["outs"]):
                gate_fp32.call()
                fp32.append(hf(torch.tensor([p + o[:-1]], device=DEV)).logits[0, len(p) - 1:].float())
            fp32_extra = []
            for p in extra:
                gate_fp32.call()
                fp32_extra.append(hf(torch.tensor([p], device=DEV)).logits[0, -1].float())
        greedy = [hf.generate(torch.tensor([p], device=DEV), max_new_tokens=STEPS, min_new_tokens=STEPS,
                              do_sample=False)[0, len(p):].tolist() for p in prompts]
        inv_freq = {n: b.clone() for n, b in hf.named_buffers() if n.endswith("inv_freq")}
        hf.to(torch.bfloat16)
        for name, value in inv_freq.items():  # RoPE frequencies stay float32, as in the checkpoint's model
            owner, _, attr = name.rpartition(".")
            setattr(hf.get_submodule(owner), attr, value)
        with nmse_bf16:
            bf16 = []
            for p in prompts + extra:
                nmse_bf16.call()
                bf16.append(hf(torch.tensor([p], device=DEV)).logits[0, -1].float())
        with gate_bf16:
            bf16_forced = []
            for p, o in zip(prompts, mine["outs"]):
                gate_bf16.call()
                bf16_forced.append(hf(torch.tensor([p + o[:-1]], device=DEV)).logits[0, len(p) - 1:].float())
        bf16_greedy = [hf.generate(torch.tensor([p], device=DEV), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                   do_sample=False)[0, len(p):].tolist() for p in prompts]
    for i, p in enumerate(prompts):
        row = dict(prompt_len=len(p), ours_nmse=nmse(first[i], fp32[i][0]), hf_bf16_nmse=nmse(bf16[i], fp32[i][0]),
                   equal_prefix=equal_prefix(mine["outs"][i], greedy[i]),
                   hf_bf16_equal_prefix=equal_prefix(bf16_greedy[i], greedy[i]))
        if row["equal_prefix"] < STEPS:
            row.update(near_tie(fp32[i][row["equal_prefix"]], bf16_forced[i][row["equal_prefix"]]))
        rows.append(row)
    if gate_fp32.gates:  # a MoE model: where a run parts, was our routing on the way there a near-tie?
        from chitu_core import LLM

        llm = LLM(str(path), device="nvidia", dtype="bfloat16", max_model_len=512, enforce_eager=True, load_progress=False)
        parted = [i for i, row in enumerate(rows) if row["equal_prefix"] < STEPS]
        shared = [prompts[i] + mine["outs"][i][:rows[i]["equal_prefix"]] for i in parted]
        ours, layers, logits = routing_ties.our_routing(llm, shared)  # teacher-forced on the shared sequences
        for i, routing, sequence, our_logits in zip(parted, ours, shared, logits):
            rows[i].update(routing_ties.explain(routing, layers, gate_fp32, gate_bf16, i, len(sequence), our_logits))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    ours = [r["ours_nmse"] for r in rows] + [nmse(first[len(prompts) + j], fp32_extra[j]) for j in range(len(extra))]
    theirs = [r["hf_bf16_nmse"] for r in rows] + [nmse(bf16[len(prompts) + j], fp32_extra[j]) for j in range(len(extra))]
    verdict = judged_nmse(prompts + extra, ours, theirs, routed, gate_fp32, nmse_bf16)
    greedy_ok = all(r["equal_prefix"] == STEPS or r["near_tie"] or r.get("routing_explains") for r in rows)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return dict(arch=arch, rows=rows, ours_nmse=sum(ours) / len(ours), hf_bf16_nmse=sum(theirs) / len(theirs),
                ours_nmse_median=statistics.median(ours), hf_bf16_nmse_median=statistics.median(theirs),
                nmse_prompts=len(ours), nmse_per_prompt=dict(ours=ours, hf_bf16=theirs),  # which prompts set the means
                **verdict, greedy_ok=greedy_ok, batch_bf16=mine["batch_equal_prefix"], batch_fp32=batch_fp32,
                graphs=mine["graphs"], attention=mine["attention"], fallback=mine["fallback"])


def main() -> int:
    args = sys.argv[1:]
    name = "models_check"
    if args[:1] == ["--out"]:
        name, args = args[1], args[2:]
    archs = args or list(CONFIGS)
    results = []
    for arch in archs:
        try:
            results.append(check(arch))
        except Exception as exc:  # one architecture's failure is reported; the others still run
            import traceback

            traceback.print_exc()
            results.append(dict(arch=arch, error=f"{type(exc).__name__}: {exc}"[:400]))
        print(json.dumps(results[-1], default=str)[:1500], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    from chitu_core.bench.report import models_check_lines

    print(f"\n{torch.cuda.get_device_name()}: ours bf16 against transformers fp32 on the same random weights")
    print("\n".join(models_check_lines(results)))
    return 0 if all("error" not in r and r["nmse_ok"] and r["greedy_ok"] and r["batch_fp32"] == STEPS for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
