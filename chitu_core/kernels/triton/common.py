"""Launcher helpers shared by the kernel families."""

from functools import cache

import torch
import triton


def pow2(n: int, at_least: int = 1) -> int:
    """The smallest power of two >= max(n, at_least): Triton block shapes are powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), at_least)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as a 2-D [rows, H] view with any strides, or a contiguous copy where no view exists."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def as_row_grid(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as a 3-D [A, B, H] view with any strides, its A * B rows in x's order: a 2-D view where
    one exists (B = 1), else [..., B, H] with the leading dimensions merged (a per-head slice of a fused
    projection's output, [T, heads, D], needs no copy), or a contiguous copy where neither exists."""
    h = x.shape[-1]
    try:
        return x.view(-1, 1, h)
    except RuntimeError:
        pass
    if x.dim() >= 3:
        try:
            return x.view(-1, x.shape[-2], h)
        except RuntimeError:
            pass
    return x.reshape(-1, 1, h)


@cache
def num_compute_units(device: torch.device) -> int:
    """Multiprocessors (or the device's equivalent) of ``device``; 64 where torch does not say (the
    interpreter). Cached: launchers ask on every call."""
    try:
        return int(getattr(torch, device.type).get_device_properties(device).multi_processor_count)
    except (AttributeError, RuntimeError, AssertionError):
        return 64
