"""What bounds a batch-1 product at Llama-3.1-8B's int4 shapes, besides its bytes: each row a kernel replayed
back to back from a CUDA graph (``quant_kernels.timed``), dependent launch as the backend sets it
(CHITU_PDL=0 to compare):

* an empty kernel (the dependent-launch wait and one store a program) at 1, 1, 4 and 8 programs per compute
  unit: what a launch costs before any byte moves, by grid size;
* the NVIDIA int4 kernels (``chitu_nvidia.int4_digits``, the backend's, and ``chitu_nvidia.int4_gemv``, the
  fp16 pairs; their default tiles) with their weights rotated through enough copies to exceed the L2 cache
  (as a decode step reads them) and with one weight every call (L2-hot): how much of their time is the
  weight stream;
* a plain read of the same number of bytes (1, 2, 4 or 8 programs a unit, 4 loads in flight a thread),
  rotated and L2-hot: what any kernel of that size can do.

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/bounds_check.py

Prints a table (floor: the bytes over the copy bandwidth measured here).
"""

import sys

import torch
import triton
import triton.language as tl

from chitu_core.bench.floor import copy_bandwidth
from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.pdl import allow, gdc_enter, pdl_options

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemv_sweep import copies  # noqa: E402
from quant_kernels import DEV, SHAPES, operands, timed  # noqa: E402

READ_TILES = ((8, 4), (4, 8), (2, 8), (1, 8))  # programs a unit, warps a program


@triton.jit
def _read(buf, out, n_per, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p xors its n_per int32 (a multiple of 4 BLOCK) from p n_per on, four loads in flight."""
    base = buf + tl.program_id(0).to(tl.int64) * n_per
    offs = tl.arange(0, BLOCK)
    gdc_enter(PDL)
    a0 = tl.zeros((BLOCK,), tl.int32)
    a1, a2, a3 = a0, a0, a0
    for i in range(0, n_per, 4 * BLOCK):
        a0 ^= tl.load(base + i + offs)
        a1 ^= tl.load(base + i + BLOCK + offs)
        a2 ^= tl.load(base + i + 2 * BLOCK + offs)
        a3 ^= tl.load(base + i + 3 * BLOCK + offs)
    tl.store(out + tl.program_id(0), tl.sum((a0 ^ a1) ^ (a2 ^ a3), axis=0))


@triton.jit
def _empty(out, PDL: tl.constexpr):
    gdc_enter(PDL)
    tl.store(out + tl.program_id(0), 1)


def read_us(nbytes: int, hot: bool, per_unit: int, warps: int, units: int) -> float:
    """Microseconds a read of about nbytes (rounded up to whole steps of every program) takes."""
    programs, block = per_unit * units, 256 * warps
    n_per = -(-nbytes // 4 // programs // (4 * block)) * 4 * block
    def new(_):
        return torch.zeros(programs * n_per, dtype=torch.int32, device=DEV)

    bufs = [new(0)] if hot else copies(new, nbytes)
    out = torch.empty(programs, dtype=torch.int32, device=DEV)
    calls = bufs * 4 if hot else bufs

    def run():
        for b in calls:
            _read[(programs,)](b, out, n_per, BLOCK=block, num_warps=warps, **pdl_options(DEV))
    return timed(run, repeats=7, calls=1) / len(calls)


def main() -> None:
    from chitu_nvidia.int4_digits import int4_digits_gemv
    from chitu_nvidia.int4_gemv import int4_gemv

    allow()  # as the NVIDIA backend does when its ops are resolved
    bw = copy_bandwidth(DEV, torch.cuda.synchronize)
    units = num_compute_units(DEV)
    print(f"device {torch.cuda.get_device_name(DEV)}, {units} units, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"triton {triton.__version__}, dependent launch {bool(pdl_options(DEV)['PDL'])}", flush=True)
    sink = torch.empty(8 * units, dtype=torch.int32, device=DEV)
    rows = []
    for grid in (1, units, 4 * units, 8 * units):
        us = timed(lambda: _empty[(grid,)](sink, **pdl_options(DEV)), repeats=7, calls=20)
        rows.append((f"empty kernel, {grid} programs", "", f"{us:.2f}", "", ""))
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        args, nbytes = operands("int4_linear", n, k, "g128")
        sets = copies(lambda i: operands("int4_linear", n, k, "g128")[0] if i else args, nbytes)
        floor = nbytes / bw * 1e6
        for kname, kernel in (("digits", int4_digits_gemv), ("pairs", int4_gemv)):
            rotated = timed(lambda: [kernel(x, *a[:4], None) for a in sets], repeats=7, calls=1) / len(sets)
            hot = timed(lambda: [kernel(x, *args[:4], None) for _ in range(8)], repeats=7, calls=1) / 8
            rows.append((f"{name} int4 {kname} kernel", f"{floor:.2f}", f"{rotated:.2f}", f"{hot:.2f}",
                         f"{floor / rotated:.2f}"))
        for per_unit, warps in READ_TILES:
            rotated = read_us(nbytes, False, per_unit, warps, units)
            hot = read_us(nbytes, True, per_unit, warps, units)
            rows.append((f"{name} plain read, {per_unit} a unit x {warps} warps", f"{floor:.2f}", f"{rotated:.2f}",
                         f"{hot:.2f}", f"{floor / rotated:.2f}"))
        print(rows[-len(READ_TILES) - 2:], flush=True)
    print("| what | floor us | us | L2-hot us | of floor |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
