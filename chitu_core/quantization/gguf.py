"""The "gguf" method: a linear layer's weight kept as the GGUF file's own blocks.

A GGUF loaded with ``resolve_model(..., keep_quantized=True)`` becomes an HF directory whose linear
weights are the file's raw rows, stored as ``<module>.qweight`` (uint8 [N, K / E * B], see
``gguf_blocks``), and whose config.json carries the ggml type of each by its weight's HF name::

    "quantization_config": {"quant_method": "gguf",
                            "tensor_types": {"model.layers.0.self_attn.q_proj.weight": 12, ...},
                            "modules_to_not_convert": ["model.layers.0.self_attn.v_proj", ...]}

The ggml type varies by tensor (a Q4_K_M file mixes Q4_K and Q6_K), so each layer takes its own
``qtype`` option from ``tensor_types`` (``layer_options``); a fused layer (qkv_proj, gate_up_proj)
takes its parts' type, which the converter guarantees they share (a group whose parts differ is
dequantized and listed in ``modules_to_not_convert``).
"""

from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch

from chitu_core.errors import ModelLoadError
from chitu_core.quantization.base import QuantMethod
from chitu_core.quantization.gguf_blocks import BLOCK, NAMES, Q4_0, Q4_1, Q8_0, check_qtype, dequantize, type_name
from chitu_core.quantization.params import quant_param
from chitu_core.quantization.registry import register_quant_method

QUANTIZABLE = (Q4_0, Q4_1, Q8_0)
"""Types ``quantize`` produces (through the gguf package, whose quantizers match ggml's reference);
it has none for the K-quants, which come only from files."""


def _tensor_types(quantization_config: Mapping[str, Any]) -> dict[str, int]:
    types = quantization_config.get("tensor_types")
    if not isinstance(types, Mapping) or not types:
        raise ModelLoadError("a gguf quantization_config needs a non-empty 'tensor_types' mapping (tensor name -> "
                             "ggml type id); convert the GGUF again with this version of chitu")
    return dict(types)


@register_quant_method
class GGUFMethod(QuantMethod):
    """Options: ``qtype``, the ggml type id of the layer's blocks (``gguf_blocks.BLOCK``)."""

    name = "gguf"
    kernels = ("gguf_linear",)
    checkpoint_formats = ("gguf",)

    @classmethod
    def options_from_checkpoint(cls, quantization_config):
        """The most common type: what layers are first built with, before ``layer_options`` gives
        each its own."""
        types = _tensor_types(quantization_config)
        for name, qtype in types.items():
            if qtype not in BLOCK:
                raise ModelLoadError(f"quantization_config.tensor_types[{name!r}] is {type_name(qtype)}, which the "
                                     f"gguf method does not run; supported: {', '.join(NAMES.values())}")
        return {"qtype": Counter(types.values()).most_common(1)[0][0]}

    @classmethod
    def layer_options(cls, quantization_config, module, parts):
        types = _tensor_types(quantization_config)
        names = parts or (module,)
        missing = [n for n in names if f"{n}.weight" not in types]
        if missing:
            raise ModelLoadError(f"layer {module}: quantization_config.tensor_types has no type for "
                                 f"{', '.join(m + '.weight' for m in missing)}; a layer the GGUF keeps dense must be "
                                 "listed in modules_to_not_convert")
        found = {types[f"{n}.weight"] for n in names}
        if len(found) > 1:
            raise ModelLoadError(f"layer {module} fuses {', '.join(names)}, whose GGUF types differ "
                                 f"({', '.join(type_name(t) for t in sorted(found))}); such a group must be listed in "
                                 "modules_to_not_convert (convert the GGUF again with this version of chitu)")
        return {"qtype": found.pop()}

    @classmethod
    def table_options(cls, quantization_config, module):
        qtype = _tensor_types(quantization_config).get(f"{module}.weight")
        return None if qtype is None else {"qtype": qtype}

    @classmethod
    def conformance_options(cls):
        return [{"qtype": qtype} for qtype in QUANTIZABLE]

    @property
    def qtype(self) -> int:
        return self.options["qtype"]

    def create_checkpoint_weights(self, layer, in_features, out_features, dtype, device):
        e, b = check_qtype(self.qtype)
        if in_features % e:
            raise ModelLoadError(f"a {type_name(self.qtype)} weight needs whole {e}-element blocks along its input "
                                 f"features, but this layer (or its tensor-parallel shard) has {in_features}; "
                                 "use another tensor-parallel size")
        quant_param(layer, "qweight", (out_features, in_features // e * b), torch.uint8, device,
                    out_dim=0, in_dim=1, in_pack=Fraction(e, b))

    def quantize(self, weight):
        if self.qtype not in QUANTIZABLE:
            raise NotImplementedError(f"the gguf package cannot quantize to {type_name(self.qtype)}; only "
                                      f"{', '.join(NAMES[t] for t in QUANTIZABLE)} can be produced here")
        import gguf

        rows = weight.detach().to(device="cpu", dtype=torch.float32).numpy()
        blocks = gguf.quants.quantize(rows, gguf.GGMLQuantizationType(self.qtype))
        return {"qweight": torch.from_numpy(blocks.copy()).to(weight.device)}

    def dequantize(self, layer):
        return dequantize(layer.qweight, self.qtype)

    def lookup(self, layer, ids):
        return dequantize(layer.qweight[ids], self.qtype)  # the rows' blocks only

    def apply(self, layer, x, bias, ops):
        return ops.gguf_linear(x, layer.qweight, self.qtype, bias)
