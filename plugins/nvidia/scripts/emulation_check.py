"""Greedy tokens of backends in emulation (``CHITU_EMULATE=<name>``) against this GPU's own backend.

A backend such as chitu-hygon or chitu-muxi runs the shared Triton kernels with its own kernel
configuration; under ``CHITU_EMULATE`` it skips only its vendor checks, so on an NVIDIA GPU its
configuration really runs. This script makes one small random Llama config with transformers
(float32, saved once) and, for the reference backend and each emulated one in a process of its own,
generates 64 greedy tokens for 8 prompts of mixed lengths, in one batch and with device graphs, in
float32 and in bfloat16. float32 tokens must equal the reference's; bfloat16 is reported (other tile
sizes sum in another order, so a near-tie may part them).

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/emulation_check.py [BACKEND ...]

BACKEND: the emulated backends (default hygon muxi); the reference is ``--reference`` (default nvidia).
Writes emulation.json under $OUT; exits 1 when a float32 comparison differs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS, VOCAB = 64, 2048
PROMPT_LENS = (5, 17, 33, 64, 80, 100, 128, 200)
DTYPES = ("float32", "bfloat16")


def build(path: Path) -> str:
    """A 4-layer Llama config with random float32 weights, saved to path; returns its description."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return "Llama, 4 layers, hidden 512, 8/4 heads, vocab 2048, random float32 weights"


def prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def worker(backend: str, path: str) -> None:
    """In its own process (the environment says which backend is emulated): tokens a dtype, as JSON."""
    from chitu_core import LLM, SamplingParams

    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    result = {}
    for dtype in DTYPES:
        llm = LLM(path, device=backend, dtype=dtype, max_model_len=512, max_num_seqs=16, load_progress=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
        result[dtype] = dict(tokens=[o.outputs[0].token_ids for o in outs], graphs=llm.engine.runner.graphs is not None,
                             backend=llm.engine.backend.name, attention=llm.engine.attention.name)
        del llm
    print(json.dumps(result))


def run(backend: str, path: Path, emulate: bool) -> dict:
    env = dict(os.environ)
    env.pop("CHITU_EMULATE", None)
    if emulate:
        env["CHITU_EMULATE"] = backend
    done = subprocess.run([sys.executable, __file__, "--worker", backend, str(path)], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"{backend}: the worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def equal_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backends", nargs="*", default=["hygon", "muxi"])
    parser.add_argument("--reference", default="nvidia")
    parser.add_argument("--worker", nargs=2, metavar=("BACKEND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    import torch

    path = Path(tempfile.mkdtemp(prefix="emulation-llama-"))
    model = build(path)
    reference = run(args.reference, path, emulate=False)
    results = []
    for backend in args.backends:
        mine = run(backend, path, emulate=True)
        for dtype in DTYPES:
            prefixes = [equal_prefix(a, b) for a, b in zip(mine[dtype]["tokens"], reference[dtype]["tokens"])]
            results.append(dict(backend=mine[dtype]["backend"], dtype=dtype, prefixes=prefixes,
                                equal=sum(p == STEPS for p in prefixes), graphs=mine[dtype]["graphs"],
                                attention=mine[dtype]["attention"]))
    report = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", reference=args.reference, model=model, steps=STEPS,
                  prompts=len(PROMPT_LENS), results=results)
    (Path(os.environ.get("OUT", ".")) / "emulation.json").write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"{r['backend']:>8} {r['dtype']:>9}: {r['equal']}/{len(PROMPT_LENS)} prompts' {STEPS} tokens equal to "
              f"{args.reference}'s; equal prefixes {r['prefixes']}; graphs {r['graphs']}, attention {r['attention']}")
    return int(any(r["dtype"] == "float32" and r["equal"] < len(PROMPT_LENS) for r in results))


if __name__ == "__main__":
    sys.exit(main())
