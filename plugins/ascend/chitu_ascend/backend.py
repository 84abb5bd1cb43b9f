"""The Ascend backend: NPUs through torch_npu (device type "npu"), its fused operators for the op set
(``chitu_ascend.ops``), paged attention by its fused inference attention (``chitu_ascend.attention``),
HCCL collectives, memory from the NPU runtime.

torch_npu is imported only by ``is_available`` and the methods that need a device: constructing the
backend, listing it, or asking for its op table never does. Decode graphs (torch_npu's NPUGraph) are not
offered yet: the fused attention takes each step's sequence lengths as host lists, which a replayed graph
would keep from its capture (see README.md, "Not done").
"""

import torch

from chitu_core.backend import Availability, Backend, MemoryInfo

KV_CACHE_SHARE = 0.85
"""Share of the NPU memory free after the weights that the KV cache takes when the user sets no size: the
rest is for activations, the fused operators' workspaces and HCCL buffers."""


def _torch_npu_problem() -> str:
    """Why torch_npu cannot be used here ("" when it can): its import error, or no visible NPU."""
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:  # noqa: BLE001  ImportError, or a CANN library the wheel cannot load: never raise
        return (f"torch_npu is not importable ({type(exc).__name__}: {exc}); install CANN and the torch_npu "
                f"wheel built for torch {torch.__version__} (see the chitu-ascend README)")
    try:
        count = torch.npu.device_count()
    except Exception as exc:  # noqa: BLE001  whatever the runtime raises becomes the reason
        return f"torch_npu could not query the NPUs ({type(exc).__name__}: {exc}); check the driver with `npu-smi info`"
    if count == 0:
        return "no NPU visible (check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES)"
    return ""


class AscendBackend(Backend):
    """Device type "npu"; available where torch_npu imports and sees an NPU (the reason says which failed)."""

    name, device_type = "ascend", "npu"
    contract_version = "1.6"
    priority = 100  # above chitu-cpu's 0 under device="auto"

    def is_available(self) -> Availability:
        problem = _torch_npu_problem()
        return Availability(not problem, problem)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def supports(self, op, dtype, params) -> bool:
        if op == "attention" and dtype == torch.float32:
            return False  # npu_fused_infer_attention_score takes float16 and bfloat16 only
        return super().supports(op, dtype, params)

    def memory_info(self, index: int = 0) -> MemoryInfo:
        free, total = torch.npu.mem_get_info(index)
        return MemoryInfo(total_bytes=total, free_bytes=free)

    def device_count(self) -> int:
        return torch.npu.device_count()

    def set_device(self, index: int) -> None:
        torch.npu.set_device(index)

    def device_name(self, index: int = 0) -> str:
        return torch.npu.get_device_name(index)

    def synchronize(self, index: int = 0) -> None:
        torch.npu.synchronize(index)

    def native_ops(self):
        from chitu_ascend.ops import native_ops

        return native_ops()

    def attention_backends(self):
        from chitu_ascend.attention import AscendPagedAttention

        return {AscendPagedAttention.name: AscendPagedAttention}

    def process_group_backend(self) -> str:
        return "hccl"

    def quant_methods(self) -> frozenset[str]:
        """int8 runs on the NPU's int8 matmuls; the other formats on the reference ops (correct, slow)."""
        return frozenset({"unquantized", "int8", "awq", "gptq", "fp8"})

    def quant_preferences(self, method: str):
        """int8 weights with int8 activations: the NPU's cube unit multiplies int8 natively."""
        return {"act_quant": True} if method == "int8" else {}

    def pin_memory(self) -> bool:
        """Page-locked staging buffers: torch_npu copies from them to the NPU asynchronously."""
        return True

    def completion_event(self):
        """A ``torch.npu.Event`` recorded on the current stream (torch_npu mirrors torch.cuda's events)."""
        (event := torch.npu.Event()).record()
        return event

    def measure_peak_memory(self, fn, index: int = 0) -> int:
        """torch_npu's allocator peak during ``fn``, plus what the process holds outside the allocator."""
        torch.npu.synchronize(index)
        torch.npu.reset_peak_memory_stats(index)
        fn()
        torch.npu.synchronize(index)
        free, total = torch.npu.mem_get_info(index)
        held_outside = max(0, total - free - torch.npu.memory_reserved(index))
        return torch.npu.max_memory_allocated(index) + held_outside

    def kv_cache_budget(self, index: int = 0) -> int:
        unused_in_pool = torch.npu.memory_reserved(index) - torch.npu.memory_allocated(index)
        return int((self.memory_info(index).free_bytes + unused_in_pool) * KV_CACHE_SHARE)
