"""Tensor parallelism over NCCL: the same greedy tokens from one GPU and from two (torchrun).

    python -m chitu_core.bench random-model --like tiny --out /tmp/tiny --dtype float32
    torchrun --nproc-per-node 1 plugins/nvidia/scripts/tp_check.py /tmp/tiny
    torchrun --nproc-per-node 2 plugins/nvidia/scripts/tp_check.py /tmp/tiny

Rank 0 prints one line: the world size, its device, whether decode ran through graphs, the tokens.
CHITU_PIPELINE_PARALLEL_SIZE / CHITU_ENABLE_EXPERT_PARALLEL select the layout; CHECK_DEVICE=cpu runs it here.
"""

import json
import os
import sys

from chitu_core import LLM, SamplingParams

llm = LLM(sys.argv[1], device=os.environ.get("CHECK_DEVICE", "nvidia"), dtype="float32", load_progress=False)
prompts = [{"prompt_token_ids": [(7 * i + 3) % 500 + 1 for i in range(n)]} for n in (5, 17, 40)]
outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
if os.environ.get("RANK", "0") == "0":
    print("TP", os.environ.get("WORLD_SIZE", "1"), llm.engine.device, "graphs", llm.engine.runner.graphs is not None,
          json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
