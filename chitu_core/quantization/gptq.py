"""GPTQ checkpoints (AutoGPTQ / GPTQModel), 4-bit.

A layer of K input and N output features holds, under its checkpoint names:

  qweight  int32   [K/8, N]    eight 4-bit q along K, nibble j of word [i, n] holding q[8i + j, n]
  qzeros   int32   [K/G, N/8]  eight zeros along N, nibble j of word [g, c] holding the zero of column 8c + j
  scales   float16 [K/G, N]
  g_idx    int32   [K]         the group of each input feature

and W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]. ``checkpoint_format`` "gptq" (v1, AutoGPTQ's
and the default) stores z - 1 in qzeros, "gptq_v2" stores z. With act-order (``desc_act``) GPTQ
quantized the features in another order and g_idx says which group each ended in; ``repack`` sorts the
features by group (stably), so each group is G consecutive rows again, and keeps that order as
``perm`` for ``apply`` to gather x by. Without act-order g_idx is k // G and is not read (as vLLM
does), so dummy weights, whose g_idx is zeros, load.
"""

from typing import Any

import torch

from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.quantization.int4 import (
    Int4Method, check_bits, check_group_size, pack_int4, quantize_groups, unpack_int4,
)
from chitu_core.quantization.params import quant_param
from chitu_core.quantization.registry import register_quant_method

FORMATS = ("gptq", "gptq_v2")


@register_quant_method
class GPTQMethod(Int4Method):
    """GPTQ checkpoints (quant_method "gptq"); options: group_size (-1: all of K), desc_act, sym,
    checkpoint_format ("gptq" or "gptq_v2")."""

    name = "gptq"
    checkpoint_formats = ("gptq",)
    defaults = {"group_size": 128, "desc_act": False, "sym": True, "checkpoint_format": "gptq"}

    @classmethod
    def options_from_checkpoint(cls, quantization_config) -> dict[str, Any]:
        qc = quantization_config
        what = "config.json's GPTQ quantization_config"
        check_bits(qc, what)
        if qc.get("is_marlin_format"):
            raise ChituError(f"{what}: is_marlin_format true: Marlin-packed GPTQ weights are not supported; "
                             "use the plain GPTQ checkpoint")
        if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise ChituError(f"{what}: pack_dtype {qc['pack_dtype']!r} is not supported; only int32 words are")
        fmt = qc.get("checkpoint_format") or (qc.get("format") if qc.get("format") in FORMATS else None) or "gptq"
        if fmt not in FORMATS:
            raise ChituError(f"{what}: checkpoint_format {fmt!r} is not supported; only 'gptq' (v1) and 'gptq_v2' are")
        options = {"group_size": check_group_size(qc.get("group_size"), what), "checkpoint_format": fmt}
        for key, default in (("desc_act", False), ("sym", True)):
            value = qc.get(key, default)
            if not isinstance(value, bool):
                raise ChituError(f"{what}: {key} {value!r} is not true or false")
            options[key] = value
        return options

    @classmethod
    def conformance_options(cls) -> list[dict[str, Any]]:
        return [{"group_size": 128, "sym": False}, {"group_size": 128, "sym": False, "desc_act": True},
                {"group_size": 32, "sym": True}]

    def _v1(self) -> bool:
        fmt = self.options["checkpoint_format"]
        if fmt not in FORMATS:
            raise ChituError(f"quantization method 'gptq': checkpoint_format {fmt!r} is not 'gptq' or 'gptq_v2'")
        return fmt == "gptq"

    def create_checkpoint_weights(self, layer, in_features, out_features, dtype, device):
        from chitu_core.layers.linear import RowParallelLinear

        g = self.check_shape(in_features, out_features)
        if self.options["desc_act"] and isinstance(layer, RowParallelLinear) and getattr(layer, "tp_size", 1) > 1:
            raise ChituError(f"GPTQ act-order (desc_act) weights cannot be split along their input features: a "
                             f"row-parallel layer at tensor-parallel size {layer.tp_size} would get groups that "
                             "its slice of g_idx scatters over the whole layer; run with tensor-parallel size 1 "
                             "or use a checkpoint quantized without desc_act")
        k, n = in_features, out_features
        quant_param(layer, "qweight", (k // 8, n), torch.int32, device, in_dim=0, in_pack=8, out_dim=1)
        quant_param(layer, "qzeros", (k // g, n // 8), torch.int32, device, in_dim=0, in_pack=g, out_dim=1, out_pack=8)
        quant_param(layer, "scales", (k // g, n), torch.float16, device, in_dim=0, in_pack=g, out_dim=1)
        quant_param(layer, "g_idx", (k,), torch.int32, device, in_dim=0)

    def quantize(self, weight):
        """The v1 or v2 tensors of ``checkpoint_format``. With desc_act the features are quantized in
        order of decreasing column norm (a stand-in for GPTQ's Hessian order), so g_idx is not k // G."""
        n, k = weight.shape
        g = self.check_shape(k, n)
        order = torch.arange(k, device=weight.device)
        if self.options["desc_act"]:
            order = torch.argsort(weight.float().norm(dim=0), descending=True, stable=True)
        v1 = self._v1()
        q, scales, zeros = quantize_groups(weight[:, order], g, symmetric=self.options["sym"], min_zero=int(v1))
        q_orig = torch.empty_like(q)
        q_orig[:, order] = q
        g_idx = torch.empty(k, dtype=torch.int32, device=weight.device)
        g_idx[order] = torch.arange(k, device=weight.device, dtype=torch.int32) // g
        return {"qweight": pack_int4(q_orig.T, 0), "qzeros": pack_int4(zeros.T - int(v1), 1),
                "scales": scales.T.contiguous(), "g_idx": g_idx}

    def repack(self, layer):
        qweight, scales = layer.qweight.data, layer.scales.data
        k, groups = qweight.shape[0] * 8, scales.shape[0]
        zeros = unpack_int4(layer.qzeros.data, 1) + int(self._v1())
        perm = self._act_order(layer.g_idx.data, k, groups) if self.options["desc_act"] else None
        if perm is not None:  # the rows sorted by group; qweight is already canonical otherwise
            qweight = pack_int4(unpack_int4(qweight, 0).index_select(0, perm), 0)
        self.set_canonical(layer, qweight, scales, zeros, perm, ("qweight", "qzeros", "scales", "g_idx"))

    @staticmethod
    def _act_order(g_idx: torch.Tensor, k: int, groups: int) -> torch.Tensor | None:
        """The order that sorts the features by group, or None where it is the identity. An all-zero g_idx
        (what load_format="dummy" writes) counts as the identity."""
        g_idx = g_idx.to(torch.int64)
        if groups > 1 and not g_idx.any():
            return None
        if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= groups):
            raise ModelLoadError(f"GPTQ g_idx holds groups {g_idx.min().item()}..{g_idx.max().item()}, outside the "
                                 f"{groups} groups of scales: the checkpoint is inconsistent")
        counts = torch.bincount(g_idx, minlength=groups)
        if (counts != k // groups).any():
            bad = int((counts != k // groups).nonzero()[0])
            raise ModelLoadError(f"GPTQ g_idx puts {counts[bad].item()} input features in group {bad}, not the "
                                 f"group size {k // groups}; act-order weights whose groups are not all full "
                                 "cannot be reordered into groups of consecutive features")
        perm = torch.argsort(g_idx, stable=True)
        if torch.equal(perm, torch.arange(k, device=perm.device)):
            return None
        return perm
