"""Linear layers split for tensor parallelism. With tp_size == 1 each is a plain linear.

Column-split layers hold rows [rank*n, (rank+1)*n) of the output features;
row-split layers hold a slice of the input features and sum partial outputs
with an all-reduce. Weights are created by the layer's quantization method, and
every parameter is sliced by the dimensions it declares (``quantization.params``),
so the same loaders serve dense and quantized checkpoints. Each split parameter's
loader is the rank's part of a checkpoint tensor (``local_part``) copied into place
(``load_local``; see ``layers.weights.set_loader``), so that a checkpoint pre-sharded
by ``python -m chitu_core.convert --tp`` loads without slicing.
"""

from fractions import Fraction
from math import ceil

import torch
from torch import nn

from chitu_core.layers.context import BuildContext
from chitu_core.layers.weights import check_shape, set_loader
from chitu_core.quantization import QuantMethod, UnquantizedMethod
from chitu_core.quantization.params import copy_span, per_tensor_value, stored_span


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


def _full_shape(param: nn.Parameter, along: str, features: int) -> tuple[int, ...]:
    """The checkpoint shape of ``param`` when ``features`` run along its ``along`` dimension."""
    shape = list(param.shape)
    dim = getattr(param, f"{along}_dim", None)
    if dim is not None:
        shape[dim] = ceil(Fraction(features) / Fraction(getattr(param, f"{along}_pack", 1)))
    return tuple(shape)


def _rank_part(param: nn.Parameter, loaded: torch.Tensor, along: str, full: int, start: int, size: int,
               what: str) -> torch.Tensor:
    """Features [start, start + size) along ``along`` of a checkpoint tensor holding ``full`` of them,
    in the parameter's own elements; a 0-d (per-tensor) value as it is."""
    loaded = per_tensor_value(param, loaded)
    if not loaded.dim():
        return loaded
    check_shape(loaded.shape, _full_shape(param, along, full), what)
    span = stored_span(param, start, size, along, what)
    return loaded if span is None else loaded.narrow(getattr(param, f"{along}_dim"), *span)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: BuildContext):
        super().__init__()
        self.ops, self.comm = ctx.ops, ctx.comm
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.device = ctx.dtype, ctx.device
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=ctx.dtype, device=ctx.device), requires_grad=False)
            self.bias.out_dim, self.bias.out_pack = 0, 1
        else:
            self.register_parameter("bias", None)
        self.packed = None  # a PackedLinear where the backend took the layer over (contract 1.7)
        self.set_quant_method(ctx.new_quant_method())

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias): by the backend's packed weight where it took the layer, else by the method."""
        if self.packed is not None:
            return self.packed(x, bias)
        return self.quant.apply(self, x, bias, self.ops)

    def set_quant_method(self, method: QuantMethod) -> None:
        """(Re)create the weights with ``method`` (e.g. unquantized for a layer a checkpoint leaves so)."""
        for name, _ in list(self.named_parameters(recurse=False)):
            if name != "bias":
                delattr(self, name)
        self.quant = method
        method.create_weights(self, self.in_features, self.out_features, self.dtype, self.device)
        for param in self.parameters(recurse=False):
            self.attach_loader(param)

    def attach_loader(self, param: nn.Parameter) -> None:
        """Give ``param`` its weight loader; here (a replicated linear) one that copies the whole tensor."""
        set_loader(param, self.load_whole)

    def load_whole(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        loaded = per_tensor_value(param, loaded)
        copy_span(param, loaded, None, None, None, "replicated linear")

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, activation: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias). The decode-step fusions of contract 1.9, where ``fuses()``: with ``norm`` (an
        RMSNorm) the product of norm(x), and with ``activation`` too its gated activation
        (``ops.rms_norm_linear``); with ``residual``, residual + the product (``ops.linear_add``)."""
        if norm is None and residual is None:
            return self.product(x, self.bias)
        return self.fused(x, norm, activation, residual)

    def fuses(self) -> bool:
        """Whether the fusions may take this layer: a weight not in a backend's own layout, whose method has
        fusions the backend serves (``QuantMethod.fuses``: 1.9's for a dense weight, 1.18's for 4-bit
        ones), and ``splits_fuse()``."""
        return self.packed is None and self.splits_fuse() and self.quant.fuses(self, self.ops)

    def splits_fuse(self) -> bool:
        """Whether this rank's part takes the fusions: here the input is whole on every rank (a replicated
        or column-split weight), so the norm of its prologue sees whole rows."""
        return True

    def fused(self, x: torch.Tensor, norm: nn.Module | None, activation: str | None,
              residual: torch.Tensor | None) -> torch.Tensor:
        if not self.fuses():
            raise ValueError(f"{type(self).__name__}: the decode-step fusions do not take this layer (method "
                             f"{self.quant.name}, tp {self.tp_size}); call it without norm or residual")
        if norm is not None:
            return self.quant.apply_fused(self, x, norm.weight, norm.eps, activation, None, self.bias, self.ops)
        return self.quant.apply_fused(self, x, None, 0.0, None, residual, self.bias, self.ops)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice."""

    def __init__(self, in_features: int, out_features: int, ctx: BuildContext, bias: bool = False):
        self.local_out = _divide(out_features, ctx.tp_size, "out_features")
        super().__init__(in_features, self.local_out, bias, ctx)

    def attach_loader(self, param):
        set_loader(param, self.load_shard, local_part=self.local_part, load_local=self.load_whole)

    def local_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> torch.Tensor:
        return _rank_part(param, loaded, "out", self.local_out * self.tp_size, self.tp_rank * self.local_out,
                          self.local_out, "column-split linear")

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self.load_whole(param, self.local_part(param, loaded))


class _FusedColumns(LinearBase):
    """Column-split parts stored one after another in each parameter: part -> (offset, size, full size, rank)."""

    parts: dict

    def attach_loader(self, param):
        set_loader(param, self.load_shard, tuple(self.parts), local_part=self.local_part, load_local=self.load_part)

    def local_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> torch.Tensor:
        _, size, full, rank = self.parts[shard_id]
        return _rank_part(param, loaded, "out", full, rank * size, size, self.part_name(shard_id))

    def load_part(self, param: nn.Parameter, part: torch.Tensor, shard_id) -> None:
        """Copy this rank's part ``shard_id`` into its rows of the fused parameter."""
        part = per_tensor_value(param, part)
        offset, size, _, _ = self.parts[shard_id]
        what = self.part_name(shard_id)
        dst = stored_span(param, offset, size, "out", what)
        copy_span(param, part, getattr(param, "out_dim", None), dst, None, what)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        self.load_part(param, self.local_part(param, loaded, shard_id), shard_id)

    def part_name(self, shard_id) -> str:
        return f"fused linear part {shard_id}"


class MergedColumnParallelLinear(_FusedColumns):
    """Several column-split linears on the same input stored as one (e.g. gate and up)."""

    def __init__(self, in_features: int, out_features_list: list[int], ctx: BuildContext, bias: bool = False):
        self.local_sizes = [_divide(n, ctx.tp_size, "out_features") for n in out_features_list]
        self.parts = {i: (sum(self.local_sizes[:i]), n, full, ctx.tp_rank)
                      for i, (n, full) in enumerate(zip(self.local_sizes, out_features_list))}
        super().__init__(in_features, sum(self.local_sizes), bias, ctx)


class QKVParallelLinear(_FusedColumns):
    """Query, key and value projections in one, split by heads. Key/value heads are replicated
    when there are fewer of them than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, ctx: BuildContext, bias: bool = False):
        tp = ctx.tp_size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        kv_rank = ctx.tp_rank // self.kv_replicas
        self.parts = {"q": (0, q, num_heads * head_dim, ctx.tp_rank),
                      "k": (q, kv, num_kv_heads * head_dim, kv_rank),
                      "v": (q + kv, kv, num_kv_heads * head_dim, kv_rank)}
        super().__init__(hidden_size, q + 2 * kv, bias, ctx)

    def part_name(self, shard_id) -> str:
        return f"{shard_id}_proj"


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce, unless
    ``reduce`` is set False: then forward returns this rank's partial product (the bias added on rank 0
    only) and the caller sums it, e.g. in ``Communicator.all_reduce_add_rms_norm`` at the next norm."""

    def __init__(self, in_features: int, out_features: int, ctx: BuildContext, bias: bool = False):
        self.local_in = _divide(in_features, ctx.tp_size, "in_features")
        super().__init__(self.local_in, out_features, bias, ctx)
        self.reduce = True

    def attach_loader(self, param):
        if param is self.bias:
            set_loader(param, self.load_bias)
        else:
            set_loader(param, self.load_weight, local_part=self.local_part, load_local=self.load_whole)

    def local_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> torch.Tensor:
        return _rank_part(param, loaded, "in", self.local_in * self.tp_size, self.tp_rank * self.local_in,
                          self.local_in, "row-split linear")

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self.load_whole(param, self.local_part(param, loaded))

    def load_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded.shape, tuple(param.shape), "row-split linear bias")
        param.data.copy_(loaded)

    def splits_fuse(self) -> bool:
        """Whole on this rank, or the ranks' sum in one pass with the add (``Communicator.fuses_linear_all_reduce``,
        whose ``linear_add`` takes a dense weight)."""
        return self.tp_size == 1 or (type(self.quant) is UnquantizedMethod and self.comm.fuses_linear_all_reduce())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With ``residual``: residual + the product summed over ranks, fused (``LinearBase.forward`` on one
        rank; ``Communicator.linear_all_reduce_add`` on several)."""
        if residual is not None:
            if self.tp_size > 1 and self.fuses():
                return self.comm.linear_all_reduce_add(x, self.weight, self.bias, residual, self.ops)
            return self.fused(x, None, None, residual)
        # The bias is added once: after the sum over ranks, or before it on rank 0 alone.
        out = self.product(x, None)
        if self.reduce:
            out = self.comm.all_reduce(out)
        elif self.tp_rank != 0:
            return out
        return out if self.bias is None else out + self.bias
