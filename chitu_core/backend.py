"""The Backend contract: everything the core may ask of a device.

A backend plugin subclasses ``Backend`` and registers the class under the
entry-point group ``chitu_core.backends`` (name -> class). The core never
names a device; when it needs to know something about one, this class grows
a method with a default, and a backend answers it.
"""

import ctypes
import ctypes.util
import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from chitu_core.attention.contract import AttentionBackend
    from chitu_core.attention.mla import MLAAttentionBackend
    from chitu_core.conformance.thresholds import Threshold
    from chitu_core.quantization.base import QuantMethod


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and if not, why (one sentence a user can act on)."""

    available: bool
    reason: str = ""


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of one device in bytes."""

    total_bytes: int
    free_bytes: int


class PackedLinear(ABC):
    """A linear layer's weight in a backend's own layout (``Backend.pack_linear``, contract 1.7)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] in x.dtype, as the method's ``apply`` computes it."""

    @abstractmethod
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The tensors it holds, by name (the core registers them as the layer's buffers: they count in
        its memory and its bytes read per step)."""


class GraphRunner(ABC):
    """Optional: records the device work of a function once and replays it (CUDA graphs, ACL graphs).

    The engine captures its decode step once per padded batch size, largest first, before serving, and
    (contract 1.16, where the attention class sets ``captures_prefill``) steps of prompts once per padded
    token count, largest first, before those.
    A captured function reads and writes only tensors that exist before the capture (the engine's
    static input buffers, the weights, the KV cache) and never waits on the host. One runner's
    captures may share one memory pool: the engine replays one graph at a time.
    """

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Run ``fn`` once to warm up (compile kernels, settle workspaces), record it, and return
        ``replay``: a callable that re-runs the recorded work on the current inputs and returns
        the tensor ``fn`` returned, in the same storage at every replay."""


class SideQueue(ABC):
    """Optional (contract 1.8): a second work queue on the device, for work that does not depend on what
    the main queue does meanwhile (``Backend.side_queue``). A layer forks work onto it and joins it back
    before using the results; both are recorded by graph capture, so the two run side by side in replays.

    Tensors that work on the side queue makes are used on the main queue only after ``join``. Its inputs
    stay alive until then (the layer holds them), and the next ``run`` starts behind everything queued on
    the main queue by then, so no memory is reused while the other queue still reads it."""

    @abstractmethod
    def run(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Queue ``fn``'s device work on the side queue, behind all work queued on the main queue so far,
        and return what ``fn`` returned."""

    @abstractmethod
    def join(self) -> None:
        """Make the main queue's later work wait for all work queued on the side queue so far."""


class Backend(ABC):
    """A device backend. Instances are cheap: constructing one must not touch the device.

    Class attributes a backend sets:
      name:              entry-point name users pass as ``device`` ("cpu").
      device_type:       the torch device type its tensors live on.
      contract_version:  the chitu-core contract ("MAJOR.MINOR") it was written for.
      priority:          ``device="auto"`` picks the available backend with the highest.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    contract_version: ClassVar[str]
    priority: ClassVar[int] = 0

    @abstractmethod
    def is_available(self) -> Availability:
        """Whether this backend's hardware and libraries are present, with the reason if not."""

    @abstractmethod
    def device_count(self) -> int:
        """How many devices of this kind the process can use."""

    @abstractmethod
    def memory_info(self, index: int = 0) -> MemoryInfo:
        """Total and free memory of device ``index``."""

    @abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Activation/weight dtypes the op set and attention run in; the first is the default."""

    def device(self, index: int = 0) -> torch.device:
        """The torch device of device ``index``."""
        return torch.device(self.device_type, index)

    def device_name(self, index: int = 0) -> str:
        """A human-readable name of device ``index`` (its model), for reports."""
        return str(self.device(index))

    def set_device(self, index: int) -> None:
        """Make device ``index`` this process's current one (a tensor-parallel rank's), where the
        backend has such a notion. Default: nothing."""

    def synchronize(self, index: int = 0) -> None:
        """Wait for queued work on device ``index`` (a no-op where execution is synchronous)."""

    def native_ops(self) -> Mapping[str, Callable]:
        """Ops (names from ``chitu_core.ops.OP_NAMES``) this backend implements itself.
        Every op left out is served by the core's reference implementation, and reported
        as a fallback."""
        return {}

    def attention_backends(self) -> Mapping[str, "type[AttentionBackend]"]:
        """Attention backends by name; the first is the default. Empty means the core's
        reference attention (reported as a fallback)."""
        return {}

    def mla_attention_backends(self) -> Mapping[str, "type[MLAAttentionBackend]"]:
        """Multi-head latent attention backends by name (contract 1.1); the first is the default.
        Empty, the default, means the core's reference MLA (reported as a fallback)."""
        return {}

    def process_group_backend(self) -> str:
        """The torch.distributed backend its communicator runs on ("gloo", ...)."""
        return "gloo"

    def fast_all_reduce(self, comm) -> "FastAllReduce | None":
        """Contract 1.4: an all-reduce for small messages over ``comm``'s ranks (a
        ``chitu_core.distributed.communicator.FastAllReduce``), or None (the default) to send every
        all-reduce through the process group. Called once per group, on every rank of it together."""
        return None

    def quant_methods(self) -> frozenset[str]:
        """Names of the quantization methods (see ``chitu_core.quantization``) it can run."""
        return frozenset({"unquantized"})

    def quant_preferences(self, method: str) -> Mapping[str, Any]:
        """Options this backend sets on a quantization method it runs (contract 1.2), merged over the
        checkpoint's: e.g. ``{"act_quant": True}`` for "fp8" where the device multiplies FP8 numbers.
        Default: none (the method's defaults: weights dequantized inside the kernel, 16-bit activations)."""
        return {}

    def supports(self, op: str, dtype: torch.dtype, params: Mapping[str, Any]) -> bool:
        """Whether this backend runs ``op`` in ``dtype`` with ``params``; the conformance suite reports
        what it declines as unsupported rather than failed.

        ``op`` is a name of ``chitu_core.ops.OP_NAMES``, or "attention" (params: backend, num_heads,
        num_kv_heads, head_dim, block_size, kind, max_seq_len, max_query_len), "mla_attention" (latent
        attention, contract 1.1; params: backend, num_heads, kv_lora_rank, rope_dim, block_size, kind,
        max_seq_len, max_query_len; both with kv_cache_dtype "fp8" for the fp8-cache rows, contract 1.2;
        attention with "float16" or "bfloat16" for a float32 model's 16-bit-cache rows, contract 1.15),
        "sampler", a collective ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv";
        params: world_size, device_count, process_group_backend), "quant" (params: method, m, k, n, bias
        and the method's conformance options) or "model"
        (params: architecture, num_heads, num_kv_heads, head_dim). Ops whose contract fixes float32
        (the sampling ops) are asked with float32. The default: every dtype of ``supported_dtypes()``,
        and collectives only where each rank can have a device of its own, or the process group is
        gloo (which runs in host memory: several ranks may share a device).
        """
        if "world_size" in params and "device_count" in params and params.get("process_group_backend") != "gloo":
            if params["device_count"] < params["world_size"]:
                return False
        return dtype in self.supported_dtypes()

    def tolerances(self) -> "Mapping[tuple[str, torch.dtype], Threshold | Mapping[str, float]]":
        """Conformance thresholds this backend widens: (family or op name, dtype) -> a
        ``chitu_core.conformance.thresholds.Threshold``, or a dict of the fields to change
        ({"limit": 1e-6}). Every declaration is shown in the conformance report. Default: none."""
        return {}

    def graph_runner(self) -> GraphRunner | None:
        """A graph runner for decode steps, or None where graphs are not supported."""
        return None

    def side_queue(self, index: int = 0) -> SideQueue | None:
        """(1.8) Optional: a ``SideQueue`` on device ``index``, where the device runs two queues of work at
        once; layers then run independent work side by side (a mixture-of-experts layer's
        shared experts beside its routed ones). One object serves the whole model. Default: None, every
        piece of work queued in order."""
        return None

    def fusion_max_tokens(self) -> int | None:
        """(1.9) Optional: the most tokens a step may have for the model's layers to take the decode-step
        fusions (``ops.rms_norm_linear``, ``ops.linear_add``), where your ops serve both; (1.10) and for
        multi-head latent attention to take ``ops.mla_inputs``, where your ops serve it. A layer that takes
        them keeps the residual stream whole and adds into it after each product; where your fused kernel
        covers only a few rows, the others pay an add of their own, which ``fused_add_rms_norm`` spared them:
        say how many rows it covers. Default: None, any number (the fused ops are as fast at every size)."""
        return None

    def step_token_budget(self) -> int | None:
        """(1.15) Optional: the most new tokens a step takes where the engine's ``max_num_batched_tokens`` is
        left unset. A step's activations scale with its tokens; a host backend whose memory is the machine's
        keeps a burst of prompts from prefilling at once. Default: None (the engine's 8192)."""
        return None

    def pin_memory(self) -> bool:
        """Whether host staging buffers should be page-locked (``Tensor.pin_memory``) so that
        copies to the device run asynchronously. Default: no."""
        return False

    def transposed_linear_weights(self) -> bool:
        """Whether dense linear weights should be stored as the transpose of a contiguous
        [in_features, out_features] tensor (the ops still get [out, in] tensors, with other
        strides), where the device's GEMMs run faster on that layout. Default: no."""
        return False

    def pack_linear(self, method: "QuantMethod", layer: torch.nn.Module, dtype: torch.dtype) -> "PackedLinear | None":
        """(1.7) Optional: take over one loaded linear layer's product with weights in a layout of your
        own. Called once per linear layer after its method's ``process_weights_after_loading``, with the
        method (its ``name`` and ``options``), the layer holding the method's tensors in the contract's
        layout, and ``dtype``, the activations' (the model's). Return None to leave the layer on the method's ops (the default), or a
        ``PackedLinear``: the core then calls it instead of ``method.apply`` and drops the layer's method
        tensors (it keeps ``bias``). The quantization conformance cases run each method through it."""
        return None

    def compile_forward(self, forward: Callable) -> Callable:
        """(1.7) Optional: the callable the engine runs a model's forward through when asked to compile
        (``compile_forward=True``), e.g. ``torch.compile``'s where the device has no graph replay; the
        engine then runs a short warm-up request so that compiling happens while it starts. Steps replayed
        from a graph runner's captures are not affected. Default: ``forward`` itself."""
        return forward

    def completion_event(self):
        """An event recorded now on the device's work queue: an object whose ``synchronize()``
        returns once all work queued before it has finished (the device's event type, after
        ``record()``). None, the default, where device work is done by the time the call that
        queued it returns. The engine waits on one for each step's asynchronous device-to-host copy."""
        return None

    def measure_peak_memory(self, fn: Callable[[], object], index: int = 0) -> int | None:
        """Run ``fn`` (a largest-step forward) and return the most device memory this process had
        in use while it ran, weights and runtime workspaces included; None where the backend cannot
        measure it (then ``gpu_memory_utilization`` cannot be honoured). Default: None, ``fn`` not run."""
        return None

    def kv_cache_budget(self, index: int = 0) -> int:
        """Bytes the engine may give the KV cache when the user sets no size (after weights
        are loaded). The default takes a quarter of free memory, capped at 4 GiB."""
        return min(self.memory_info(index).free_bytes // 4, 4 << 30)

    def set_num_threads(self, threads: int | None) -> None:
        """Hint for host-side parallelism; backends that have no use for it ignore it."""
        if threads:
            torch.set_num_threads(threads)


def host_memory_info() -> MemoryInfo:
    """Physical and available host memory, from the OS (for host-memory backends)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        free = os.sysconf("SC_AVPHYS_PAGES") * page
    return MemoryInfo(total, free)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None  # glibc's; others may lack it


def return_free_host_memory() -> None:
    """Give the OS the pages that freed host allocations left inside the C heap (glibc's
    ``malloc_trim``; a no-op elsewhere). Loading reads weights through host memory and packing
    replaces tensors; the heap keeps what they freed unless asked. The engine calls this while
    it loads, never per step (a trimmed heap faults its pages in again)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
