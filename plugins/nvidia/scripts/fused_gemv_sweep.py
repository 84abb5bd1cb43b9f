"""The decode-step fusions (``kernels/triton/fused_gemv.py``) against the unfused ops they replace, at the
decode shapes of SmolLM2-135M, Qwen3-1.7B and Llama-3.1-8B, for 1, 2, 4 and 8 rows: norm + QKV (RMSNorm,
then the NVIDIA linear), norm + gate/up + SiLU (RMSNorm, linear, silu_and_mul), o_proj and down + residual
(linear, then the add). Each against the byte floor of its weight, with an NMSE against float64.

Weights as the NVIDIA backend stores them (transposed), rotated through enough copies to exceed the L2
cache and replayed from a CUDA graph with dependent launch on (``quant_kernels.timed``). SEARCH=1 also
tries other tiles and prints the best three; ROWS="1 4" picks the row counts. A table last.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/fused_gemv_sweep.py [NAME_PART ...]
"""

import itertools
import os
import sys

import torch
import triton

from chitu_core.bench.floor import copy_bandwidth
from chitu_core.kernels.triton.activation import silu_and_mul
from chitu_core.kernels.triton.fused_gemv import FusedGemvConfig, fused_gemv, fused_gemv_config
from chitu_core.kernels.triton.pdl import allow, pdl_launch
from chitu_core.kernels.triton.rms_norm import rms_norm
from chitu_core.ops import reference

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemv_sweep import copies, print_table, rotated  # noqa: E402
from quant_kernels import DEV, nmse, timed  # noqa: E402

BF16 = torch.bfloat16
SHAPES = {  # name: (N, K, kind): "norm" (norm + linear), "gated" (norm + linear + silu), "residual" (linear + add)
    "smollm qkv": (960, 576, "norm"), "smollm o_proj": (576, 576, "residual"),
    "smollm gate_up": (3072, 576, "gated"), "smollm down": (576, 1536, "residual"),
    "qwen3-1.7b qkv": (4096, 2048, "norm"), "qwen3-1.7b o_proj": (2048, 2048, "residual"),
    "qwen3-1.7b gate_up": (12288, 2048, "gated"), "qwen3-1.7b down": (2048, 6144, "residual"),
    "llama8b qkv": (6144, 4096, "norm"), "llama8b o_proj": (4096, 4096, "residual"),
    "llama8b gate_up": (28672, 4096, "gated"), "llama8b down": (4096, 14336, "residual"),
}
ROWS = tuple(int(r) for r in os.environ.get("ROWS", "1 2 4 8").split())


def unfused(kind, x, w, nw, res, linear):
    if kind == "residual":
        return res + linear(x, w, None)
    y = linear(rms_norm(x, nw, 1e-6), w, None)
    return silu_and_mul(y) if kind == "gated" else y


def fused(kind, x, w, nw, res, cfg=None):
    if kind == "residual":
        return fused_gemv(x, w, None, residual=res, config=cfg)
    return fused_gemv(x, w, None, nw, 1e-6, "silu" if kind == "gated" else None, config=cfg)


def want(kind, x, w, nw, res):
    if kind == "residual":
        return reference.linear_add(x.double(), w.double(), None, res.double())
    return reference.rms_norm_linear(x.double(), nw.double(), 1e-6, w.double(), None,
                                     "silu" if kind == "gated" else None)


def tiles(rows):
    if rows == 1:
        return [FusedGemvConfig(bn, bk, wp) for bn, bk, wp in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8))
                if bn * bk <= 16384]
    return [FusedGemvConfig(bn, bk, wp, st) for bn, bk, wp, st in itertools.product((16, 32, 64), (64, 128, 256), (4, 8),
                                                                                  (2, 3, 4)) if bn * bk <= 8192]


def main() -> int:
    allow()
    from chitu_nvidia import ops as nv_ops

    nv_ops.nvidia_ops()  # binds the backend's linear to its matrix-vector kernel
    bw = copy_bandwidth(DEV, torch.cuda.synchronize)
    units = torch.cuda.get_device_properties(DEV).multi_processor_count
    print(f"device {torch.cuda.get_device_name()}, {units} units, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"triton {triton.__version__}, dependent launch {pdl_launch(DEV)}", flush=True)
    rows_out, only = [], sys.argv[1:]
    for name, (n, k, kind) in SHAPES.items():
        if only and not any(o in name for o in only):
            continue
        nbytes = n * k * 2
        sets = copies(lambda i: (torch.randn(n, k, device=DEV, dtype=BF16).div_(k ** 0.5).t().contiguous().t(),), nbytes)
        nw = (1 + 0.3 * torch.randn(k, device=DEV)).to(BF16)
        floor_us = nbytes / bw * 1e6
        for rows in ROWS:
            x = torch.randn(rows, k, device=DEV, dtype=BF16)
            res = torch.randn(rows, n, device=DEV, dtype=BF16)
            ref = want(kind, x, sets[0][0], nw, res)
            label = f"{name} x{rows}"

            def add(what, cfg, us, got):
                rows_out.append((label, what, str(cfg), f"{us:.1f}", f"{floor_us / us:.2f}", f"{nmse(got, ref):.1e}", ""))

            run, calls = rotated(lambda w: unfused(kind, x, w, nw, res, nv_ops.linear), sets)
            add("unfused", "", timed(run, repeats=7, calls=1) / calls, unfused(kind, x, sets[0][0], nw, res, nv_ops.linear))
            cfg = fused_gemv_config(n, k, False, rows, kind == "gated", units)
            run, calls = rotated(lambda w: fused(kind, x, w, nw, res, cfg), sets)
            add("fused default", cfg, timed(run, repeats=7, calls=1) / calls, fused(kind, x, sets[0][0], nw, res, cfg))
            found = []
            for alt in tiles(rows) if os.environ.get("SEARCH", "0") == "1" else ():
                run, calls = rotated(lambda w: fused(kind, x, w, nw, res, alt), sets)
                found.append((timed(run, repeats=5, calls=1) / calls, alt))
            for rank, (us, alt) in enumerate(sorted(found, key=lambda t: t[0])[:3]):
                add(f"fused #{rank + 1}", alt, us, fused(kind, x, sets[0][0], nw, res, alt))
            print(rows_out[-2 - min(3, len(found)):], flush=True)
        del sets
    print_table(rows_out, "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
