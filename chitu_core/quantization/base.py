"""The QuantMethod contract and the unquantized method.

A method owns a linear layer's weight parameters through their whole life:

1. ``create_weights`` registers them under their checkpoint names, each marked with how it is split
   for tensor parallelism (``quant_param``), so the layers' generic loaders can slice them;
2. the checkpoint (or ``load_format="dummy"``) fills them;
3. ``process_weights_after_loading`` repacks them into the layout its kernels (the backend's
   choice, see ``options``) read;
4. ``apply`` multiplies through ops the backend declares (``kernels``).

Options: a method instance carries a dict merged from the checkpoint's ``quantization_config``
(``options_from_checkpoint``) and then the backend's preferences (``Backend.quant_preferences``),
e.g. ``{"group_size": 128}`` or ``{"act_quant": True}``. ``in_situ`` (set by ``--quantization``):
the layer is created with a 16-bit ``weight`` as an unquantized one would be, and quantized by
``quantize`` at load time, so a 16-bit checkpoint (or dummy weights) runs quantized.

Routed MoE experts (contract 1.3): a method that sets ``holds_experts`` also owns a ``FusedMoE`` layer's
stacked experts, through hooks that mirror the four steps: ``create_expert_weights`` (the ``w13`` and
``w2`` families of parameters, see there), the layer's loader (one expert's checkpoint tensor into its
slice), ``process_expert_weights_after_loading`` (in situ: ``quantize`` each expert's two matrices)
and ``apply_experts`` (through the ops in ``expert_kernels``). The defaults keep a method written for
1.0-1.2 working: it holds no experts, and a model whose experts it would quantize keeps them dense in
situ, or is refused with a one-line error when a checkpoint stores them in that format.

Decode-step fusions (contract 1.18): a method names the ops of its fusions in ``fusion_kernels`` (the norm
before a product, the residual after it) and implements ``apply_fused``; a layer takes them where ``fuses``
says the backend serves them itself. The unquantized method's are 1.9's ``rms_norm_linear`` and
``linear_add``, the 4-bit methods' ``int4_rms_norm_linear`` and ``int4_linear_add``; the default has none.
"""

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from chitu_core.ops.table import Ops
from chitu_core.quantization.params import quant_param


class QuantMethod(ABC):
    """How one linear layer stores and applies its weight (see the module docstring).

    name:     registry name (what a checkpoint's quantization config maps to).
    kernels:  op names (in ``chitu_core.ops``) ``apply`` calls.
    defaults: option values when neither checkpoint nor backend sets them.
    """

    name: ClassVar[str]
    kernels: ClassVar[tuple[str, ...]]
    defaults: ClassVar[Mapping[str, Any]] = {}
    checkpoint_formats: ClassVar[tuple[str, ...]] = ()  # quantization_config["quant_method"] values it reads

    def __init__(self, options: Mapping[str, Any] | None = None, in_situ: bool = False):
        self.options = {**self.defaults, **(options or {})}
        self.in_situ = in_situ

    # --- what a checkpoint holds ----------------------------------------------------------------

    @classmethod
    def claims(cls, quantization_config: Mapping[str, Any]) -> bool:
        """Whether this method reads a checkpoint with this ``quantization_config`` (by default: its
        ``quant_method`` is one of ``checkpoint_formats``; compressed-tensors methods look further)."""
        return quantization_config.get("quant_method") in cls.checkpoint_formats

    @classmethod
    def options_from_checkpoint(cls, quantization_config: Mapping[str, Any]) -> dict[str, Any]:
        """Options read from a checkpoint's ``quantization_config`` (config.json); errors name the field."""
        return {}

    @classmethod
    def layer_options(cls, quantization_config: Mapping[str, Any], module: str,
                      parts: tuple[str, ...]) -> dict[str, Any] | None:
        """Options for one layer where a checkpoint varies them per layer (GGUF's tensor types):
        ``module`` is the layer's name in the model, ``parts`` the checkpoint names of the layers fused
        into it (q_proj, k_proj, v_proj for qkv_proj; empty when not fused). None: the model-wide options."""
        return None

    @classmethod
    def conformance_options(cls) -> list[dict[str, Any]]:
        """The option sets the conformance suite runs (e.g. each group size, act-order on and off)."""
        return [{}]

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype,
                       device: torch.device) -> None:
        """Register the parameters of a [out_features, in_features] (this rank's shard) weight: the
        checkpoint's tensors, or, in situ, a dense ``weight`` in ``dtype``."""
        if self.in_situ:
            quant_param(layer, "weight", (out_features, in_features), dtype, device, out_dim=0, in_dim=1)
        else:
            self.create_checkpoint_weights(layer, in_features, out_features, dtype, device)

    def create_checkpoint_weights(self, layer: nn.Module, in_features: int, out_features: int,
                                  dtype: torch.dtype, device: torch.device) -> None:
        """Register the tensors a checkpoint of this format holds for the layer, with ``quant_param``.
        (A method written for contract 1.0 overrides ``create_weights`` instead.)"""
        raise NotImplementedError(f"quantization method {self.name!r} defines no checkpoint weights")

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight: [out, in] floating -> the checkpoint tensors (by parameter name) that hold it in
        this format, round-to-nearest. Used for in-situ quantization, conversion and conformance."""
        raise NotImplementedError(f"quantization method {self.name!r} cannot quantize a weight itself")

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight as a float32 [out, in] tensor, after ``process_weights_after_loading``
        (for layers that derive other weights from it, such as MLA's absorbed matrices)."""
        raise NotImplementedError(f"quantization method {self.name!r} cannot dequantize its weights")

    # --- load time and run time -----------------------------------------------------------------

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize in situ if asked, then ``repack``."""
        if self.in_situ:
            weight = layer.weight
            del layer.weight
            for name, value in self.quantize(weight.data).items():
                layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
            del weight
        self.repack(layer)

    def repack(self, layer: nn.Module) -> None:
        """Turn the checkpoint tensors into the layout ``apply``'s kernels read (default: as they are)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features] in x.dtype."""

    # --- decode-step fusions of the method's weights (contract 1.18) ----------------------------------

    fusion_kernels: ClassVar[tuple[str, ...]] = ()
    """Op names ``apply_fused`` calls: the decode-step fusions (1.9's ``rms_norm_linear`` and ``linear_add``)
    over this method's weights; empty where it has none (the layer then keeps its unfused path)."""

    def fuses(self, layer: nn.Module, ops: Ops) -> bool:
        """Whether ``apply_fused`` may take ``layer``: the method has fusions and the backend serves each of
        them itself (where one would be the reference's, the unfused ops stay faster)."""
        return bool(self.fusion_kernels) and all(
            name in ops.sources and ops.sources[name].kind != "fallback" for name in self.fusion_kernels)

    def apply_fused(self, layer: nn.Module, x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                    activation: str | None, residual: torch.Tensor | None, bias: torch.Tensor | None,
                    ops: Ops) -> torch.Tensor:
        """With ``norm_weight``: the product of rms_norm(x) (and its gated ``activation``, if any); else
        ``residual`` + the product. Called only where ``fuses``."""
        raise NotImplementedError(f"quantization method {self.name!r} has no decode-step fusions")

    # --- routed MoE experts (contract 1.3) ---------------------------------------------------------

    holds_experts: ClassVar[bool] = False
    """Whether this method can hold a ``FusedMoE`` layer's stacked experts (the hooks below)."""
    expert_kernels: ClassVar[tuple[str, ...]] = ()
    """Op names ``apply_experts`` calls; a backend whose op table lacks one is refused at build time."""

    def create_expert_weights(self, layer: nn.Module, num_experts: int, hidden: int, local_inter: int,
                              dtype: torch.dtype, device: torch.device) -> None:
        """Register a MoE layer's expert parameters: E = num_experts, H = hidden, I = local_inter (this
        rank's share of one expert's intermediate size). Two families, by name: ``w13`` (each expert's
        [2I, H] gate rows then up rows) and ``w2`` (each expert's [H, I] down projection), the weight
        itself under that name and each other checkpoint tensor ``X`` of the projection as ``w13_X`` /
        ``w2_X`` (``map_expert_weight`` names ``experts.{e}.up_proj.weight_scale_inv`` so). Each is
        stacked over experts ([E, ...]) and marked by ``quant_param`` as one expert's slice ``param[e]``
        splits (``out_dim``/``in_dim`` count the dimensions of that slice). In situ (the default): dense
        ``w13`` and ``w2`` in ``dtype``."""
        if not self.in_situ:
            raise NotImplementedError(f"quantization method {self.name!r} defines no checkpoint expert weights")
        dense_expert_weights(layer, num_experts, hidden, local_inter, dtype, device)

    def process_expert_weights_after_loading(self, layer: nn.Module) -> None:
        """In situ: replace the dense ``w13`` and ``w2`` by what ``quantize`` makes of each expert's
        matrix, stacked (``quantize``'s ``weight`` under the family's name, any other tensor ``X`` as
        ``w13_X``), one expert at a time; then ``repack_experts``."""
        if self.in_situ:
            for family in ("w13", "w2"):
                dense = getattr(layer, family)
                delattr(layer, family)
                stacked: dict[str, torch.Tensor] = {}
                for expert in range(dense.shape[0]):
                    for name, value in self.quantize(dense.data[expert]).items():
                        if name not in stacked:
                            stacked[name] = value.new_empty((dense.shape[0], *value.shape))
                        stacked[name][expert] = value
                del dense
                for name, value in stacked.items():
                    layer.register_parameter(family if name == "weight" else f"{family}_{name}",
                                             nn.Parameter(value, requires_grad=False))
        self.repack_experts(layer)

    def repack_experts(self, layer: nn.Module) -> None:
        """Turn the loaded expert tensors into the layout ``apply_experts``' kernels read (default: as they are)."""

    def apply_experts(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      activation: str, ops: Ops) -> torch.Tensor:
        """x: [T, H], topk_weights / topk_ids: ``moe_route``'s -> [T, H] in x.dtype, this rank's partial sum
        (``ops.fused_experts``' semantics, with this method's weights)."""
        raise NotImplementedError(f"quantization method {self.name!r} cannot run MoE experts")

    @classmethod
    def table_options(cls, quantization_config: Mapping[str, Any], module: str) -> dict[str, Any] | None:
        """Options for a vocabulary table (``module``: the input embedding or an untied LM head) that
        the checkpoint stores in this format, or None where it keeps the table dense (the default)."""
        return None

    def lookup(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a quantized vocabulary table (``table_options``) as float32 [len(ids), H].
        Default: the whole table dequantized, then indexed (correct, slow); a method with tables
        overrides it."""
        return self.dequantize(layer)[ids]

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes ``apply`` reads from the layer's parameters and buffers (the bench's floor)."""
        tensors = list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False))
        return sum(t.numel() * t.element_size() for t in tensors if t is not getattr(layer, "bias", None))


class UnquantizedMethod(QuantMethod):
    """A dense weight in the model dtype, multiplied by ``ops.linear``."""

    name = "unquantized"
    kernels = ("linear",)

    def create_checkpoint_weights(self, layer, in_features, out_features, dtype, device):
        quant_param(layer, "weight", (out_features, in_features), dtype, device, out_dim=0, in_dim=1)

    def quantize(self, weight):
        return {"weight": weight}

    def dequantize(self, layer):
        return layer.weight.float()

    def process_weights_after_loading(self, layer):
        pass

    def apply(self, layer, x, bias, ops):
        return ops.linear(x, layer.weight, bias)

    fusion_kernels = ("rms_norm_linear", "linear_add")

    def fuses(self, layer, ops):
        return True  # the decoder layers ask the backend once (llama.serves_fusions); MLA's inputs have their own

    def apply_fused(self, layer, x, norm_weight, eps, activation, residual, bias, ops):
        if norm_weight is not None:
            return ops.rms_norm_linear(x, norm_weight, eps, layer.weight, bias, activation)
        return ops.linear_add(x, layer.weight, bias, residual)

    holds_experts = True
    expert_kernels = ("fused_experts",)

    def create_expert_weights(self, layer, num_experts, hidden, local_inter, dtype, device):
        dense_expert_weights(layer, num_experts, hidden, local_inter, dtype, device)

    def process_expert_weights_after_loading(self, layer):
        pass

    def apply_experts(self, layer, x, topk_weights, topk_ids, activation, ops):
        return ops.fused_experts(x, layer.w13, layer.w2, topk_weights, topk_ids, activation)


def dense_expert_weights(layer: nn.Module, num_experts: int, hidden: int, local_inter: int, dtype: torch.dtype,
                         device: torch.device) -> None:
    """``w13`` [E, 2I, H] and ``w2`` [E, H, I] in ``dtype``, marked as one expert's [out, in] matrix."""
    quant_param(layer, "w13", (num_experts, 2 * local_inter, hidden), dtype, device, out_dim=0, in_dim=1)
    quant_param(layer, "w2", (num_experts, hidden, local_inter), dtype, device, out_dim=0, in_dim=1)
