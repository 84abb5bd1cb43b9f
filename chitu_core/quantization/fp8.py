"""FP8 (e4m3) weights: the "fp8" method, multiplied by the ``fp8_linear`` op.

Checkpoints it reads (``weight`` float8_e4m3fn [N, K] in each; W = weight * scale):

* DeepSeek-V3 / transformers fine-grained FP8: ``{"quant_method": "fp8", "weight_block_size": [128,
  128], "activation_scheme": "dynamic", "fmt": "e4m3"}``; ``weight_scale_inv`` float32
  [ceil(N/128), ceil(K/128)], one scale per 128x128 block, the last block of a dimension possibly
  partial. Despite its name it multiplies (DeepSeek-V3's ``weight_dequant`` computes x * s).
* vLLM's per-tensor FP8: ``{"quant_method": "fp8"}`` without ``weight_block_size``; ``weight_scale``
  float32, one number per checkpoint tensor (0-d or [1]), so q, k and v fused into one layer keep
  their own scales as rows of a per-channel scale. ``activation_scheme: "static"`` adds an
  ``input_scale``: it is loaded and ignored, since activations are quantized dynamically here.
* compressed-tensors "float-quantized" FP8: ``weight_scale`` [N, 1] (strategy "channel"), [1]
  ("tensor") or [ceil(N/bn), ceil(K/bk)] ("block", ``block_structure``); static input activations
  likewise bring an ignored ``input_scale``.

Options: ``weight_block_size`` ([bn, bk] or None), ``strategy`` ("block", "channel" or "tensor"; by
default block with a block size, else channel), ``format`` ("fp8": the first two layouts' names,
or "compressed-tensors"), ``static_input_scale``, and ``act_quant``: False (default) is soft FP8,
the weights dequantized inside the GEMM with 16-bit activations; True quantizes activations to FP8
per token group as well (a backend whose device multiplies FP8 prefers it); a number of rows N
(contract 1.17) quantizes them for inputs of at least N rows only (``activations``). ``repack`` leaves every
variant in the op's canonical form: ``weight`` float8_e4m3fn [N, K] contiguous and ``weight_scale``
float32 [N] or [ceil(N/bn), ceil(K/bk)]. ``quantize`` (in situ, conformance) is round-to-nearest
with scale = amax / 448 per block, channel or tensor.

Routed MoE experts (contract 1.3): the same layouts, stacked over experts and run by the
``fused_experts_fp8`` op (soft FP8 whatever ``act_quant`` says: the op takes 16-bit activations).
A checkpoint's ``experts.{e}.gate_proj.weight`` and its scale load into expert e's slice of ``w13``
and ``w13_<scale name>`` (``w2`` for down_proj); ``repack_experts`` leaves ``w13``/``w2`` float8_e4m3fn
[E, N, K] and ``w13_scale``/``w2_scale`` float32 [E, N] or [E, ceil(N/bn), ceil(K/bk)]. Block scales
need gate and up to start on a block row of the stacked [2I, H] matrix, so this rank's intermediate
size must be a multiple of bn (and of bk where tensor parallelism splits down's columns); in situ each
expert's [2I, H] matrix is quantized whole, which has no such limit.
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.ops.quant_reference import FP8_MAX, dequantize_fp8
from chitu_core.quantization.activations import check_act_quant, quantizes_activations
from chitu_core.quantization.base import QuantMethod
from chitu_core.quantization.ct_config import require, single_scheme, weight_type
from chitu_core.quantization.params import quant_param
from chitu_core.quantization.registry import register_quant_method

STRATEGIES = ("block", "channel", "tensor")


def amax_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Symmetric scale from max |w|: amax / qmax, 1 where a group is all zeros (float32)."""
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def to_fp8(values: torch.Tensor) -> torch.Tensor:
    """float32 values (already divided by their scales) -> float8_e4m3fn, round to nearest even."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def block_amax(weight: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """max |w| of each [bn, bk] block of weight [N, K] (last blocks partial): [ceil(N/bn), ceil(K/bk)]."""
    n, k = weight.shape
    padded = nn.functional.pad(weight.abs().float(), (0, (-k) % bk, 0, (-n) % bn))
    return padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).amax(dim=(1, 3))


def expand_blocks(scales: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    """Block scales [ceil(N/bn), ceil(K/bk)] -> one per element [N, K]."""
    return scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


@register_quant_method
class Fp8Method(QuantMethod):
    name = "fp8"
    kernels = ("fp8_linear",)
    defaults = {"weight_block_size": None, "strategy": None, "format": "fp8", "static_input_scale": False,
                "act_quant": False}
    checkpoint_formats = ("fp8",)

    def __init__(self, options: Mapping[str, Any] | None = None, in_situ: bool = False):
        super().__init__(options, in_situ)
        check_act_quant(self.name, self.options["act_quant"])

    @classmethod
    def claims(cls, quantization_config: Mapping[str, Any]) -> bool:
        return quantization_config.get("quant_method") == "fp8" or weight_type(quantization_config) == "float"

    @classmethod
    def options_from_checkpoint(cls, qc: Mapping[str, Any]) -> dict[str, Any]:
        if qc.get("quant_method") == "compressed-tensors":
            return _compressed_tensors_options(qc)
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ChituError(f"quantization_config.fmt is {qc['fmt']!r}; the fp8 method reads e4m3 weights only")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ChituError(f"quantization_config.weight_block_size is {block!r}; expected two positive "
                             "integers [rows, columns] such as [128, 128], or null for per-tensor scales")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ChituError(f"quantization_config.activation_scheme is {scheme!r}; expected 'dynamic' or 'static'")
        return {"weight_block_size": list(block) if block else None, "strategy": "block" if block else "tensor",
                "format": "fp8", "static_input_scale": scheme == "static"}

    @classmethod
    def conformance_options(cls) -> list[dict[str, Any]]:
        return [{"weight_block_size": block, "act_quant": act_quant}
                for block in ([128, 128], None) for act_quant in (False, True)]

    # --- layout ---------------------------------------------------------------------------------

    @property
    def block_size(self) -> tuple[int, int] | None:
        block = self.options["weight_block_size"]
        return (int(block[0]), int(block[1])) if block else None

    @property
    def strategy(self) -> str:
        strategy = self.options["strategy"] or ("block" if self.block_size else "channel")
        if strategy not in STRATEGIES or (strategy == "block") != (self.block_size is not None):
            raise ChituError(f"fp8: strategy {strategy!r} with weight_block_size {self.options['weight_block_size']} "
                             "is not a layout this method has: 'block' needs a block size, 'channel' and "
                             "'tensor' none")
        return strategy

    @property
    def scale_name(self) -> str:
        """The checkpoint name of the scale: DeepSeek's block scales are ``weight_scale_inv``."""
        return "weight_scale_inv" if self.strategy == "block" and self.options["format"] == "fp8" else "weight_scale"

    def create_checkpoint_weights(self, layer, in_features, out_features, dtype, device):
        quant_param(layer, "weight", (out_features, in_features), torch.float8_e4m3fn, device, out_dim=0, in_dim=1)
        strategy = self.strategy
        if strategy == "block":
            bn, bk = self.block_size
            shape = (-(-out_features // bn), -(-in_features // bk))
            quant_param(layer, self.scale_name, shape, torch.float32, device, out_dim=0, in_dim=1, out_pack=bn,
                        in_pack=bk)
        elif strategy == "channel" and self.options["format"] == "compressed-tensors":
            quant_param(layer, "weight_scale", (out_features, 1), torch.float32, device, out_dim=0)
        else:  # per channel, or one number per checkpoint tensor filling the rows it covers
            scale = quant_param(layer, "weight_scale", (out_features,), torch.float32, device, out_dim=0)
            scale.per_tensor = strategy == "tensor"  # type: ignore[attr-defined]
        if self.options["static_input_scale"]:
            input_scale = quant_param(layer, "input_scale", (out_features,), torch.float32, device, out_dim=0)
            input_scale.per_tensor = True  # type: ignore[attr-defined]

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        n, k = w.shape
        strategy = self.strategy
        if strategy == "block":
            bn, bk = self.block_size
            scales = amax_scale(block_amax(w, bn, bk), FP8_MAX)
            out = {"weight": to_fp8(w / expand_blocks(scales, bn, bk, n, k)), self.scale_name: scales}
        else:
            amax = w.abs().amax(dim=1) if strategy == "channel" else w.abs().amax().expand(n)
            scales = amax_scale(amax, FP8_MAX).contiguous()
            out = {"weight": to_fp8(w / scales[:, None])}
            ct_channel = strategy == "channel" and self.options["format"] == "compressed-tensors"
            out["weight_scale"] = scales[:, None] if ct_channel else scales
        if self.options["static_input_scale"]:
            out["input_scale"] = torch.ones(n, device=w.device)
        return out

    def repack(self, layer: nn.Module) -> None:
        weight = layer.weight.data.contiguous()
        scales = getattr(layer, self.scale_name).data.float()
        scales = (scales.reshape(-1) if self.strategy != "block" else scales).contiguous()
        for name in (self.scale_name, "input_scale", "weight"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(scales, requires_grad=False))

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_fp8(layer.weight, layer.weight_scale, self.block_size)

    def apply(self, layer, x, bias, ops):
        return ops.fp8_linear(x, layer.weight, layer.weight_scale, self.block_size,
                              quantizes_activations(self.options["act_quant"], x), bias)

    # --- routed MoE experts ---------------------------------------------------------------------------

    holds_experts = True
    expert_kernels = ("fused_experts_fp8",)

    def create_expert_weights(self, layer, num_experts, hidden, local_inter, dtype, device):
        if self.in_situ:
            return super().create_expert_weights(layer, num_experts, hidden, local_inter, dtype, device)
        strategy, tp = self.strategy, getattr(layer, "split", 1)  # ranks an expert's rows split over (1 under EP)
        if strategy == "block":
            bn, bk = self.block_size
            if local_inter % bn or (tp > 1 and local_inter % bk):
                raise ModelLoadError(
                    f"fp8 MoE experts: {local_inter} intermediate rows per rank (moe intermediate size "
                    f"{local_inter * tp} over {tp} tensor-parallel rank(s)) is not a multiple of the checkpoint's "
                    f"{bn}x{bk} scale blocks, so gate, up and each rank's share cannot keep whole blocks; use a "
                    f"tensor-parallel size that keeps it a multiple of {max(bn, bk) if tp > 1 else bn}, or "
                    "quantize the 16-bit checkpoint in situ (--quantization fp8)")
        for family, n, k in (("w13", 2 * local_inter, hidden), ("w2", hidden, local_inter)):
            quant_param(layer, family, (num_experts, n, k), torch.float8_e4m3fn, device, out_dim=0, in_dim=1)
            if strategy == "block":
                bn, bk = self.block_size
                quant_param(layer, f"{family}_{self.scale_name}", (num_experts, -(-n // bn), -(-k // bk)),
                            torch.float32, device, out_dim=0, in_dim=1, out_pack=bn, in_pack=bk)
            elif strategy == "channel" and self.options["format"] == "compressed-tensors":
                quant_param(layer, f"{family}_weight_scale", (num_experts, n, 1), torch.float32, device, out_dim=0)
            else:
                scale = quant_param(layer, f"{family}_weight_scale", (num_experts, n), torch.float32, device,
                                    out_dim=0)
                scale.per_tensor = strategy == "tensor"  # type: ignore[attr-defined]
            if self.options["static_input_scale"]:
                input_scale = quant_param(layer, f"{family}_input_scale", (num_experts, n), torch.float32, device,
                                          out_dim=0)
                input_scale.per_tensor = True  # type: ignore[attr-defined]

    def repack_experts(self, layer: nn.Module) -> None:
        for family in ("w13", "w2"):
            weight = getattr(layer, family).data.contiguous()
            scales = getattr(layer, f"{family}_{self.scale_name}").data.float()
            scales = (scales.flatten(1) if self.strategy != "block" else scales).contiguous()
            for name in (family, f"{family}_{self.scale_name}", f"{family}_input_scale"):
                if hasattr(layer, name):
                    delattr(layer, name)
            layer.register_parameter(family, nn.Parameter(weight, requires_grad=False))
            layer.register_parameter(f"{family}_scale", nn.Parameter(scales, requires_grad=False))

    def apply_experts(self, layer, x, topk_weights, topk_ids, activation, ops):
        return ops.fused_experts_fp8(x, layer.w13, layer.w13_scale, layer.w2, layer.w2_scale, self.block_size,
                                     topk_weights, topk_ids, activation)


def _compressed_tensors_options(qc: Mapping[str, Any]) -> dict[str, Any]:
    scheme = single_scheme(qc)
    where, w = scheme.where + ".weights", scheme.weights
    what = "the fp8 method"
    require(w, "num_bits", (8,), where, what)
    require(w, "symmetric", (True,), where, what)
    strategy = require(w, "strategy", STRATEGIES, where, what)
    block = None
    if strategy == "block":
        block = w.get("block_structure")
        if not block or len(block) != 2:
            raise ChituError(f"{where}.block_structure is {block!r}; strategy 'block' needs [rows, columns]")
    act = scheme.input_activations
    static = False
    if act is not None:
        where = scheme.where + ".input_activations"
        require(act, "type", ("float",), where, what)
        require(act, "num_bits", (8,), where, what)
        require(act, "symmetric", (True,), where, what)
        static = not act.get("dynamic", False)
    return {"weight_block_size": list(block) if block else None, "strategy": strategy,
            "format": "compressed-tensors", "static_input_scale": static}
