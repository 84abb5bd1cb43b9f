"""Parameters that know how they split for tensor parallelism.

A quantized weight is stored in tensors of other shapes than [out, in]: AWQ's qweight is
[in, out/8], GPTQ's scales [in/group, out], an FP8 block scale [out/128, in/128]. Each parameter a
method registers says which of its dimensions runs along the layer's output features (``out_dim``)
and which along its input features (``in_dim``), and how many features one element along that
dimension covers (``out_pack``/``in_pack``: 8 for eight 4-bit values in an int32, the group or
block size for scales, ``Fraction(32, 18)`` for GGUF Q4_0's 32 values in 18 bytes). The linear
layers' loaders slice any parameter by that alone. A span may end inside an element (a block scale of
a 576-row weight has ceil(576 / 128) = 5 rows): it then takes that whole last element.

A parameter with neither dimension is replicated: every rank loads the whole tensor. A 0-d
checkpoint tensor (a per-tensor scale) loaded into a parameter with ``out_dim`` fills the rows it
covers, so per-tensor scales of fused layers (q, k and v) become per-channel ones; a parameter
marked ``per_tensor`` takes a one-element [1] tensor the same way (compressed-tensors saves them so).
"""

from fractions import Fraction

import torch
from torch import nn

from chitu_core.errors import ModelLoadError


def quant_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                *, out_dim: int | None = None, in_dim: int | None = None, out_pack: int = 1,
                in_pack: int | Fraction = 1) -> nn.Parameter:
    """Create, mark and register an (uninitialised) parameter of ``layer``."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.out_dim, param.in_dim = out_dim, in_dim  # type: ignore[attr-defined]
    param.out_pack, param.in_pack = out_pack, in_pack  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def per_tensor_value(param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
    """``loaded`` as a 0-d tensor where it is a [1] per-tensor value for a parameter marked ``per_tensor``."""
    if getattr(param, "per_tensor", False) and loaded.dim() == 1 and loaded.numel() == 1:
        return loaded.reshape(())
    return loaded


def stored_span(param: nn.Parameter, start: int, size: int, along: str, what: str) -> tuple[int, int] | None:
    """Features [start, start + size) along ``along`` ("out" or "in") as (start, size) in the
    parameter's own elements along that dimension; None if the parameter does not split that way."""
    dim = getattr(param, f"{along}_dim", None)
    if dim is None:
        return None
    pack = Fraction(getattr(param, f"{along}_pack", 1))
    first, count = start / pack, size / pack
    if first.denominator != 1:
        raise ModelLoadError(
            f"{what}: features [{start}, {start + size}) along the {along}put dimension do not start on a whole "
            f"element of a parameter that packs {pack} features per element; this layer cannot be split or "
            f"fused at that point in this quantization format (try another tensor-parallel size)")
    return int(first), -(-count.numerator // count.denominator)


def copy_span(param: nn.Parameter, loaded: torch.Tensor, dim: int | None, dst: tuple[int, int] | None,
              src: tuple[int, int] | None, what: str) -> None:
    """Copy ``loaded`` narrowed to ``src`` into ``param`` narrowed to ``dst`` along ``dim`` (either
    span None: the whole dimension). A 0-d ``loaded`` fills the destination span."""
    from chitu_core.layers.weights import check_shape

    target = param.data if dim is None or dst is None else param.data.narrow(dim, *dst)
    if loaded.dim() == 0 and param.dim() > 0:
        target.fill_(loaded.item())
        return
    source = loaded if dim is None or src is None else loaded.narrow(dim, *src)
    check_shape(source.shape, tuple(target.shape), what)
    target.copy_(source)
