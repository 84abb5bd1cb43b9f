"""Decode-step GEMMs of Llama-3.1-8B (bf16) by weight layout: F.linear on [N, K] weights (what the
model did first) against a matmul on the transposed, contiguous [K, N] copy, through cuBLAS and
cuBLASLt. Times 50 replays of a captured graph per case; prints microseconds and the share of the
copy bandwidth (measured as the bench's floor does) they reach.

    python plugins/nvidia/scripts/gemm_layouts.py
    python plugins/nvidia/scripts/gemm_layouts.py rows [TP]   # cuBLAS against cuBLASLt by rows; TP: each
                                                              # rank's share of the shapes under tensor parallelism
"""

import torch
import torch.nn.functional as F

from chitu_core.bench.floor import copy_bandwidth

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}


def timed(fn, reps: int = 50) -> float:
    """Microseconds per call, over a captured graph of ``reps`` calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


SMOLLM = {"smol-qkv": (576, 960), "smol-o": (576, 576), "smol-gate_up": (576, 3072), "smol-down": (1536, 576),
          "smol-head": (576, 49152)}


def main() -> None:
    bw = copy_bandwidth(torch.device("cuda"), torch.cuda.synchronize) / 1e9  # as the bench's floor
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s")
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        print(f"--- torch.backends.cuda.preferred_blas_library({library!r})")
        gemms(bw)


def gemms(bw: float) -> None:
    print(f"{'gemm':12} {'M':>3} {'linear [N,K] us':>16} {'%copy':>6} {'matmul [K,N] us':>16} {'%copy':>6}")
    for name, (k, n) in {**SHAPES, **SMOLLM}.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        wt = w.t().contiguous()
        for m in (1, 64):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            torch.testing.assert_close(F.linear(x, w), x @ wt, rtol=2e-2, atol=2e-2)
            floor_us = w.numel() * 2 / bw / 1e3
            a, b = timed(lambda: F.linear(x, w)), timed(lambda: x @ wt)
            print(f"{name:12} {m:3d} {a:16.2f} {floor_us / a:6.1%} {b:16.2f} {floor_us / b:6.1%}")
        del w, wt


def argmax() -> None:
    print(f"{'argmax over 128256':20} {'M':>3} {'float32 us':>11} {'bf16 us':>8} {'bf16->float32 copy us':>22}")
    for m in (1, 64):
        logits = torch.randn(m, 128256, device="cuda")
        half = logits.bfloat16()
        print(f"{'':20} {m:3d} {timed(lambda: logits.argmax(-1)):11.2f} {timed(lambda: half.argmax(-1)):8.2f} "
              f"{timed(lambda: half.float()):22.2f}")


def tp_shapes(tp: int) -> dict[str, tuple[int, int]]:
    """One rank's (K, N) under tensor parallelism: column-parallel layers split N, row-parallel ones K."""
    row_parallel = {"o_proj", "down"}
    return {name: (k // tp, n) if name in row_parallel else (k, n // tp) for name, (k, n) in SHAPES.items()}


def rows_sweep(tp: int = 1) -> None:
    """[K, N] weights (the layout the backend stores), cuBLAS against cuBLASLt by rows; four weight
    copies taken in turn, so that the L2 cache does not serve a weight twice in a row."""
    rows = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
    bw = copy_bandwidth(torch.device("cuda"), torch.cuda.synchronize) / 1e9
    print(f"{torch.cuda.get_device_name()}, tensor-parallel share 1/{tp}; copy bandwidth {bw:.0f} GB/s; "
          "last column: the byte floor of one row")
    print(f"{'us cublas/lt':12} " + " ".join(f"{m:>11}" for m in rows) + f" {'floor us':>9}")
    for name, (k, n) in tp_shapes(tp).items():
        wts = [torch.randn(k, n, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(4)]
        turn = [0]

        def gemm():
            turn[0] += 1
            return x @ wts[turn[0] % 4]

        cells = []
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            times = []
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                times.append(timed(gemm, reps=48))
            cells.append(f"{times[0]:5.1f}/{times[1]:5.1f}")
        print(f"{name:12} " + " ".join(cells) + f" {k * n * 2 / bw / 1e3:9.2f}")
        del wts
    torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["rows"]:
        rows_sweep(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    else:
        main()
        argmax()
