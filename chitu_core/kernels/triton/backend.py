"""``TritonBackend``: what every backend of a device that runs the portable Triton kernels shares.

It serves a device that PyTorch exposes as ``torch.cuda`` (CUDA builds, ROCm/HIP builds such as
Hygon's DTK, MetaX's MACA build): device queries, memory, the Triton op table and attention, device
graphs, pinned staging buffers, completion events, peak-memory measurement and the KV-cache budget.
A vendor's plugin subclasses it with what is its own:

  stack_problem()        why this PyTorch build is not the vendor's stack ("" where it is)
  device_problem(index)  why visible device ``index`` is not one of the vendor's ("" where it is)
  attention_classes()    the Triton attention classes (paged, latent) with the vendor's kernel
                         configuration, imported when asked (triton loads with them)
  extra_ops()            ops of its own over the Triton ones (a BLAS-backed linear, ...)
  process_group_backend(), fast_all_reduce(), quant_methods(), quant_preferences(), ...

Detection (``is_available``) asks ``stack_problem``, then for triton, then for a visible device, then
``device_problem``: so a backend claims only its own vendor's devices. ``CHITU_EMULATE=<name>``
skips the vendor checks of the backend of that name (its kernel configuration then really runs on
whatever device is there): the documented emulation mode the Hygon and MetaX plugins are tested in.
"""

import importlib.util
import os
from collections.abc import Callable
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from chitu_core.backend import Availability, Backend, MemoryInfo, SideQueue
from chitu_core.ops import reference

KV_CACHE_SHARE = 0.9
"""Share of the free device memory (after weights) the KV cache may take when the user sets no size."""
KV_CACHE_MARGIN = 1 << 30
"""Kept back besides: activations of the largest step, BLAS workspaces, split-KV partials, the
allocator's fragmentation."""
EMULATE_ENV = "CHITU_EMULATE"
QUEUE: ContextVar[int] = ContextVar("chitu_work_queue", default=0)
"""Which of the device's work queues launches are being queued on: 0 the main one, 1 the side queue
(``StreamSideQueue`` sets it while its work is queued). Per-queue workspaces key on it (the split-K
counters, ``split_k.split_counters``), so kernels on the two queues never share one."""


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def torch_ops() -> dict[str, Callable]:
    """The ops PyTorch's own device kernels serve well: linear (the vendor BLAS), embedding, log_softmax."""
    return {"linear": F.linear, "embedding": F.embedding, "log_softmax": reference.log_softmax}


class TritonBackend(Backend):
    """See the module. Subclasses set ``name``, ``contract_version``, ``priority`` and the hooks."""

    device_type = "cuda"

    def stack_problem(self) -> str:
        """Why the installed PyTorch is not this vendor's build, or ""."""
        return ""

    def device_problem(self, index: int) -> str:
        """Why visible device ``index`` is not this vendor's, or ""."""
        return ""

    def emulated(self) -> bool:
        return os.environ.get(EMULATE_ENV, "") == self.name

    def is_available(self) -> Availability:
        emulated = self.emulated()
        if not emulated and (problem := self.stack_problem()):
            return Availability(False, problem)
        if not triton_installed():
            return Availability(False, "triton is not installed; pip install the triton build for this device's PyTorch")
        if not torch.cuda.is_available():
            return Availability(False, "no device is visible to PyTorch (check the driver and the *_VISIBLE_DEVICES variable)")
        if not emulated and (problem := self.device_problem(0)):
            return Availability(False, problem)
        return Availability(True)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)

    def memory_info(self, index: int = 0) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(index)
        return MemoryInfo(total, free)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self, index: int = 0) -> None:
        torch.cuda.synchronize(index)

    def extra_ops(self) -> dict[str, Callable]:
        """Ops of the vendor's own, over the Triton ones. Default: none."""
        return {}

    def native_ops(self):
        if not triton_installed():
            return torch_ops()
        from chitu_core.kernels.triton.ops import TRITON_OPS

        return {**torch_ops(), **TRITON_OPS, **self.extra_ops()}

    def attention_classes(self) -> tuple[type, type]:
        """(paged, latent) attention classes; called only where triton is installed. Default: the
        portable Triton ones as they are."""
        from chitu_core.kernels.triton.attention import TritonPagedAttention
        from chitu_core.kernels.triton.mla_attention import TritonMLAAttention

        return TritonPagedAttention, TritonMLAAttention

    def attention_backends(self):
        if not triton_installed():
            return {}
        cls = self.attention_classes()[0]
        return {cls.name: cls}

    def mla_attention_backends(self):
        if not triton_installed():
            return {}
        cls = self.attention_classes()[1]
        return {cls.name: cls}

    def quant_methods(self) -> frozenset[str]:
        if not triton_installed():
            return frozenset({"unquantized"})
        return frozenset({"unquantized", "fp8", "int8", "awq", "gptq", "gguf"})

    def graph_runner(self):
        from chitu_core.kernels.triton.graphs import DeviceGraphRunner

        return DeviceGraphRunner()

    def pin_memory(self) -> bool:
        return True

    def side_queue(self, index: int = 0):
        """A second stream (CHITU_SIDE_QUEUE=0: none, every piece of work in order on one)."""
        if os.environ.get("CHITU_SIDE_QUEUE", "1") == "0":
            return None
        return StreamSideQueue(torch.device("cuda", index))

    def completion_event(self):
        event = torch.cuda.Event()
        event.record()
        return event

    def measure_peak_memory(self, fn, index: int = 0) -> int:
        """Peak of PyTorch's allocator during ``fn`` plus what the process holds outside it (the device
        context, BLAS and collective workspaces; also other processes' use of the device, which this
        process cannot tell apart and must leave alone anyway)."""
        torch.cuda.synchronize(index)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(index)
        fn()
        torch.cuda.synchronize(index)
        free, total = torch.cuda.mem_get_info(index)
        outside = total - free - torch.cuda.memory_reserved(index)
        peak = torch.cuda.max_memory_allocated(index)
        torch.cuda.empty_cache()
        return peak + max(0, outside)

    def kv_cache_budget(self, index: int = 0) -> int:
        """KV_CACHE_SHARE of the memory free after the weights are loaded (what the driver reports
        free plus what PyTorch's allocator holds unused), less KV_CACHE_MARGIN."""
        free = self.memory_info(index).free_bytes
        free += torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return max(0, int(free * KV_CACHE_SHARE) - KV_CACHE_MARGIN)


class StreamSideQueue(SideQueue):
    """``SideQueue`` on a second stream of the device: ``run`` makes it wait for the current stream, then
    queues the work on it; ``join`` makes the current stream wait for it. Stream capture records both as
    graph edges (the side stream joins the capture), and allocations on either stream then come from the
    graph's pool. Its inputs stay referenced until the join, its outputs are used only after it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream: torch.cuda.Stream | None = None  # made at the first use, once the device is set

    def run(self, fn):
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        token = QUEUE.set(1)
        try:
            with torch.cuda.stream(self.stream):
                return fn()
        finally:
            QUEUE.reset(token)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
