"""GPU check of contract 1.18's fusions over 4-bit weights at batch 1, on a full-size config.

Llama-3.1-8B's config with random weights (load_format="dummy", seeded), in bfloat16, quantized in situ to
int4 (AWQ g128); eager decode steps (no graphs), so that one engine runs each prompt's decode both ways:
fused (``int4_rms_norm_linear`` / ``int4_linear_add``, the NVIDIA backend's) and unfused (the same ops
marked as the reference's, so the layers take ``rms_norm``, ``int4_linear``, the activation and the add).
Each of four 64-token prompts alone, 32 greedy tokens each way, every step's logits kept; for the steps
where both ways had generated the same tokens so far, the logits' NMSE between them, against the gap
int4's own error leaves to the bfloat16 model (the same prompts on the unquantized weights); and how many
greedy tokens agree before the first divergence, which must fall on a near-tie of the unfused logits
(top-2 gap within 2 bfloat16 ulps of the top logit).

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/fusions_check.py [CONFIG_DIR]

Writes fusions_check.json under $OUT; prints a table last.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "."))
STEPS, PROMPT_LEN = 32, 64
FUSED = ("int4_rms_norm_linear", "int4_linear_add")


def nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float(((got - want) ** 2).sum() / (want**2).sum())


def generate(llm, prompt) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and every step's logits [STEPS, V] (float32, on the host) of one prompt alone."""
    from chitu_core import SamplingParams

    model, logits = llm.engine.model, []
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: (out := compute_logits(h), logits.append(out.float().cpu()))[0]
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                                        ignore_eos=True))
    finally:
        model.compute_logits = compute_logits
    return out[0].outputs[0].token_ids, torch.cat(logits)


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def near_tie(logits: torch.Tensor) -> bool:
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1]) <= 2 * float(torch.exp2(torch.floor(torch.log2(top2[0].abs())) - 7))


def load(path: str, quantization: str | None):
    from chitu_core import LLM

    return LLM(path, device="nvidia", dtype="bfloat16", load_format="dummy", quantization=quantization,
               max_model_len=256, max_num_seqs=4, enforce_eager=True, load_progress=False)


def main() -> int:
    from chitu_core.ops.table import OpSource

    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama8b-config"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(4)]
    llm = load(path, None)
    bf16 = [generate(llm, p) for p in prompts]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    llm = load(path, "int4")
    sources = llm.engine.ops.sources
    native = {name: sources[name] for name in FUSED}
    layers = llm.engine.model.model.layers
    assert all(s.kind == "native" for s in native.values()), native
    rows, ok = [], True
    for i, p in enumerate(prompts):
        sources.update(native)
        assert all(layer.takes_fusions(1) and layer.mlp.fuses() for layer in layers)
        fused = generate(llm, p)
        sources.update({name: OpSource("fallback", "check") for name in FUSED})
        assert not any(layer.takes_fusions(1) for layer in layers)
        unfused = generate(llm, p)
        equal = same_prefix(fused[0], unfused[0])
        steps = min(equal, same_prefix(unfused[0], bf16[i][0])) + 1  # logits of a step follow its inputs
        tie = equal == STEPS or near_tie(unfused[1][equal])
        ok &= tie
        row = dict(prompt=i, equal_prefix=equal, divergence_on_near_tie=tie, steps_compared=steps,
                   fused_vs_unfused=nmse(fused[1][:steps], unfused[1][:steps]),
                   fused_vs_bf16=nmse(fused[1][:steps], bf16[i][1][:steps]),
                   unfused_vs_bf16=nmse(unfused[1][:steps], bf16[i][1][:steps]))
        rows.append(row)
        print(row, flush=True)
    (OUT / "fusions_check.json").write_text(json.dumps(rows, indent=1))
    print(f"device: {torch.cuda.get_device_name()}; int4 (AWQ g128, in situ) Llama-3.1-8B config, batch 1, eager")
    print("| prompt | greedy equal (of 32) | divergence on a near-tie | steps compared | NMSE fused vs unfused | "
          "fused vs bf16 model | unfused vs bf16 model |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['equal_prefix']} | {r['divergence_on_near_tie']} | {r['steps_compared']} | "
              f"{r['fused_vs_unfused']:.2e} | {r['fused_vs_bf16']:.2e} | {r['unfused_vs_bf16']:.2e} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
