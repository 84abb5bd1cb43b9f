"""The MetaX (Muxi) backend: MetaX's MACA build of PyTorch (CUDA-compatible: device type "cuda",
device names "MetaX ..."), the portable Triton kernels through the core's ``TritonBackend`` with MACA
tiling, MCCL (served under the process-group name "nccl"), graphs through torch.cuda's graph API.

No FP8 units are assumed: FP8 checkpoints run "soft FP8" (the bytes decoded to 16-bit in registers),
and the KV cache stays in the model dtype. Not run on a MetaX GPU yet: see README.md.
"""

import torch

from chitu_core.kernels.triton.backend import TritonBackend

MODEL_NAMES = frozenset({"4000", "4001"})
"""Device names some MACA releases report instead of "MetaX ..." (matched whole, not as parts)."""


def is_metax_device(name: str) -> bool:
    return "metax" in name.lower() or name.strip() in MODEL_NAMES


class MuxiBackend(TritonBackend):
    name = "muxi"
    contract_version = "1.6"
    priority = 100

    def stack_problem(self) -> str:
        """MACA's PyTorch presents itself as a CUDA build (``torch.version.cuda`` set, no HIP version)."""
        if getattr(torch.version, "hip", None) or torch.version.cuda is None:
            return (f"PyTorch {torch.__version__} is not MetaX's MACA build; install the PyTorch of the MACA "
                    "software stack (see the chitu-muxi README)")
        return ""

    def device_problem(self, index: int) -> str:
        name = torch.cuda.get_device_name(index)
        return "" if is_metax_device(name) else f"device {index} is {name!r}, not a MetaX GPU"

    def attention_classes(self):
        from chitu_muxi.attention import MuxiTritonAttention, MuxiTritonMLAAttention

        return MuxiTritonAttention, MuxiTritonMLAAttention

    def extra_ops(self):
        from chitu_core.kernels.triton.fp8_linear import fp8_linear_bytes
        from chitu_core.kernels.triton.moe_fp8 import fused_experts_fp8_bytes

        return {"fp8_linear": fp8_linear_bytes, "fused_experts_fp8": fused_experts_fp8_bytes}  # soft FP8

    def process_group_backend(self) -> str:
        return "nccl"  # MCCL, under the name MACA's PyTorch gives it

    def quant_preferences(self, method: str):
        """16-bit activations: FP8 without FP8 units; int8 weights dequantized in the kernel."""
        return {"act_quant": False} if method in ("fp8", "int8") else {}
