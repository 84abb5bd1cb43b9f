"""GPU check of the Triton MoE kernels (``chitu_core.kernels.triton.moe``) in bfloat16 at real model shapes.

For Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V2-Lite expert shapes, T = 1, 32, 64, 512 tokens:

  route   moe_route against the float64 reference (ids as per-row sets, weights max abs error);
  nmse    fused_experts against the float64 reference, and the limit of the conformance family;
  us      median time (triton.testing.do_bench) of the path fused_experts picks, then of the other
          path, then of moe_route + fused_experts replayed from a CUDA graph (which also proves them
          capturable: the replay must equal the eager result bit for bit);
  GB/s    bytes of the experts' weights the step reads (those some slot chose) over the eager time;
  torch   a per-expert loop of PyTorch ops in bfloat16 (the reference's algorithm), for scale.

Only torch and triton are needed; from the repository root on the GPU machine:

    PYTHONPATH=. python3 plugins/nvidia/scripts/moe_check.py [--tokens 1,32,64,512] [--models mixtral,qwen3]
"""

import argparse

import torch
import triton.testing

from chitu_core.conformance.moe_cases import by_expert_id
from chitu_core.conformance.thresholds import default
from chitu_core.kernels.triton.moe import fused_experts, moe_route, use_slot_path
from chitu_core.ops import reference

DEV = torch.device("cuda")
MODELS = {  # experts, top_k, hidden, intermediate, moe_route arguments
    "mixtral": (8, 2, 4096, 14336, dict(renormalize=True)),
    "qwen3": (128, 8, 2048, 768, dict(renormalize=True)),
    "dsv2lite": (64, 6, 2048, 1408, dict()),
}


def nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).pow(2).sum() / want.pow(2).sum())


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3


def graph_us(fn, eager: torch.Tensor) -> tuple[float, bool]:
    """Median replay time of fn captured in a CUDA graph, and whether the replay equals ``eager``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm the allocator outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return us(graph.replay), torch.equal(out, eager)


def check(model: str, tokens: int) -> dict:
    experts, top_k, hidden, inter, route_kwargs = MODELS[model]
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    dtype = torch.bfloat16
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEV, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=DEV, generator=gen) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, device=DEV, generator=gen)
    weights, ids = moe_route(logits, top_k, **route_kwargs)
    (gw, gi), (ww, wi) = by_expert_id(weights, ids), by_expert_id(*reference.moe_route(logits.double(), top_k,
                                                                                        **route_kwargs))
    route_ok = bool(torch.equal(gi, wi)) and float((gw.double() - ww).abs().max()) < 1e-5
    got = fused_experts(x, w13, w2, weights, ids)
    want = reference.fused_experts(x.double(), w13.double(), w2.double(), weights, ids)
    chosen = "slots" if use_slot_path(tokens, top_k, experts) else "grouped"
    other = "grouped" if chosen == "slots" else "slots"
    eager = us(lambda: fused_experts(x, w13, w2, weights, ids))
    replay, same = graph_us(lambda: fused_experts(x, w13, w2, *moe_route(logits, top_k, **route_kwargs)), got)
    hit = int(ids.unique().numel())
    weight_bytes = hit * 3 * hidden * inter * 2
    return {
        "model": model, "T": tokens, "route": "ok" if route_ok else "WRONG", "nmse": nmse(got, want),
        "limit": default("experts", dtype).limit, "path": chosen, "us": eager,
        "other_us": us(lambda: fused_experts(x, w13, w2, weights, ids, path=other)) if tokens <= 64 else None,
        "graph_us": replay, "graph_same": same, "gbps": weight_bytes / eager / 1e3,
        "torch_us": us(lambda: reference.fused_experts(x, w13, w2, weights, ids)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,32,64,512")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}")
    head = "| model | T | route | nmse (limit) | path | us | other path us | graph us (same) | GB/s | torch us |"
    print(head + "\n|" + "---|" * (head.count("|") - 1))
    for model in args.models.split(","):
        for tokens in map(int, args.tokens.split(",")):
            r = check(model, tokens)
            other = f"{r['other_us']:.1f}" if r["other_us"] is not None else "-"
            print(f"| {r['model']} | {r['T']} | {r['route']} | {r['nmse']:.2e} ({r['limit']:.0e}) | {r['path']} | "
                  f"{r['us']:.1f} | {other} | {r['graph_us']:.1f} ({'yes' if r['graph_same'] else 'NO'}) | "
                  f"{r['gbps']:.0f} | {r['torch_us']:.1f} |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
