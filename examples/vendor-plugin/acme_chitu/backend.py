"""The Acme backend: what chitu-core may ask of the device, and what it declares it supports."""

import torch

from chitu_core.backend import Availability, Backend, MemoryInfo, host_memory_info
from acme_chitu import ops
from acme_chitu.attention import AcmePagedAttention


class AcmeBackend(Backend):
    name = "acme"
    device_type = "cpu"  # the simulated device's tensors live on the host
    contract_version = "1.0"  # the chitu-core contract this plugin was written for
    priority = -10  # device="auto" should prefer any real device

    def is_available(self) -> Availability:
        # A real backend checks for its driver and devices here and says what is missing.
        return Availability(True)

    def device_count(self) -> int:
        return 1

    def memory_info(self, index: int = 0) -> MemoryInfo:
        return host_memory_info()

    def device_name(self, index: int = 0) -> str:
        return "Acme simulator (host CPU)"

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def native_ops(self):
        return ops.NATIVE_OPS

    def attention_backends(self):
        return {AcmePagedAttention.name: AcmePagedAttention}

    def process_group_backend(self) -> str:
        return "gloo"

    def supports(self, op: str, dtype: torch.dtype, params) -> bool:
        if op == "attention" and params["head_dim"] not in (64, 128, 256):
            return False  # Acme's attention is built for these head sizes
        if op == "rms_norm" and params["shape"][-1] > 8192:
            return False  # rows must fit Acme's on-chip buffer
        return super().supports(op, dtype, params)  # the dtypes of supported_dtypes(), the collectives' rule

    def tolerances(self):
        # Probabilities rounded to bfloat16 before the product with V (see attention.py).
        return {("attention", torch.bfloat16): {"limit": 1e-4}}
