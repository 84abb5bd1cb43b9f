"""STAND-IN for ``torch.npu`` (torch_npu's device namespace), on the host: one pretend NPU whose memory is
the host's. Only what chitu-ascend calls exists; each function has the signature of torch_npu's."""

import os

import torch

DEVICE_NAME = "Ascend stand-in (CPU tensors, tests/ascend_standin)"


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def get_device_name(device=None) -> str:
    return DEVICE_NAME


def set_device(device) -> None:
    pass


def synchronize(device=None) -> None:
    pass  # CPU work is done when the call returns


def mem_get_info(device=None) -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def memory_reserved(device=None) -> int:
    return 0


def memory_allocated(device=None) -> int:
    return 0


def max_memory_allocated(device=None) -> int:
    return 0


def reset_peak_memory_stats(device=None) -> None:
    pass


class Event:
    """torch.npu.Event: ``record()`` then ``synchronize()``; host work is already finished."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def install() -> None:
    """What importing torch_npu does to torch: ``torch.npu`` becomes this namespace."""
    import sys

    torch.npu = sys.modules[__name__]
