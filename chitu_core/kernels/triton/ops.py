"""``TRITON_OPS``: the op-contract names (``chitu_core.ops.spec``) the portable Triton kernels serve.

A backend merges it into its ``native_ops()``; ops not here (linear, embedding,
sampling other than greedy) are the backend's own choice or the reference's.
"""

from chitu_core.kernels.triton.activation import gelu_and_mul, silu_and_mul
from chitu_core.kernels.triton.argmax import greedy_sample
from chitu_core.kernels.triton.fp8_linear import fp8_linear
from chitu_core.kernels.triton.gguf_linear import gguf_linear
from chitu_core.kernels.triton.int4_linear import int4_linear
from chitu_core.kernels.triton.int8_linear import int8_linear
from chitu_core.kernels.triton.moe import fused_experts, moe_route
from chitu_core.kernels.triton.moe_fp8 import fused_experts_fp8
from chitu_core.kernels.triton.rms_norm import (
    fused_add_offset_rms_norm,
    fused_add_rms_norm,
    layer_norm,
    offset_rms_norm,
    rms_norm,
)
from chitu_core.kernels.triton.rotary import rotary_embedding

TRITON_OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "offset_rms_norm": offset_rms_norm,  # contract 1.6
    "fused_add_offset_rms_norm": fused_add_offset_rms_norm,
    "layer_norm": layer_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "gelu_and_mul": gelu_and_mul,
    "greedy_sample": greedy_sample,
    "moe_route": moe_route,
    "fused_experts": fused_experts,
    "fused_experts_fp8": fused_experts_fp8,
    "int4_linear": int4_linear,
    "int8_linear": int8_linear,
    "fp8_linear": fp8_linear,
    "gguf_linear": gguf_linear,
}
