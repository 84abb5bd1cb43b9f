"""AWQ checkpoints (AutoAWQ's GEMM layout) and in-situ int4 (``--quantization int4``).

A layer of K input and N output features holds, under its checkpoint names:

  qweight  int32   [K, N/8]    eight 4-bit q along N, nibble i holding column 8c + AWQ_ORDER[i]
  qzeros   int32   [K/G, N/8]  the zeros, packed the same way
  scales   float16 [K/G, N]

and W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]. zero_point false is AutoAWQ's symmetric
quantization: signed values in [-8, 8) stored as q = value + 8, i.e. a zero of 8. AutoAWQ's own GEMM
packer cannot write such a checkpoint (it asserts it has zeros), and the GEMM readers (AutoAWQ's, vLLM's
"awq") take the zeros from qzeros whatever the flag says: so do we, and the flag only chooses how
``quantize`` rounds (symmetric, qzeros all 8). Other AutoAWQ versions (gemv, gemv_fast, marlin, exllama)
lay their words out differently and are refused by name.
"""

from typing import Any

import torch

from chitu_core.errors import ChituError
from chitu_core.quantization.int4 import (
    AWQ_ORDER, Int4Method, check_bits, check_group_size, pack_int4, quantize_groups, unpack_int4,
)
from chitu_core.quantization.params import quant_param
from chitu_core.quantization.registry import register_quant_method


@register_quant_method
class AWQMethod(Int4Method):
    """AutoAWQ GEMM checkpoints (quant_method "awq"); options: group_size (-1: all of K), zero_point."""

    name = "awq"
    checkpoint_formats = ("awq",)
    defaults = {"group_size": 128, "zero_point": True}

    @classmethod
    def options_from_checkpoint(cls, quantization_config) -> dict[str, Any]:
        what = "config.json's AWQ quantization_config"
        check_bits(quantization_config, what)
        version = str(quantization_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ChituError(f"{what}: version {quantization_config.get('version')!r} is not supported; only "
                             "AutoAWQ's 'gemm' layout is (convert the checkpoint, or quantize with version='gemm')")
        group_size = check_group_size(quantization_config.get("group_size", quantization_config.get("q_group_size")),
                                      what)
        zero_point = quantization_config.get("zero_point", True)
        if not isinstance(zero_point, bool):
            raise ChituError(f"{what}: zero_point {zero_point!r} is not true or false")
        return {"group_size": group_size, "zero_point": zero_point}

    @classmethod
    def conformance_options(cls) -> list[dict[str, Any]]:
        return [{"group_size": g, "zero_point": zp} for g in (128, 32) for zp in (True, False)]

    def create_checkpoint_weights(self, layer, in_features, out_features, dtype, device):
        g = self.check_shape(in_features, out_features)
        k, n = in_features, out_features
        quant_param(layer, "qweight", (k, n // 8), torch.int32, device, in_dim=0, out_dim=1, out_pack=8)
        quant_param(layer, "qzeros", (k // g, n // 8), torch.int32, device, in_dim=0, in_pack=g, out_dim=1, out_pack=8)
        quant_param(layer, "scales", (k // g, n), torch.float16, device, in_dim=0, in_pack=g, out_dim=1)

    def quantize(self, weight):
        n, k = weight.shape
        g = self.check_shape(k, n)
        q, scales, zeros = quantize_groups(weight, g, symmetric=not self.options["zero_point"])
        return {"qweight": pack_int4(q.T, 1, AWQ_ORDER), "qzeros": pack_int4(zeros.T, 1, AWQ_ORDER),
                "scales": scales.T.contiguous()}

    def repack(self, layer):
        q = unpack_int4(layer.qweight.data, 1, AWQ_ORDER)  # [K, N]
        zeros = unpack_int4(layer.qzeros.data, 1, AWQ_ORDER)
        self.set_canonical(layer, pack_int4(q, 0), layer.scales.data, zeros, None, ("qweight", "qzeros", "scales"))
