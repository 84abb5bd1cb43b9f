"""8-bit integer weights with a scale per output channel: the "int8" method (W8A8 / W8A16),
multiplied by the ``int8_linear`` op.

Checkpoints: compressed-tensors "int-quantized" (llm-compressor's W8A8 recipe): ``config_groups``
with ``weights`` {type "int", num_bits 8, symmetric, strategy "channel"} and ``input_activations``
{type "int", num_bits 8, symmetric, dynamic, strategy "token"} (none at all: W8A16). Tensors:
``weight`` int8 [N, K] and ``weight_scale`` [N, 1] (float32 or the model's 16-bit dtype);
W = weight * weight_scale. Strategy "tensor" ([1] scales, one per checkpoint tensor) is read too.
Asymmetric weights (zero points), group or block strategies, static activation scales and other
bit widths are errors naming the config field.

In situ (``--quantization int8``): symmetric round-to-nearest per channel, scale = amax / 127.
Option ``act_quant`` (default True, W8A8): activations quantized to int8 per token at run time;
False multiplies 16-bit activations by the int8 weights (W8A16); a number of rows N (contract 1.17):
W8A8 for inputs of at least N rows only (``activations``). ``repack`` leaves ``weight`` int8
[N, K] contiguous and ``weight_scale`` float32 [N], the op's canonical form.
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from chitu_core.errors import ChituError
from chitu_core.quantization.activations import check_act_quant, quantizes_activations
from chitu_core.quantization.base import QuantMethod
from chitu_core.quantization.ct_config import require, single_scheme, weight_type
from chitu_core.quantization.fp8 import amax_scale
from chitu_core.quantization.params import quant_param
from chitu_core.quantization.registry import register_quant_method

INT8_MAX = 127.0


@register_quant_method
class Int8Method(QuantMethod):
    name = "int8"
    kernels = ("int8_linear",)
    defaults = {"strategy": "channel", "act_quant": True}

    def __init__(self, options: Mapping[str, Any] | None = None, in_situ: bool = False):
        super().__init__(options, in_situ)
        check_act_quant(self.name, self.options["act_quant"])

    @classmethod
    def claims(cls, quantization_config: Mapping[str, Any]) -> bool:
        return weight_type(quantization_config) == "int"

    @classmethod
    def options_from_checkpoint(cls, qc: Mapping[str, Any]) -> dict[str, Any]:
        scheme = single_scheme(qc)
        where, w = scheme.where + ".weights", scheme.weights
        what = "the int8 method"
        require(w, "num_bits", (8,), where, what)
        require(w, "symmetric", (True,), where, what)
        strategy = require(w, "strategy", ("channel", "tensor"), where, what)
        act = scheme.input_activations
        if act is not None:
            where = scheme.where + ".input_activations"
            require(act, "type", ("int",), where, what)
            require(act, "num_bits", (8,), where, what)
            require(act, "symmetric", (True,), where, what)
            if not act.get("dynamic", False):
                raise ChituError(f"{where}.dynamic is {act.get('dynamic')!r}: static activation scales are not "
                                 "supported; the int8 method quantizes activations dynamically per token")
            require(act, "strategy", ("token", "tensor"), where, what)
        return {"strategy": strategy, "act_quant": act is not None}

    @classmethod
    def conformance_options(cls) -> list[dict[str, Any]]:
        return [{"act_quant": True}, {"act_quant": False}]

    def _strategy(self) -> str:
        strategy = self.options["strategy"]
        if strategy not in ("channel", "tensor"):
            raise ChituError(f"int8: strategy {strategy!r} is not 'channel' or 'tensor'")
        return strategy

    def create_checkpoint_weights(self, layer, in_features, out_features, dtype, device):
        quant_param(layer, "weight", (out_features, in_features), torch.int8, device, out_dim=0, in_dim=1)
        if self._strategy() == "channel":
            quant_param(layer, "weight_scale", (out_features, 1), torch.float32, device, out_dim=0)
        else:  # one number per checkpoint tensor, filling the rows it covers
            scale = quant_param(layer, "weight_scale", (out_features,), torch.float32, device, out_dim=0)
            scale.per_tensor = True  # type: ignore[attr-defined]

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        amax = w.abs().amax(dim=1) if self._strategy() == "channel" else w.abs().amax().expand(w.shape[0])
        scales = amax_scale(amax, INT8_MAX).contiguous()
        q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return {"weight": q, "weight_scale": scales[:, None] if self._strategy() == "channel" else scales}

    def repack(self, layer: nn.Module) -> None:
        weight = layer.weight.data.contiguous()
        scales = layer.weight_scale.data.float().reshape(-1).contiguous()
        del layer.weight, layer.weight_scale
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(scales, requires_grad=False))

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale.float()[:, None]

    def apply(self, layer, x, bias, ops):
        return ops.int8_linear(x, layer.weight, layer.weight_scale, quantizes_activations(self.options["act_quant"], x),
                               bias)
