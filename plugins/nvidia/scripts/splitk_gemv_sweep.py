"""The split-K matrix-vector kernel (``kernels/triton/splitk_gemv.py``) against what the NVIDIA backend runs
without it, at the bf16 decode shapes of Llama-3.1-8B and Qwen3-1.7B, each product with the fusion the decode
step gives it: qkv with its input's RMSNorm, gate/up with the norm and the gated SiLU, o_proj and down with the
residual add. Rows: "backend, kernel off" (the backend's ops with ``splitk_gemv`` unbound: one row, the fused
matrix-vector kernel, or the norm, cuBLAS and the activation; more rows, the norm, cuBLAS and the activation
or the add); "backend" (its ops as they route: ``chitu_nvidia.ops.splitk_takes``); "kernel" (the kernel
forced, as the backend calls it: gated, the norm, the kernel and the activation), with its default tiles and,
without --no-search, the best of a few; and cuBLAS alone on the product (no fusion). Weights stored as the
backend stores them (transposed), rotated past the L2 cache, graph replays; each against the byte floor of its
weight and against float64. A table last.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/splitk_gemv_sweep.py [NAME_PART ...] [--rows 1 4] [--no-search]
"""

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
import triton

from chitu_core.bench.floor import copy_bandwidth
from chitu_core.kernels.triton.activation import silu_and_mul
from chitu_core.kernels.triton.rms_norm import rms_norm
from chitu_core.kernels.triton.splitk_gemv import SplitKGemvConfig, splitk_gemv, splitk_gemv_config
from chitu_core.ops import reference
from chitu_nvidia import ops

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemv_sweep import copies, print_table, rotated  # noqa: E402
from quant_kernels import DEV, nmse, timed  # noqa: E402

BF16 = torch.bfloat16
SHAPES = {  # name: (N, K, fusion)
    "llama8b qkv": (6144, 4096, "norm"), "llama8b o_proj": (4096, 4096, "add"),
    "llama8b gate_up": (28672, 4096, "gated"), "llama8b down": (4096, 14336, "add"),
    "qwen3-1.7b qkv": (4096, 2048, "norm"), "qwen3-1.7b o_proj": (2048, 2048, "add"),
    "qwen3-1.7b gate_up": (12288, 2048, "gated"), "qwen3-1.7b down": (2048, 6144, "add"),
}


def fused_call(fusion, cfg=None):
    """The product with its fusion: through the backend's ops (``cfg`` None), or ``splitk_gemv`` with ``cfg``
    as the backend calls it."""
    def call(x, w, nw, res):
        if cfg is None:
            if fusion == "add":
                return ops.linear_add(x, w, None, res)
            return ops.rms_norm_linear(x, nw, 1e-5, w, None, "silu" if fusion == "gated" else None)
        if fusion == "add":
            return splitk_gemv(x, w, residual=res, config=cfg)
        if fusion == "gated":
            return silu_and_mul(splitk_gemv(rms_norm(x, nw, 1e-5), w, config=cfg))
        return splitk_gemv(x, w, None, nw, 1e-5, config=cfg)
    return call


def want(fusion, x, w, nw, res):
    x, w = x.double(), w.double()
    if fusion == "add":
        return reference.linear_add(x, w, None, res.double())
    return reference.rms_norm_linear(x, nw.double(), 1e-5, w, None, "silu" if fusion == "gated" else None)


def configs(n, k, units):
    seen = set()
    for bn, bk, stages, fill in itertools.product((64, 128, 256), (64, 128), (3, 4, 6), (1, 2)):
        if stages * bk * bn * 2 > 160 * 1024:
            continue
        split = max(1, min(triton.cdiv(k, 2 * bk), fill * units // triton.cdiv(n, bn)))
        cfg = SplitKGemvConfig(bn, bk, split, stages)
        if cfg not in seen:
            seen.add(cfg)
            yield cfg


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--no-search", action="store_true", help="the default tiles only")
    parser.add_argument("only", nargs="*")
    args = parser.parse_args()
    ops.nvidia_ops()
    kernel = ops._splitk_gemv
    bw = copy_bandwidth(DEV, torch.cuda.synchronize)
    units = torch.cuda.get_device_properties(DEV).multi_processor_count
    print(f"device {torch.cuda.get_device_name()}, {units} units, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"triton {triton.__version__}", flush=True)
    table = []
    for name, (n, k, fusion) in SHAPES.items():
        if args.only and not any(o in name for o in args.only):
            continue
        nbytes = n * k * 2
        sets = copies(lambda i: (torch.randn(n, k, device=DEV, dtype=BF16).div_(k ** 0.5).t().contiguous().t(),),
                      nbytes)
        floor_us = nbytes / bw * 1e6
        n_out = n // 2 if fusion == "gated" else n
        nw = (1 + 0.1 * torch.randn(k, device=DEV)).to(BF16)
        for m in args.rows:
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            res = torch.randn(m, n_out, device=DEV, dtype=BF16)
            ref = want(fusion, x, sets[0][0], nw, res)
            label = f"{name} x{m} +{fusion}"

            def add(what, cfg, fn, check=True):
                run, calls = rotated(lambda w: fn(x, w, nw, res), sets)
                us = timed(run, repeats=7, calls=1) / calls
                err = f"{nmse(fn(x, sets[0][0], nw, res), ref):.1e}" if check else ""
                table.append((label, what, str(cfg), f"{us:.1f}", f"{floor_us / us:.2f}", err, ""))
                return us

            add("cuBLAS, product alone", "", lambda x, w, nw, res: F.linear(x, w), check=False)
            ops._splitk_gemv = None
            add("backend, kernel off", "", fused_call(fusion))
            ops._splitk_gemv = kernel
            add("backend", "", fused_call(fusion))
            default = splitk_gemv_config(n, k, False, units)  # gated: the whole weight, then the activation
            add("kernel, default tiles", default, fused_call(fusion, default))
            if not args.no_search:
                found = []
                for cfg in configs(n, k, units):
                    run, calls = rotated(lambda w, cfg=cfg: fused_call(fusion, cfg)(x, w, nw, res), sets)
                    found.append((timed(run, repeats=5, calls=1) / calls, cfg))
                best = min(found, key=lambda t: t[0])[1]
                add("kernel, best tiles", best, fused_call(fusion, best))
            print(table[-5:], flush=True)
        sets = None  # the next shape's copies in its place
    print_table(table, "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
