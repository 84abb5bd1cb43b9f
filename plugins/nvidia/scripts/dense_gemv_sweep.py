"""Batch-1 (M = 1) sweep of the dense matrix-vector kernel (``kernels/triton/dense_gemv.py``) against
cuBLAS at the decode shapes of DeepSeek-V2-Lite, Qwen3-30B-A3B and Llama-3.1-8B, each against the byte
floor of its shape, with and without programmatic dependent launch; then the MLA decode attention's
split counts at batch 1.

Weights are laid out as the NVIDIA backend stores them (linear layers transposed, routers row-major),
rotated through enough copies to exceed the L2 cache and replayed from a CUDA graph
(``quant_kernels.timed``). A chain of dependent calls checks that dependent launches wait for their
inputs (same bits as without). A table last.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/dense_gemv_sweep.py [NAME_PART ...]

SEARCH=0: the default tiles against cuBLAS only, no search of tiles.
"""

import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton

from chitu_core.bench.floor import copy_bandwidth
from chitu_core.kernels.triton.dense_gemv import DenseGemvConfig, dense_gemv, dense_gemv_config
from chitu_core.kernels.triton.pdl import allow, pdl_launch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemv_sweep import copies, print_table, rotated  # noqa: E402
from quant_kernels import DEV, nmse, timed  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
SHAPES = {  # name: (N, K, dtype, stored transposed)
    "v2lite q_proj": (3072, 2048, BF16, True), "v2lite kv_a": (576, 2048, BF16, True),
    "v2lite o_proj": (2048, 2048, BF16, True), "v2lite shared gate_up": (5632, 2048, BF16, True),
    "v2lite shared down": (2048, 2816, BF16, True), "v2lite router f32": (64, 2048, F32, False),
    "v2lite dense down": (2048, 10944, BF16, True), "v2lite lm_head": (102400, 2048, BF16, True),
    "qwen3moe qkv": (5120, 2048, BF16, True), "qwen3moe o_proj": (2048, 4096, BF16, True),
    "qwen3moe router": (128, 2048, BF16, False),
    "llama8b qkv": (6144, 4096, BF16, True), "llama8b o_proj": (4096, 4096, BF16, True),
    "llama8b gate_up": (28672, 4096, BF16, True), "llama8b down": (4096, 14336, BF16, True),
    "smollm qkv": (960, 576, BF16, True), "smollm o_proj": (576, 576, BF16, True),
    "smollm gate_up": (3072, 576, BF16, True), "smollm down": (576, 1536, BF16, True),
    "smollm lm_head": (49152, 576, BF16, True),
    "qwen3-1.7b qkv": (4096, 2048, BF16, True), "qwen3-1.7b o_proj": (2048, 2048, BF16, True),
    "qwen3-1.7b down": (2048, 6144, BF16, True),
    # one rank's share of Llama-3.1-8B's under two-way tensor parallelism
    "llama8b tp2 qkv": (3072, 4096, BF16, True), "llama8b tp2 o_proj": (4096, 2048, BF16, True),
    "llama8b tp2 gate_up": (14336, 4096, BF16, True), "llama8b tp2 down": (4096, 7168, BF16, True),
}


def weight(n, k, dtype, transposed):
    w = torch.randn(n, k, device=DEV, dtype=dtype) / k ** 0.5
    return w.t().contiguous().t() if transposed else w


def configs(n, k, transposed, units):
    if not transposed:
        out = []
        for (bn, bk), per_unit, warps in itertools.product(((8, 512), (16, 256), (16, 512), (32, 256), (8, 1024)),
                                                           (2, 4, 8), (4, 8)):
            split = max(1, min(triton.cdiv(k, bk) // 2, triton.cdiv(per_unit * units, triton.cdiv(n, bn))))
            out.append(DenseGemvConfig(bn, bk, split, warps))
        return sorted(set(out), key=str)
    out = []  # narrow, deep tiles without a split (the default's family), and the split-K ones it replaced
    for bn, bk, warps in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8)):
        if bn * bk <= 32768:
            out.append(DenseGemvConfig(bn, bk, 1, warps))
    for (bn, bk), per_unit in itertools.product(((64, 128), (128, 64), (64, 256), (32, 256), (32, 512), (64, 512)),
                                                (2, 4)):
        split = max(1, min(triton.cdiv(k, bk) // 2, triton.cdiv(per_unit * units, triton.cdiv(n, bn))))
        out.append(DenseGemvConfig(bn, bk, split, 4))
    return sorted(set(out), key=str)


def chain_check() -> str:
    """32 dependent calls (each one's output the next one's input), with and without dependent launch."""
    ws = [weight(2048, 2048, BF16, True) for _ in range(32)]
    x0 = torch.randn(1, 2048, device=DEV, dtype=BF16)
    outs = {}
    for pdl in (False, True):
        buf = torch.empty(1, 2048, device=DEV, dtype=BF16)
        def run():
            y = x0
            for w in ws:
                y = dense_gemv(y, w, None, None, pdl)
            buf.copy_(y)
        timed(run, repeats=3, calls=1)
        outs[pdl] = buf.clone()
    y = x0.double()
    for w in ws:
        y = (y @ w.double().t()).to(BF16).double()
    return f"equal bits {torch.equal(outs[False], outs[True])}, nmse against float64 {nmse(outs[True], y):.1e}"


def mla_rows(units):
    from chitu_core.kernels.triton.mla_attention import mla_attention, plan, write_latent  # noqa: F401
    rows, heads, lora, rope, bs, layers = [], 16, 512, 64, 16, 27
    for ctx in (256, 384, 1024, 4096):
        blocks = -(-ctx // bs)
        caches = [torch.randn(blocks, bs, lora + rope, device=DEV, dtype=BF16) for _ in range(layers)]
        q = torch.randn(1, heads, lora + rope, device=DEV, dtype=BF16)
        tables = torch.arange(blocks, device=DEV, dtype=torch.int32)[None]
        seq_lens = torch.tensor([ctx], device=DEV, dtype=torch.int32)
        qsl = torch.tensor([0, 1], device=DEV, dtype=torch.int32)
        ref = None
        for splits in (1, 2, 4, 8, 16, 32):
            step = plan(heads, 1, 1, ctx, units, splits)
            fn = lambda: [mla_attention(q, c, tables, seq_lens, qsl, 0.1, lora, step) for c in caches]  # noqa: E731
            us = timed(fn, repeats=7, calls=1) / layers
            got = mla_attention(q, caches[0], tables, seq_lens, qsl, 0.1, lora, step)
            ref = got if ref is None else ref
            rows.append((f"mla b1 ctx {ctx}", f"splits {splits}", "", f"{us:.1f}", "", f"{nmse(got, ref):.1e}", ""))
        print(rows[-6:], flush=True)
    return rows


def main() -> int:
    allow()  # as the NVIDIA backend does once its ops are resolved
    bw = copy_bandwidth(DEV, torch.cuda.synchronize)
    units = torch.cuda.get_device_properties(DEV).multi_processor_count
    print(f"device {torch.cuda.get_device_name()}, {units} units, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"triton {triton.__version__}, dependent launch {pdl_launch(DEV)}", flush=True)
    print("chain:", chain_check(), flush=True)
    rows, only = [], sys.argv[1:]  # names containing any of these (default: all, and the MLA rows)
    for name, (n, k, dtype, transposed) in SHAPES.items():
        if only and not any(o in name for o in only):
            continue
        nbytes = n * k * dtype.itemsize
        x = torch.randn(1, k, device=DEV, dtype=dtype)
        sets = copies(lambda i: (weight(n, k, dtype, transposed),), nbytes)
        floor_us = nbytes / bw * 1e6
        def add(label, cfg, us, got=None):
            err = "" if got is None else f"{nmse(got, x.double() @ sets[0][0].double().t()):.1e}"
            rows.append((name, label, str(cfg), f"{us:.1f}", f"{floor_us / us:.2f}", err, ""))
        run, calls = rotated(lambda w: F.linear(x, w), sets)
        add("cuBLAS", "", timed(run, repeats=7, calls=1) / calls)
        default = dense_gemv_config(n, k, not transposed, units)
        for pdl in (False, True):
            run, calls = rotated(lambda w: dense_gemv(x, w, None, default, pdl), sets)
            add(f"ours default{' pdl' if pdl else ''}", default, timed(run, repeats=7, calls=1) / calls,
                dense_gemv(x, sets[0][0], None, default, pdl))
        timings = []
        for cfg in configs(n, k, transposed, units) if os.environ.get("SEARCH", "1") != "0" else ():
            run, calls = rotated(lambda w: dense_gemv(x, w, None, cfg, True), sets)
            timings.append((timed(run, repeats=5, calls=1) / calls, cfg))
        for rank, (us, cfg) in enumerate(sorted(timings, key=lambda t: t[0])[:3]):
            add(f"ours #{rank + 1} pdl", cfg, us, dense_gemv(x, sets[0][0], None, cfg, True) if rank == 0 else None)
        print(rows[-6:], flush=True)
        del sets
    if not only:
        rows += mla_rows(units)
    print_table(rows, "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
