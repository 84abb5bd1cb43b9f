"""Speed and correctness of the quantized-linear Triton kernels on Llama-3.1-8B's shapes, one table.

For each op and each weight shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336)
at M = 1, 16 and 64 tokens: NMSE against the reference op (float64 of the same quantized weight), the
median time per call (CUDA events around replays of a CUDA graph of 10 calls), and the weight bytes read per second, beside a
bf16 cuBLAS matmul of the same shape and the copy bandwidth measured in the same run.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/quant_kernels.py [OP ...]
"""

import statistics
import sys

import torch

from chitu_core.bench.floor import copy_bandwidth
from chitu_core.ops import quant_reference as ref

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 16, 64)
DEV = torch.device("cuda")


def timed(fn, repeats: int = 20, calls: int = 10) -> float:
    """Median microseconds per call, the calls replayed from a CUDA graph (as decode runs them), so that
    Python and launch overheads are not counted."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def nmse(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).square().sum() / want.square().sum())


def operands(op: str, n: int, k: int, variant: str):
    g = torch.Generator(device=DEV).manual_seed(0)
    if op == "int4_linear":
        qweight = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), generator=g, device=DEV, dtype=torch.int64).to(torch.int32)
        scales = (torch.rand(k // 128, n, generator=g, device=DEV) * 0.01).half()
        zeros = torch.randint(0, 16, (k // 128, n), generator=g, device=DEV).half()
        return (qweight, scales, zeros, 128, None), qweight.numel() * 4 + scales.numel() * 4
    if op == "int8_linear":
        w = torch.randint(-127, 128, (n, k), generator=g, device=DEV, dtype=torch.int8)
        s = torch.rand(n, generator=g, device=DEV) * 1e-3
        return (w, s, variant == "a8", None), w.numel() + s.numel() * 4
    if op == "fp8_linear":
        w = (torch.randn(n, k, generator=g, device=DEV) * 50).to(torch.float8_e4m3fn)
        s = torch.rand(-(-n // 128), -(-k // 128), generator=g, device=DEV) * 1e-3
        return (w, s, (128, 128), variant == "a8", None), w.numel() + s.numel() * 4
    if op == "gguf_linear":
        from chitu_core.quantization.gguf_blocks import random_blocks

        qtype = {"q4_k": 12, "q6_k": 14, "q8_0": 8, "q4_0": 2}[variant]
        q = random_blocks(qtype, n, k, torch.Generator().manual_seed(0)).to(DEV)
        return (q, qtype, None), q.numel()
    raise ValueError(op)


VARIANTS = {"int4_linear": ["g128"], "int8_linear": ["a8", "a16"], "fp8_linear": ["a8", "a16"],
            "gguf_linear": ["q4_k", "q6_k", "q8_0", "q4_0"]}


def main() -> int:
    from chitu_core.kernels.triton.ops import TRITON_OPS

    ops = sys.argv[1:] or list(VARIANTS)
    bw = copy_bandwidth(DEV, torch.cuda.synchronize)
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s")
    rows = []
    for op in ops:
        kernel, oracle = TRITON_OPS[op], getattr(ref, op)
        for variant in VARIANTS[op]:
            for sname, (n, k) in SHAPES.items():
                args, wbytes = operands(op, n, k, variant)
                for m in MS:
                    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                    got = kernel(x, *args)
                    want = oracle(x.double(), *args)
                    e = nmse(got, want)
                    us = timed(lambda: kernel(x, *args))
                    w16 = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
                    us16 = timed(lambda: x @ w16.T)
                    rows.append((op, variant, sname, m, f"{e:.1e}", f"{us:.1f}", f"{wbytes / us / 1e3:.0f}",
                                 f"{wbytes / bw * 1e6 / us:.2f}", f"{us16:.1f}", f"{us16 / us:.2f}"))
                    del w16
    print("| op | variant | shape | M | nmse | us | weight GB/s | of floor | bf16 us | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
