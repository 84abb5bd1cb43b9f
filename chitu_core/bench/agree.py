"""``python -m chitu_core.bench agree``: our greedy tokens against llama.cpp's, on the same GGUF file.

Twelve fixed chat prompts (questions across topics, code, arithmetic, a list, a translation) are
rendered with the model's chat template by our tokenizer; ours and llama.cpp (``peer_llamacpp.greedy``)
get the same token ids and each decodes ``--tokens`` tokens greedily, EOS ignored. For each prompt the
table says whether the two continuations are identical, and if not the first position where they
differ, with the near-tie evidence there: the gap between the two largest logits on each side at that
position (ours from ``logprobs=2``: log-probabilities differ from logits by one constant a step, so
their gap is the logits' gap; llama.cpp's from its logits after the same context, as the two sides
agree up to there). Two implementations that round differently (our dtype and kernels, llama.cpp's
quantized dot products) may part at a near tie, a gap of a few hundredths; a wide gap where they part
points at a bug.

The control: llama.cpp against itself with one of its own roundings changed (its KV cache in float32
instead of float16), on the same prompts. How often that parts from llama.cpp's default is how far
"identical" can be read as correctness on this model and these prompts: a small model decoding 32
tokens greedily turns any rounding difference into a different continuation wherever it passes a near tie.

llama-cpp-python must be installed (``pip install 'chitu-core[bench-llamacpp]'``); without it the
command exits with status 1 and says so.
"""

import argparse
import json
import sys
from typing import Any

import torch

from chitu_core.bench import peer_llamacpp
from chitu_core.engine.llm import LLM
from chitu_core.loader.gguf import default_model_file
from chitu_core.sampling.params import SamplingParams

PROMPTS = [
    "What is the capital of Australia?",
    "Why is the sky blue? Answer in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 multiplied by 23?",
    "List five fruits that are rich in vitamin C.",
    "Translate into French: The weather is nice today, let's go for a walk.",
    "Explain what a hash table is to a beginner.",
    "Give me three tips for sleeping better.",
    "Who wrote Pride and Prejudice, and when was it published?",
    "Write a haiku about the sea.",
    "How do I reverse a list in JavaScript?",
    "If a train travels 120 km in 1.5 hours, what is its average speed?",
]


def _our_gap(logprobs: dict[int, float]) -> float:
    first, second = sorted(logprobs.values(), reverse=True)[:2]
    return first - second


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two continuations differ, or None where they are identical."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare(ours: list[int], our_logprobs: list[dict[int, float]], theirs: list[int],
            their_gaps: list[float]) -> dict[str, Any]:
    """One prompt's row: identical, or the first differing position with each side's token and top-2 gap there."""
    diff = first_difference(ours, theirs)
    if diff is None:
        return {"identical": True, "first_diff": None}
    return {"identical": False, "first_diff": diff, "ours_token": ours[diff], "llamacpp_token": theirs[diff],
            "ours_gap": round(_our_gap(our_logprobs[diff]), 4), "llamacpp_gap": round(their_gaps[diff], 4)}


def run_agree(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    model = args.model or str(default_model_file())
    llm = LLM(model, device=args.device, dtype=args.dtype, num_threads=args.threads, load_progress=False,
              pack_linear=not args.unpacked)
    threads = torch.get_num_threads()  # as our backend set them: llama.cpp gets as many
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=2)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    decode = llm.tokenizer.decode
    n_ctx = max(len(o.prompt_token_ids) for o in outputs) + args.tokens + 8
    peer = peer_llamacpp.load(model, n_ctx, threads)
    control = peer_llamacpp.load(model, n_ctx, threads, float32_kv=True)
    rows = []
    try:
        for text, out in zip(PROMPTS, outputs):
            gaps: list[float] = []
            theirs, _, _ = peer_llamacpp.greedy(peer, out.prompt_token_ids, args.tokens, gaps)
            own, _, _ = peer_llamacpp.greedy(control, out.prompt_token_ids, args.tokens)
            ours = out.outputs[0]
            row = {"prompt": text, "prompt_tokens": len(out.prompt_token_ids),
                   **compare(ours.token_ids, ours.logprobs, theirs, gaps),
                   "control_first_diff": first_difference(own, theirs)}
            if not row["identical"]:
                row["ours_text"], row["llamacpp_text"] = decode([row["ours_token"]]), decode([row["llamacpp_token"]])
            rows.append(row)
        weights = peer_llamacpp.weights(peer)
    finally:
        peer.close()
        control.close()
    return {"model": model, "backend": llm.engine.backend.name, "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "quantization": llm.engine.quant.describe(), "packed": not args.unpacked, "threads": threads, "tokens": args.tokens,
            "llama_cpp_version": llama_cpp.__version__, "llamacpp_weights": weights, "rows": rows,
            "identical": sum(r["identical"] for r in rows),
            "control_identical": sum(r["control_first_diff"] is None for r in rows)}


def _said(diff: int | None) -> str:
    return "identical" if diff is None else f"differ at {diff}"


def render(r: dict[str, Any]) -> str:
    layout = "" if r.get("packed", True) else " in the method's own layout and ops (not packed by the backend)"
    lines = [f"model    {r['model']}",
             f"ours     {r['backend']}, {r['dtype']}, weights {r['quantization']}{layout}, {r['threads']} threads",
             f"llama.cpp llama-cpp-python {r['llama_cpp_version']}, {r['threads']} threads, on {r['llamacpp_weights']}",
             f"greedy   {r['tokens']} tokens after each chat prompt, EOS ignored; at the first difference, each "
             "side's token and its top-2 logit gap",
             "control  llama.cpp with its KV cache in float32 (default float16) against llama.cpp: one of its own "
             "roundings changed",
             "",
             f"{'#':>2}  {'prompt':<44} {'in':>4}  {'agree':<16} {'ours (gap)':<26} {'llama.cpp (gap)':<26} control"]
    for i, row in enumerate(r["rows"], 1):
        prompt = row["prompt"] if len(row["prompt"]) <= 44 else row["prompt"][:41] + "..."
        line = f"{i:>2}  {prompt:<44} {row['prompt_tokens']:>4}  {_said(row['first_diff']):<16} "
        ours = "" if row["identical"] else f"{row['ours_text']!r} ({row['ours_gap']:.3f})"
        theirs = "" if row["identical"] else f"{row['llamacpp_text']!r} ({row['llamacpp_gap']:.3f})"
        lines.append(f"{line}{ours:<26} {theirs:<26} {_said(row['control_first_diff'])}")
    n = len(r["rows"])
    lines += ["", f"{r['identical']} of {n} identical; control: llama.cpp against itself, {r['control_identical']} of {n}"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--device", default="auto", help="our backend name, or auto (llama.cpp runs on the host)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None,
                        help="host threads, ours and llama.cpp's (default: our backend's choice)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens after each prompt")
    parser.add_argument("--unpacked", action="store_true",
                        help="our weights in the quantization method's own layout and ops (pack_linear off): the file's "
                             "exact dequantized weights, the ceiling of what any packing of ours can agree")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        raise SystemExit("--tokens must be at least 1")
    if args.model is not None and not peer_llamacpp.is_gguf(args.model):
        print(peer_llamacpp.not_gguf_reason(args.model), file=sys.stderr)
        return 1
    if why := peer_llamacpp.missing():
        print(why, file=sys.stderr)
        return 1
    result = run_agree(args)
    print(json.dumps(result) if args.json else render(result), flush=True)
    return 0
