"""Prefill graphs (contract 1.16) on the device: greedy tokens and logprobs in float32 with and without them (tiny
random Llama and Qwen3 from tests/builders.py, and the tiny Mixtral at ``--mixtral``), whole prompts in one step
and in chunks of 48 tokens beside decodes; then the wall time of one prefill step of n prompts of 128 tokens on the
Llama-3.1-8B config (dummy bf16 weights, ``--model``), eager against replayed, each size timed 6 times after one
untimed run. A table last.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/prefill_graphs_check.py --model /tmp/llama-3.1-8b \
        --mixtral /tmp/tiny-mixtral [--out FILE.json]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from builders import build_model  # noqa: E402

from chitu_core import LLM, SamplingParams  # noqa: E402

GRAPHS = 4096  # max_prefill_graph_tokens where on


def greedy(path: Path, graphs: int, budget: int | None) -> tuple[list, bool]:
    llm = LLM(str(path), dtype="float32", max_prefill_graph_tokens=graphs, max_num_batched_tokens=budget,
              load_progress=False)
    engine = llm.engine
    prompts = [[(7 * i + 3 * j) % 400 + 1 for j in range(3 + 37 * i)] for i in range(8)]  # 3 to 262 tokens
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    on = engine.runner.prefill_graphs is not None
    result = [(o.seqs[0].output_token_ids, [lp[t] for lp, t in zip(o.seqs[0].output_logprobs, o.seqs[0].output_token_ids)])
              for o in outs]
    del llm, engine
    torch.cuda.empty_cache()
    return result, on


def step_ms(model: str, graphs: int, requests: list[int]) -> dict[int, float]:
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=512, max_num_seqs=64,
              max_prefill_graph_tokens=graphs, load_progress=False)
    engine, out = llm.engine, {}
    for n in requests:
        times = []
        for rep in range(7):
            for i in range(n):
                engine.add_request(f"t{n}-{rep}-{i}", [(rep * 131 + i * 17 + j) % 30000 + 1 for j in range(128)],
                                   SamplingParams(max_tokens=1, ignore_eos=True))
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()  # the prefill: launched, sampled, its tokens back on the host
            times.append(time.perf_counter() - start)
            while engine.has_unfinished():
                engine.step()
        out[n] = 1e3 * statistics.median(times[1:])
    del llm, engine
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="the Llama-3.1-8B config's directory (dummy weights)")
    parser.add_argument("--mixtral", help="a tiny float32 Mixtral (bench random-model --like tiny-mixtral)")
    parser.add_argument("--out")
    args = parser.parse_args()
    tokens = []
    for arch in ("llama", "qwen3", "mixtral"):
        if arch == "mixtral" and not args.mixtral:
            continue
        path = Path(args.mixtral) if arch == "mixtral" else Path(f"/tmp/prefill-graphs-{arch}")
        if arch != "mixtral":
            build_model(path, arch)
        for budget in (None, 48):
            eager, _ = greedy(path, 0, budget)
            graphed, on = greedy(path, GRAPHS, budget)
            tokens.append({"arch": arch, "chunks": budget, "graphs_on": on,
                           "equal": sum(a[0] == b[0] for a, b in zip(eager, graphed)), "of": len(eager),
                           "max_logprob_diff": max(abs(x - y) for a, b in zip(eager, graphed) for x, y in zip(a[1], b[1]))})
    requests = [1, 3, 8, 16]
    eager, graphed = step_ms(args.model, 0, requests), step_ms(args.model, GRAPHS, requests)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": tokens,
              "steps": [{"requests": n, "tokens": 128 * n, "eager_ms": eager[n], "graph_ms": graphed[n]} for n in requests]}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    from chitu_core.bench.report_kernels import prefill_graphs_lines
    print("\n".join(prefill_graphs_lines(result)))


if __name__ == "__main__":
    main()
