"""16-bit decode GEMMs of a few to 128 rows (batch 2 to 128): cuBLAS and cuBLASLt against the split-K Triton
matmul (``quant_matmul`` with a 16-bit weight and unit scales) over tile configurations, at the decode
shapes of Qwen3-1.7B, Llama-3.1-8B and one rank of its TP2. Weights as the NVIDIA backend stores them
(transposed), rotated through enough copies to exceed the L2 cache, replayed from a CUDA graph; each
against the byte floor of its weight. The best three Triton configurations and a table last.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/skinny_gemm_sweep.py [NAME_PART ...] [--rows 4 128]
"""

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
import triton

from chitu_core.bench.floor import copy_bandwidth
from chitu_core.kernels.triton.quant_matmul import MatmulConfig, quant_matmul

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemv_sweep import copies, print_table, rotated  # noqa: E402
from quant_kernels import DEV, nmse, timed  # noqa: E402

BF16 = torch.bfloat16
SHAPES = {  # name: (N, K)
    "qwen3-1.7b qkv": (4096, 2048), "qwen3-1.7b o_proj": (2048, 2048), "qwen3-1.7b gate_up": (12288, 2048),
    "qwen3-1.7b down": (2048, 6144),
    "llama8b qkv": (6144, 4096), "llama8b o_proj": (4096, 4096), "llama8b gate_up": (28672, 4096),
    "llama8b down": (4096, 14336),
    "llama8b-tp2 qkv": (3072, 4096), "llama8b-tp2 o_proj": (4096, 2048), "llama8b-tp2 gate_up": (14336, 4096),
    "llama8b-tp2 down": (4096, 7168),
}


def configs(m: int, n: int, k: int, units: int):
    """Tiles (BLOCK_M the rows' power of two, at least 16, at most 128), K split for about 1, 2 or 4
    programs a compute unit."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    seen = set()
    for bn, bk, warps, stages, fill in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4), (1, 2, 4)):
        programs = triton.cdiv(m, block_m) * triton.cdiv(n, bn)
        split = max(1, min(8, triton.cdiv(k, 2 * bk), triton.cdiv(fill * units, programs)))
        cfg = MatmulConfig(block_m, bn, bk, split, num_warps=warps, num_stages=stages)
        if cfg not in seen:
            seen.add(cfg)
            yield cfg


def triton_gemm(x, w, ones, cfg):
    return quant_matmul(x, w, ones, None, w_kind="float", act_quant=None, block_size=None, config=cfg)


def library(name):
    def run(x, w):
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(name)
        try:
            return F.linear(x, w)
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    return run


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="*", default=[4, 16, 64, 128])
    parser.add_argument("only", nargs="*")
    args = parser.parse_args()
    bw = copy_bandwidth(DEV, torch.cuda.synchronize)
    units = torch.cuda.get_device_properties(DEV).multi_processor_count
    print(f"device {torch.cuda.get_device_name()}, {units} units, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"triton {triton.__version__}", flush=True)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        if args.only and not any(o in name for o in args.only):
            continue
        nbytes = n * k * 2
        sets = copies(lambda i: (torch.randn(n, k, device=DEV, dtype=BF16).div_(k ** 0.5).t().contiguous().t(),),
                      nbytes)
        ones = torch.ones(n, device=DEV, dtype=torch.float32)
        floor_us = nbytes / bw * 1e6
        for m in args.rows:
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            ref = x.double() @ sets[0][0].double().t()
            label = f"{name} x{m}"

            def add(what, cfg, us, got):
                rows_out.append((label, what, str(cfg), f"{us:.1f}", f"{floor_us / us:.2f}", f"{nmse(got, ref):.1e}",
                                 ""))

            for lib in ("cublas", "cublaslt"):
                run, calls = rotated(lambda w, f=library(lib): f(x, w), sets)
                add(lib, "", timed(run, repeats=7, calls=1) / calls, library(lib)(x, sets[0][0]))
            found = []
            for cfg in configs(m, n, k, units):
                try:
                    run, calls = rotated(lambda w, cfg=cfg: triton_gemm(x, w, ones, cfg), sets)
                    found.append((timed(run, repeats=5, calls=1) / calls, cfg))
                except Exception as exc:  # noqa: BLE001  a configuration the compiler refuses
                    print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            for rank, (us, cfg) in enumerate(sorted(found, key=lambda t: t[0])[:3]):
                add(f"triton #{rank + 1}", cfg, us, triton_gemm(x, sets[0][0], ones, cfg))
            print(rows_out[-5:], flush=True)
        del sets
    print_table(rows_out, "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
