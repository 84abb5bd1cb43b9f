"""The CPU backend: always available, float32 and bfloat16, gloo collectives, no graphs."""

import os

import torch

from chitu_core.backend import Availability, Backend, MemoryInfo, host_memory_info
from chitu_cpu import ops
from chitu_cpu.attention import CpuSdpaAttention


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    contract_version = "1.0"
    priority = 0  # any accelerator backend should win under device="auto"

    def is_available(self) -> Availability:
        return Availability(True)

    def device_count(self) -> int:
        return 1

    def memory_info(self, index: int = 0) -> MemoryInfo:
        return host_memory_info()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def native_ops(self):
        return ops.NATIVE_OPS

    def attention_backends(self):
        return {CpuSdpaAttention.name: CpuSdpaAttention}

    def process_group_backend(self) -> str:
        return "gloo"

    def set_num_threads(self, threads: int | None) -> None:
        torch.set_num_threads(threads or os.cpu_count() or 1)
