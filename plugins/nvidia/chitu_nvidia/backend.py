"""The NVIDIA backend: CUDA devices through PyTorch, the portable Triton kernels, NCCL collectives.

Nothing here imports triton when the module loads: on a machine without triton or
a GPU, ``python -m chitu_core.plugins`` lists this backend as unavailable with the
reason, and the op table it reports holds the PyTorch ops only.
"""

import importlib.util

import torch

from chitu_core.backend import Availability, Backend, MemoryInfo
from chitu_nvidia.ops import native_ops

KV_CACHE_SHARE = 0.9
"""Share of the free device memory (after weights) the KV cache may take when the user sets no size."""
KV_CACHE_MARGIN = 1 << 30
"""Kept back besides: activations of the largest step, cuBLAS workspaces, split-KV partials, the
allocator's fragmentation."""


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class NvidiaBackend(Backend):
    name = "nvidia"
    device_type = "cuda"
    contract_version = "1.5"
    priority = 100

    def is_available(self) -> Availability:
        if torch.version.cuda is None:
            return Availability(False, f"PyTorch {torch.__version__} is not a CUDA build; install a CUDA build of torch")
        if not _triton_installed():
            return Availability(False, "triton is not installed; pip install triton (CUDA builds of torch bring it)")
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA device is visible (check the driver, and CUDA_VISIBLE_DEVICES)")
        major, minor = torch.cuda.get_device_capability(0)
        if major < 8:
            return Availability(False, f"{torch.cuda.get_device_name(0)} has compute capability {major}.{minor}; "
                                       "the Triton kernels need 8.0 (Ampere) or newer")
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

    def native_ops(self):
        return native_ops(with_triton=_triton_installed())

    def attention_backends(self):
        if not _triton_installed():
            return {}
        from chitu_nvidia.attention import NvidiaTritonAttention

        return {NvidiaTritonAttention.name: NvidiaTritonAttention}

    def mla_attention_backends(self):
        if not _triton_installed():
            return {}
        from chitu_nvidia.attention import NvidiaTritonMLAAttention

        return {NvidiaTritonMLAAttention.name: NvidiaTritonMLAAttention}

    def process_group_backend(self) -> str:
        return "nccl"

    def fast_all_reduce(self, comm):
        from chitu_nvidia.fast_all_reduce import fast_all_reduce

        return fast_all_reduce(comm, torch.device("cuda", torch.cuda.current_device()))

    def quant_methods(self) -> frozenset[str]:
        if not _triton_installed():
            return frozenset({"unquantized"})
        return frozenset({"unquantized", "fp8", "int8", "awq", "gptq", "gguf"})

    def quant_preferences(self, method: str):
        """FP8 weights with 16-bit activations (dequantized inside the GEMM): on an H100 at Llama-3.1-8B's
        shapes the FP8-activation kernel reads weights at 0.22-0.31 of the byte floor at batch 1 against
        0.49-0.81 for this one (plugins/nvidia/scripts/quant_sweep.py), and decode is what the weights'
        bytes limit. int8 weights with int8 activations (int8 tensor cores since Turing)."""
        if method == "fp8":
            return {"act_quant": False}
        if method == "int8":
            return {"act_quant": True}
        return {}

    def graph_runner(self):
        from chitu_nvidia.graphs import CudaGraphRunner

        return CudaGraphRunner()

    def pin_memory(self) -> bool:
        return True

    def transposed_linear_weights(self) -> bool:
        """cuBLAS picks faster kernels for decode-sized GEMMs on [in, out] weights (measured on an H200
        with scripts/gemm_layouts.py, bf16 Llama-3.1-8B shapes: LM head at batch 64 284 -> 253 us,
        gate_up 62.4 -> 59.4 us; at batch 1 every shape 1-4% faster)."""
        return True

    def completion_event(self):
        event = torch.cuda.Event()
        event.record()
        return event

    def measure_peak_memory(self, fn, index: int = 0) -> int:
        """Peak of PyTorch's allocator during ``fn`` plus what the process holds outside it (CUDA
        context, cuBLAS and NCCL workspaces; also other processes' use of the device, which this
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
