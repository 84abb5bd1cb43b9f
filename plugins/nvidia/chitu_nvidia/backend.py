"""The NVIDIA backend: CUDA devices through PyTorch, the portable Triton kernels (through the core's
``TritonBackend``), cuBLAS/cuBLASLt linears, NCCL collectives with a symmetric-memory small-message path.

Nothing here imports triton when the module loads: on a machine without triton or a GPU,
``python -m chitu_core.plugins`` lists this backend as unavailable with the reason, and the op table it
reports holds the PyTorch ops only.
"""

import os

import torch

from chitu_core.kernels.triton.backend import TritonBackend
from chitu_nvidia.ops import has_fp8_types, nvidia_ops

FP8_ACT_QUANT_ROWS = int(os.environ.get("CHITU_FP8_ACT_QUANT_ROWS", 32))
"""Rows from which the "fp8" method quantizes activations on devices that multiply FP8 (``quant_preferences``);
CHITU_FP8_ACT_QUANT_ROWS sets another (to compare)."""


class NvidiaBackend(TritonBackend):
    name = "nvidia"
    # 1.9: the decode-step fusions (ops.rms_norm_linear, ops.linear_add); 1.10: ops.mla_inputs;
    # 1.11: ops.linear_float32; 1.12: AttentionBackend.fuses_qk_norm; 1.13: linear_add of the fast all-reduce;
    # 1.17: fp8's act_quant as a number of rows
    contract_version = "1.18"
    priority = 100

    def stack_problem(self) -> str:
        if torch.version.cuda is None or getattr(torch.version, "hip", None):
            return f"PyTorch {torch.__version__} is not a CUDA build; install a CUDA build of torch"
        return ""

    def device_problem(self, index: int) -> str:
        name = torch.cuda.get_device_name(index)
        if "nvidia" not in name.lower():  # a CUDA-compatible device of another vendor claims its own backend
            return f"device {index} is {name!r}, not an NVIDIA GPU"
        major, minor = torch.cuda.get_device_capability(index)
        if major < 8:
            return f"{name} has compute capability {major}.{minor}; the Triton kernels need 8.0 (Ampere) or newer"
        return ""

    def extra_ops(self):
        return nvidia_ops()

    def attention_classes(self):
        from chitu_nvidia.attention import NvidiaTritonAttention, NvidiaTritonMLAAttention

        return NvidiaTritonAttention, NvidiaTritonMLAAttention

    def process_group_backend(self) -> str:
        return "nccl"

    def fast_all_reduce(self, comm):
        from chitu_nvidia.fast_all_reduce import fast_all_reduce

        return fast_all_reduce(comm, torch.device("cuda", torch.cuda.current_device()))

    def quant_preferences(self, method: str):
        """FP8 weights: 16-bit activations (soft FP8, the weights dequantized inside the product) for calls
        of fewer than ``FP8_ACT_QUANT_ROWS`` rows, FP8 activations from there (contract 1.17) where the
        device multiplies FP8 (compute capability 8.9 and newer; before it, 16-bit always). On an H200 at
        the Llama-3.1-8B config (docs/benchmarks/nvidia-h200-fp8-rows.md), decode tok/s with 16-bit against
        FP8 activations: batch 16 3,751 against 2,722, batch 32 4,393 against 7,180, batch 64 8,097 against
        12,607; a step of few rows is bound by the weights' bytes, which 16-bit activations do not add to.
        int8 weights with int8 activations (int8 tensor cores since Turing)."""
        if method == "fp8":
            return {"act_quant": FP8_ACT_QUANT_ROWS if has_fp8_types() else False}
        if method == "int8":
            return {"act_quant": True}
        return {}

    def fusion_max_tokens(self) -> int | None:
        """Batch 1 (CHITU_FUSION_MAX_TOKENS sets another, to compare). The fused matrix-vector kernel beats
        the unfused ops at one row on every shape up to 8192 outputs; at 2 to 8 rows only on weights as
        small as SmolLM2-135M's (``chitu_nvidia.ops.MAX_FUSED_ROWS_WEIGHT``), so from 2 rows a larger
        model would pay the adds of the fused layer without the kernel (plugins/nvidia/scripts/fused_gemv_sweep.py)."""
        return int(os.environ.get("CHITU_FUSION_MAX_TOKENS", 1))

    def transposed_linear_weights(self) -> bool:
        """cuBLAS picks faster kernels for decode-sized GEMMs on [in, out] weights (measured on an H200
        with scripts/gemm_layouts.py, bf16 Llama-3.1-8B shapes: LM head at batch 64 284 -> 253 us,
        gate_up 62.4 -> 59.4 us; at batch 1 every shape 1-4% faster)."""
        return True
