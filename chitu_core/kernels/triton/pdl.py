"""Programmatic dependent launch: a kernel launched with it may start while the kernel before it on the
stream finishes, so its launch and its prologue (loading weights, which no earlier kernel writes)
overlap that kernel's tail; device graphs keep the overlap (the edge is recorded as programmatic).

A kernel that opts in takes a ``PDL`` constexpr and
  * calls ``gdc_wait(PDL)`` in every program before it reads anything a kernel of the step may have
    written, writes anything, or returns (a program that returned without waiting could let the grid
    complete before its predecessor, and a kernel after it would then wait on too little). Before the
    wait it reads only weights, constant tables and the step's inputs (token positions, cache slots,
    sequence lengths, block tables: copied in before the step or by its first kernel, never by a model's
    kernel): a kernel starts only once every program of the one before has passed its own wait, so
    anything written two kernels back or earlier is complete; and it may ask for lines to be brought
    into L2 (``l2_prefetch``), a hint that cannot make anything read stale;
  * calls ``gdc_launch_dependents(PDL)`` once it is fine for the next kernel to be scheduled (at once
    after the wait: the next kernel's programs only wait, and only once all of this grid has started);
    ``gdc_enter(PDL)`` does both, the way every kernel here starts (a matrix-vector kernel first issues
    its first weight load, which no earlier kernel writes);
  * is launched with ``launch_pdl=True`` where ``pdl_launch(device)`` says the backend allows it and
    the device and Triton support it. Kernels that do not opt in are launched as before and wait for their predecessor whole.

CHITU_PDL=0 turns it off (to compare, or to rule it out).
"""

import os
from functools import cache

import torch
import triton
import triton.language as tl

PDL_ENV = "CHITU_PDL"
_allowed = False


def allow(on: bool = True) -> None:
    """Let kernels launch dependent (off until a backend asks: the NVIDIA backend does when its ops are
    resolved). Another vendor's PyTorch may present its devices as ``cuda`` with a Triton build that has
    no such launch; its backend leaves this off."""
    global _allowed
    _allowed = on
    pdl_launch.cache_clear()


@cache
def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` may be launched dependent: allowed by the backend (``allow``),
    Triton's CUDA backend with the ``launch_pdl`` option, a device of compute capability 9.0 or newer,
    and CHITU_PDL not "0"."""
    if not _allowed or os.environ.get(PDL_ENV, "1") == "0" or device.type != "cuda" or torch.version.cuda is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        target = triton.runtime.driver.active.get_current_target()
    except (ImportError, RuntimeError, AttributeError):
        return False
    if target.backend != "cuda" or "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def gdc_enter(PDL: tl.constexpr):
    """What a kernel that opts in does first: wait for its predecessor, then let its successor be scheduled."""
    gdc_wait(PDL)
    gdc_launch_dependents(PDL)


@triton.jit
def gdc_wait(PDL: tl.constexpr):
    """Wait until the kernel before this one has completed and its writes are visible (PDL only)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def gdc_launch_dependents(PDL: tl.constexpr):
    """Let the next kernel be scheduled once every program of this one has got here (PDL only)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptrs, PDL: tl.constexpr):
    """Ask for the 128-byte lines at ``ptrs`` to be brought into the L2 cache, without waiting for them (PDL
    only: what a kernel reads before its wait while the kernel before it finishes, so that its first loads
    after the wait find their lines in L2 or on the way). A hint: a line a later kernel writes is not read
    stale, since the write lands in L2 as well."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def pdl_options(device: torch.device) -> dict:
    """Launch keywords for a kernel that opts in: its ``PDL`` constexpr, and ``launch_pdl`` where on."""
    return {"PDL": True, "launch_pdl": True} if pdl_launch(device) else {"PDL": False}
