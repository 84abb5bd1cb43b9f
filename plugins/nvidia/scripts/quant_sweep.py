"""Tile sweep of the quantized-linear Triton kernels at Llama-3.1-8B's shapes, M = 1 and 64 (SWEEP_M): for each
op variant and shape, the fastest config found (CUDA-graph timing, as quant_kernels.py) and its share of
the byte floor; prints one line per result as it goes (so a timeout keeps what was found).

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/quant_sweep.py [VARIANT ...]
"""

import itertools
import os
import sys

import torch

from chitu_core.bench.floor import copy_bandwidth
from chitu_core.kernels.triton.fp8_linear import fp8_linear
from chitu_core.kernels.triton.int4_linear import Int4Config, int4_linear
from chitu_core.kernels.triton.int8_linear import int8_linear
from chitu_core.kernels.triton.quant_matmul import MatmulConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_kernels import DEV, SHAPES, operands, timed  # noqa: E402

MS = tuple(int(m) for m in os.environ.get("SWEEP_M", "1 64").split())


def matmul_candidates(m: int):
    if m <= 16:
        return [MatmulConfig(16, bn, bk, s, True, True, 4, st)
                for bn, bk, s, st in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (3, 4))]
    return [MatmulConfig(64, bn, bk, s, True, False, w, st)
            for bn, bk, s, (w, st) in itertools.product((64, 128), (64, 128), (1, 2, 4), ((4, 3), (4, 4), (8, 3)))]


def int4_candidates(m: int):
    if m == 1:
        return []  # one row takes the matrix-vector kernel: gemv_sweep.py
    bms = (16,) if m <= 16 else (32, 64)
    return [Int4Config(bm, bn, bk, s, w, st) for bm, bn, bk, s, (w, st) in
            itertools.product(bms, (64, 128), (64, 128), (1, 2, 4), ((4, 3), (8, 3)))]


VARIANTS = {
    "fp8-a16": ("fp8_linear", "a16", fp8_linear, matmul_candidates),
    "fp8-a8": ("fp8_linear", "a8", fp8_linear, matmul_candidates),
    "int8-a8": ("int8_linear", "a8", int8_linear, matmul_candidates),
    "int4": ("int4_linear", "g128", int4_linear, int4_candidates),
}


def main() -> int:
    names = sys.argv[1:] or list(VARIANTS)
    bw = copy_bandwidth(DEV, torch.cuda.synchronize)
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for name in names:
        op, variant, kernel, candidates = VARIANTS[name]
        for sname, (n, k) in SHAPES.items():
            args, wbytes = operands(op, n, k, variant)
            for m in MS:
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                default = timed(lambda: kernel(x, *args))
                best = (default, "default")
                for config in candidates(m):
                    try:
                        us = timed(lambda: kernel(x, *args, config=config), repeats=5, calls=5)
                    except Exception as exc:  # a config the kernel refuses
                        continue
                    if us < best[0]:
                        best = (us, config)
                print(f"{name} {sname} M={m}: default {default:.1f} us ({wbytes / bw * 1e6 / default:.2f} of floor); "
                      f"best {best[0]:.1f} us ({wbytes / bw * 1e6 / best[0]:.2f}) {best[1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
