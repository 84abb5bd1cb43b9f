"""Tile sweep of the per-slot MoE matrix-vector kernel (the decode path of fused_experts): for each
model's batch-1 shapes, the gate/up and down launches timed (CUDA-graph do_bench) for BLOCK_N x BLOCK_K x
warps, as GB/s of the routed experts' weights against the measured copy bandwidth. Prints the best of each.

    PYTHONPATH=. python3 plugins/nvidia/scripts/moe_gemv_sweep.py
"""

import itertools

import torch
import triton
import triton.testing

from chitu_core.kernels.triton.moe import ExpertWeights, _slot_gemv_kernel

DEV = torch.device("cuda")
MODELS = {"deepseek-v2-lite": (64, 6, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * (1 << 30) / ms / 1e6


def main() -> None:
    bw = copy_gbps()
    print(f"device {torch.cuda.get_device_name()}, copy {bw:.0f} GB/s")
    for name, (experts, top_k, hidden, inter) in MODELS.items():
        x = torch.randn(1, hidden, device=DEV, dtype=torch.bfloat16)
        w13 = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=torch.bfloat16)
        w2 = torch.randn(experts, hidden, inter, device=DEV, dtype=torch.bfloat16)
        ids = torch.randperm(experts, device=DEV)[:top_k][None].contiguous()
        mid = torch.randn(top_k, inter, device=DEV, dtype=torch.bfloat16)
        for label, w, a, n_out, k_dim, gated, rows in (("gate_up", w13, x, inter, hidden, True, top_k),
                                                       ("down", w2, mid, hidden, inter, False, 1)):
            out = torch.empty(top_k, n_out, device=DEV, dtype=torch.float32 if not gated else torch.bfloat16)
            nbytes = top_k * n_out * k_dim * 2 * (2 if gated else 1)
            results = []
            for bn, bk, warps, stages in itertools.product((8, 16, 32), (128, 256, 512), (4, 8), (1, 2)):
                if bn * bk > 32768:
                    continue
                def launch():
                    _slot_gemv_kernel[(top_k, triton.cdiv(n_out, bn))](
                        out, a, w, a, ids, n_out, k_dim, rows, *a.stride(), *w.stride(), 0, 0, 0, out.stride(0),
                        *ids.stride(), TOP_K=top_k, GATED=gated, ACT="silu", **ExpertWeights().consts(), BLOCK_N=bn,
                        BLOCK_K=bk, PDL=False, num_warps=warps, num_stages=stages)
                try:
                    launch()
                    ms = triton.testing.do_bench_cudagraph(launch)
                except Exception as exc:  # a tile that does not compile here
                    print(f"  {name} {label} {bn}/{bk}/{warps}/{stages}: {type(exc).__name__}")
                    continue
                results.append((nbytes / ms / 1e6, bn, bk, warps, stages, ms * 1e3))
            results.sort(reverse=True)
            current = [r for r in results if (r[1], r[2], r[3]) == (32, 128, 4)]
            print(f"{name:<18}{label:<8} best " + "; ".join(f"{bn}/{bk}/{wp}/{st}: {us:.1f} us {g:.0f} GB/s ({g / bw:.0%})"
                                                     for g, bn, bk, wp, st, us in results[:4])
                  + (f" | current 32/128/4: {current[0][5]:.1f} us ({current[0][0] / bw:.0%})" if current else ""), flush=True)


if __name__ == "__main__":
    main()
