"""Batch-1 (M = 1) sweep of the quantized matrix-vector kernels at Llama-3.1-8B's shapes: int4's portable
one (``kernels/triton/gemv.py``, kind ``portable``), the NVIDIA plugin's fp16-pair one
(``chitu_nvidia.int4_gemv``, kind ``pairs``) and 8-bit digit one (``chitu_nvidia.int4_digits``, kind
``digits``), and the plugin's FP8 block one (``chitu_nvidia.fp8_gemv``, kind ``fp8``, beside
``quant_matmul``'s tiles), each beside its default path and a bf16 cuBLAS matmul, against the byte floor of
its shape.

Weights are rotated through enough copies to exceed the L2 cache (a decode step reads every weight
once, from memory), the calls replayed from a CUDA graph (``quant_kernels.timed``). For each shape and
kind: the fastest config, its time, share of the floor, and its error against the float64 reference;
also whether two calls give the same bits (the split-K order is fixed). A table last.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/gemv_sweep.py [portable] [pairs] [digits] [fp8] [fused]

(every kind when none is named; ``fused``: contract 1.18's fusions at each product, fused and not).
"""

import itertools
import sys

import torch

from chitu_core.bench.floor import copy_bandwidth
from chitu_core.kernels.triton.gemv import GemvConfig
from chitu_core.kernels.triton.gemv import int4_gemv as int4_gemv_portable
from chitu_core.kernels.triton.int4_linear import int4_linear
from chitu_core.kernels.triton.fp8_linear import fp8_linear
from chitu_nvidia.fp8_gemv import fp8_gemv, fp8_gemv_config
from chitu_nvidia.int4_digits import int4_digits_config, int4_digits_gemv
from chitu_nvidia.int4_gemv import int4_gemv, int4_gemv_config
from chitu_core.ops import quant_reference as ref
from chitu_core.ops import reference

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_kernels import DEV, SHAPES, nmse, operands, timed  # noqa: E402

L2_BYTES = 120 << 20  # copies of a weight until the set is this large (H100 L2: 50 MB)


def print_table(rows, last: str) -> None:
    """The sweep's rows as a markdown table (shape, kernel, config, us, of floor, nmse, ``last``)."""
    print(f"| shape | kernel | config | us | of floor | nmse | {last} |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def copies(make, nbytes: int):
    return [make(i) for i in range(max(2, -(-L2_BYTES // nbytes)))]


def rotated(fn, sets):
    """One call per weight copy: the graph replays them all, so no call finds its weight in L2."""
    def run():
        for args in sets:
            fn(*args)
    return lambda: run(), len(sets)


def best_of(fn_for, configs, sets):
    best = None
    for cfg in configs:
        try:
            run, calls = rotated(fn_for(cfg), sets)
            us = timed(run, repeats=7, calls=1) / calls
        except Exception as exc:  # noqa: BLE001  a config the kernel refuses
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            continue
        if best is None or us < best[0]:
            best = (us, cfg)
    return best


def tiles(n: int, units: int, block_ns, block_ks, per_units, warps):
    """GemvConfig for every combination: block_n columns, block_k features a step, K split until there are
    about per_unit programs a compute unit, warps a program."""
    return [GemvConfig(bn, bk, max(1, -(-per_unit * units // -(-n // bn))), w)
            for bn, bk, per_unit, w in itertools.product(block_ns, block_ks, per_units, warps)]


def int4_configs(n: int, units: int):
    return tiles(n, units, (64, 128, 256), (64, 128), (1, 2, 4), (4, 8))


def pairs_configs(n: int, units: int):
    return tiles(n, units, (128, 256, 512), (32, 64), (2, 4, 8), (1, 2, 4))


def digits_configs(n: int, units: int):
    return tiles(n, units, (256, 512), (32, 64), (2, 4, 8), (2, 4))


def fp8_configs(n: int, units: int):
    return tiles(n, units, (32, 64, 128), (128,), (2, 4, 8), (2, 4, 8))


def timed_rotated(fn, sets) -> float:
    run, calls = rotated(fn, sets)
    return timed(run, repeats=7, calls=1) / calls


def int4_rows(sname, x, n, k, kinds, units, bw):
    args, wbytes = operands("int4_linear", n, k, "g128")
    sets = copies(lambda i: operands("int4_linear", n, k, "g128")[0] if i else args, wbytes)
    want = ref.int4_linear(x.double(), *args)
    us = timed_rotated(lambda *a: int4_linear(x, *a), sets)
    rows = [(sname, "int4 portable int4_linear", "default", f"{us:.1f}", f"{wbytes / bw * 1e6 / us:.2f}", "", "")]
    cfg = int4_gemv_config(n, k, 128, units)
    us = timed_rotated(lambda *a: int4_gemv(x, *a, cfg), sets)
    rows.append((sname, "int4 pairs default", str(cfg), f"{us:.1f}", f"{wbytes / bw * 1e6 / us:.2f}",
                 f"{nmse(int4_gemv(x, *args), want):.1e}", ""))
    tried = []
    if "digits" in kinds:
        cfg = int4_digits_config(n, k, 128, units)
        us = timed_rotated(lambda *a: int4_digits_gemv(x, *a, cfg), sets)
        rows.append((sname, "int4 digits default", str(cfg), f"{us:.1f}", f"{wbytes / bw * 1e6 / us:.2f}",
                     f"{nmse(int4_digits_gemv(x, *args), want):.1e}", ""))
        tried.append(("int4 digits gemv", int4_digits_gemv, digits_configs(n, units)))
    if "portable" in kinds:
        tried.append(("int4 portable gemv", int4_gemv_portable, int4_configs(n, units)))
    if "pairs" in kinds:
        tried.append(("int4 pairs gemv", int4_gemv, pairs_configs(n, units)))
    for label, kernel, configs in tried:
        us, cfg = best_of(lambda c, kernel=kernel: (lambda q, s, z, g, b: kernel(x, q, s, z, g, b, c)), configs, sets)
        got, again = kernel(x, *args, cfg), kernel(x, *args, cfg)
        rows.append((sname, label, str(cfg), f"{us:.1f}", f"{wbytes / bw * 1e6 / us:.2f}", f"{nmse(got, want):.1e}",
                     "yes" if torch.equal(got, again) else "NO"))
    return rows


FUSIONS = {"qkv": "norm", "o": "add", "gate_up": "silu", "down": "add"}  # contract 1.18's, as the layers call them


def fused_rows(sname, x, n, k, bw):
    """Contract 1.18's fusion at this product (the norm before qkv, the norm and the activation around gate/up,
    the residual after o and down) in the NVIDIA op's kernel, against the same in its unfused ops (the Triton
    norm, ``int4_linear``, the activation or a torch add) and the product alone."""
    from chitu_nvidia import ops

    ops.nvidia_ops()
    fusion = FUSIONS[sname]
    args, wbytes = operands("int4_linear", n, k, "g128")
    sets = copies(lambda i: operands("int4_linear", n, k, "g128")[0] if i else args, wbytes)
    nw = (1 + 0.1 * torch.randn(k, device=DEV)).to(x.dtype)
    res = torch.randn(1, n, device=DEV, dtype=x.dtype)
    act = None if fusion in ("norm", "add") else fusion
    if fusion == "add":
        fused = lambda q, s, z, g, b: ops.int4_linear_add(x, q, s, z, g, b, res)  # noqa: E731
        unfused = lambda q, s, z, g, b: res + ops.int4_linear(x, q, s, z, g, b)  # noqa: E731
        want = ref.int4_linear(x.double(), *args) + res.double()
    else:
        fused = lambda q, s, z, g, b: ops.int4_rms_norm_linear(x, nw, 1e-5, q, s, z, g, b, act)  # noqa: E731

        def unfused(q, s, z, g, b):
            return ops._gated(ops.int4_linear(ops._unfused["rms_norm"](x, nw, 1e-5), q, s, z, g, b), act)
        want = reference.int4_rms_norm_linear(x.double(), nw.double(), 1e-5, *args, act)
    rows = []
    for label, fn in (("int4 product alone", lambda *a: int4_gemv(x, *a)), (f"int4 {fusion} unfused", unfused),
                      (f"int4 {fusion} fused", fused)):
        us = timed_rotated(fn, sets)
        rows.append((sname, label, "default", f"{us:.1f}", f"{wbytes / bw * 1e6 / us:.2f}",
                     "" if label.endswith("alone") else f"{nmse(fn(*args), want):.1e}", ""))
    if act is not None:  # the kernel's gated form (a tile of each half a program), which the op does not take
        units = torch.cuda.get_device_properties(DEV).multi_processor_count
        for bn, bk, warps, per_unit in ((256, 32, 2, 8), (128, 32, 1, 8), (512, 32, 4, 8), (256, 64, 2, 8),
                                        (256, 32, 2, 4), (128, 64, 1, 16)):
            cfg = GemvConfig(bn, bk, max(1, -(-per_unit * units // -(-n // 2 // bn))), warps)

            def gated(q, s, z, g, b, cfg=cfg):
                return int4_gemv(x, q, s, z, g, b, cfg, norm_weight=nw, eps=1e-5, activation=act)
            us = timed_rotated(gated, sets)
            rows.append((sname, f"int4 {fusion} gated kernel", str(cfg), f"{us:.1f}", f"{wbytes / bw * 1e6 / us:.2f}",
                         f"{nmse(gated(*args), want):.1e}", ""))
    return rows


def fp8_rows(sname, x, n, k, units, bw):
    block = (128, 128)
    args, wbytes = operands("fp8_linear", n, k, "block")
    sets = copies(lambda i: operands("fp8_linear", n, k, "block")[0] if i else args, wbytes)
    w, s = args[0], args[1]
    want = ref.fp8_linear(x.double(), w, s, block, False, None)
    us = timed_rotated(lambda w, s, *_: fp8_linear(x, w, s, block, False, None), sets)
    rows = [(sname, "fp8 quant_matmul", "default", f"{us:.1f}", f"{wbytes / bw * 1e6 / us:.2f}",
             f"{nmse(fp8_linear(x, w, s, block, False, None), want):.1e}", "")]
    cfg = fp8_gemv_config(n, k, units)
    us = timed_rotated(lambda w, s, *_: fp8_gemv(x, w, s, block, None, cfg), sets)
    rows.append((sname, "fp8 pairs default", str(cfg), f"{us:.1f}", f"{wbytes / bw * 1e6 / us:.2f}",
                 f"{nmse(fp8_gemv(x, w, s, block, None), want):.1e}", ""))
    us, cfg = best_of(lambda c: (lambda w, s, *_: fp8_gemv(x, w, s, block, None, c)), fp8_configs(n, units), sets)
    got, again = fp8_gemv(x, w, s, block, None, cfg), fp8_gemv(x, w, s, block, None, cfg)
    rows.append((sname, "fp8 pairs gemv", str(cfg), f"{us:.1f}", f"{wbytes / bw * 1e6 / us:.2f}",
                 f"{nmse(got, want):.1e}", "yes" if torch.equal(got, again) else "NO"))
    return rows


def main() -> int:
    kinds = sys.argv[1:] or ["portable", "pairs", "digits", "fp8", "fused"]
    bw = copy_bandwidth(DEV, torch.cuda.synchronize)
    units = torch.cuda.get_device_properties(DEV).multi_processor_count
    print(f"device {torch.cuda.get_device_name()}, {units} units, copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for sname, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        w16 = copies(lambda i: (torch.randn(n, k, device=DEV, dtype=torch.bfloat16),), n * k * 2)
        us16 = timed(rotated(lambda w: x @ w.T, w16)[0], repeats=7, calls=1) / len(w16)
        rows.append((sname, "bf16 cuBLAS", "", f"{us16:.1f}", f"{n * k * 2 / bw * 1e6 / us16:.2f}", "", ""))
        del w16
        if "portable" in kinds or "pairs" in kinds or "digits" in kinds:
            rows += int4_rows(sname, x, n, k, kinds, units, bw)
        if "fp8" in kinds:
            rows += fp8_rows(sname, x, n, k, units, bw)
        if "fused" in kinds:
            rows += fused_rows(sname, x, n, k, bw)
        print(rows[-7:], flush=True)
    print_table(rows, "same bits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
