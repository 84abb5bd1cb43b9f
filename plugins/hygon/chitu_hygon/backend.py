"""The Hygon DCU backend: DTK's PyTorch (a ROCm/HIP build: device type "cuda", ``torch.version.hip``
set), the portable Triton kernels through the core's ``TritonBackend`` with DCU tiling, RCCL (which a
HIP build of PyTorch serves under the process-group name "nccl"), HIP graphs through torch.cuda's
graph API.

DCUs have no FP8 units: FP8 checkpoints run "soft FP8" (the bytes decoded to 16-bit in registers,
16-bit activations), and the KV cache stays in the model dtype. Not run on a DCU yet: see README.md.
"""

import torch

from chitu_core.kernels.triton.backend import TritonBackend

AMD_MARKERS = ("amd", "instinct", "radeon")
"""Names of AMD's devices, which ROCm builds also see: not this backend's."""
HYGON_MARKERS = ("hygon", "dcu", "bw", "k100", "z100")
"""Names DTK reports for Hygon's DCUs (the BW and K100 series; also seen as "... DCU ...")."""


def is_hygon_device(name: str, arch: str) -> bool:
    """A DCU: a name of Hygon's, or a gfx9 architecture (the DCUs' CDNA-derived family) under a
    name that is not AMD's."""
    lowered = name.lower()
    if any(m in lowered for m in AMD_MARKERS):
        return False
    return any(m in lowered for m in HYGON_MARKERS) or arch.startswith("gfx9")


class HygonBackend(TritonBackend):
    name = "hygon"
    contract_version = "1.6"
    priority = 100

    def stack_problem(self) -> str:
        if getattr(torch.version, "hip", None) is None:
            return (f"PyTorch {torch.__version__} is not a ROCm/HIP build (torch.version.hip is unset); "
                    "install the PyTorch of Hygon's DTK (see the chitu-hygon README)")
        return ""

    def device_problem(self, index: int) -> str:
        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", "") or ""
        if not is_hygon_device(props.name, arch):
            return f"device {index} is {props.name!r} ({arch or 'no gcn arch'}), not a Hygon DCU"
        return ""

    def attention_classes(self):
        from chitu_hygon.attention import HygonTritonAttention, HygonTritonMLAAttention

        return HygonTritonAttention, HygonTritonMLAAttention

    def extra_ops(self):
        from chitu_core.kernels.triton.fp8_linear import fp8_linear_bytes
        from chitu_core.kernels.triton.moe_fp8 import fused_experts_fp8_bytes

        return {"fp8_linear": fp8_linear_bytes, "fused_experts_fp8": fused_experts_fp8_bytes}  # soft FP8

    def process_group_backend(self) -> str:
        return "nccl"  # RCCL, under the name a HIP build of PyTorch gives it

    def quant_preferences(self, method: str):
        """16-bit activations for FP8 (no FP8 units) and int8 (weights dequantized in the kernel)."""
        return {"act_quant": False} if method in ("fp8", "int8") else {}
