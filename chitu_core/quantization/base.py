"""The QuantMethod contract and the unquantized method."""

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from chitu_core.ops.table import Ops


class QuantMethod(ABC):
    """How one linear layer stores and applies its weight.

    name:    registry name (also what a checkpoint's quantization config maps to).
    kernels: op names (in ``chitu_core.ops``) the method needs from a backend.
    """

    name: ClassVar[str]
    kernels: ClassVar[tuple[str, ...]]

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Register the layer's parameters for a [out_features, in_features] (this rank's shard) weight."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Load-time transform (repacking, scale folding) once every shard is loaded."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""


class UnquantizedMethod(QuantMethod):
    """A dense weight in the model dtype, multiplied by ``ops.linear``."""

    name = "unquantized"
    kernels = ("linear",)

    def create_weights(self, layer, in_features, out_features, dtype, device):
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias, ops):
        return ops.linear(x, layer.weight, bias)
