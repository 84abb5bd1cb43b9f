"""GPU check that contract 1.10's ``mla_inputs`` changes nothing but rounding in a whole model: a DeepSeek
config with dummy weights (the same seed each time) in bfloat16, decoding prompts one at a time (batch 1,
the steps that take the op), eager so that every step's logits can be kept; then the same prompts with
every layer's attention on the ops it replaces (rotary, batched product, norm, concatenations). Per
prompt: tokens equal before the first difference, the step logits' NMSE of one path against the other
up to it, and the top-2 logit gap of the unfused path where they part. A table last.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/mla_inputs_check.py CONFIG_DIR

Writes mla_inputs_check.json under $OUT.
"""

import json
import os
import sys
from pathlib import Path

import torch

STEPS, PROMPTS, PROMPT_LEN = 32, 6, 48


def decode_all(llm, prompts) -> list[tuple[list[int], list[torch.Tensor]]]:
    from chitu_core import SamplingParams

    model, logits = llm.engine.model, []
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: (out := compute_logits(h), logits.append(out.float().cpu()))[0]
    runs = []
    for prompt in prompts:  # one at a time: every decode step has one token
        logits.clear()
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                                           ignore_eos=True))[0]
        runs.append((out.outputs[0].token_ids, [x[-1] for x in logits]))
    model.compute_logits = compute_logits
    return runs


def main() -> int:
    from chitu_core import LLM
    from chitu_core.bench.report import mla_inputs_lines

    path = sys.argv[1]
    llm = LLM(path, device="nvidia", dtype="bfloat16", load_format="dummy", max_model_len=256, max_num_seqs=4,
              enforce_eager=True, load_progress=False)
    attns = [layer.self_attn for layer in llm.engine.model.model.layers]
    assert all(a.fused_inputs for a in attns), "the backend does not serve mla_inputs"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llm.engine.vocab_size, (PROMPT_LEN,), generator=gen).tolist() for _ in range(PROMPTS)]
    fused = decode_all(llm, prompts)
    for a in attns:
        a.fused_inputs = False
    unfused = decode_all(llm, prompts)
    rows = []
    for (tok_f, log_f), (tok_u, log_u) in zip(fused, unfused):
        same = next((i for i, (a, b) in enumerate(zip(tok_f, tok_u)) if a != b), len(tok_f))
        got, want = torch.stack(log_f[: same + 1]).double(), torch.stack(log_u[: same + 1]).double()
        nmse = float((got - want).square().sum() / want.square().sum())
        gap = None
        if same < len(tok_f):
            top = log_u[same].topk(2).values
            gap = float(top[0] - top[1])
        rows.append({"equal_tokens": same, "of": len(tok_f), "step_logits_nmse": nmse, "top2_gap_at_parting": gap})
    result = {"device": torch.cuda.get_device_name(), "config": path, "rows": rows}
    (Path(os.environ.get("OUT", ".")) / "mla_inputs_check.json").write_text(json.dumps(result, indent=1))
    print("\n".join(mla_inputs_lines(result)))  # the table `bench report` puts on the page
    return 0


if __name__ == "__main__":
    sys.exit(main())
