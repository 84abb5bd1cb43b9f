"""Linear layers split for tensor parallelism. With tp_size == 1 each is a plain linear.

Column-split layers hold rows [rank*n, (rank+1)*n) of the output features;
row-split layers hold a slice of the input features and sum partial outputs
with an all-reduce. Weights are created by the layer's quantization method.
"""

import torch
from torch import nn

from chitu_core.layers.context import BuildContext
from chitu_core.layers.weights import check_shape, narrow_rank, set_loader


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: BuildContext):
        super().__init__()
        self.ops, self.comm = ctx.ops, ctx.comm
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        self.quant = ctx.new_quant_method()
        self.quant.create_weights(self, in_features, out_features, ctx.dtype, ctx.device)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=ctx.dtype, device=ctx.device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant.apply(self, x, self.bias, self.ops)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice."""

    def __init__(self, in_features: int, out_features: int, ctx: BuildContext, bias: bool = False):
        self.local_out = _divide(out_features, ctx.tp_size, "out_features")
        super().__init__(in_features, self.local_out, bias, ctx)
        for p in self.parameters():
            set_loader(p, self.load_shard)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded.shape, (self.local_out * self.tp_size, *param.shape[1:]), "column-split linear")
        param.data.copy_(narrow_rank(loaded, 0, self.tp_rank, self.local_out))


class MergedColumnParallelLinear(LinearBase):
    """Several column-split linears on the same input stored as one (e.g. gate and up)."""

    def __init__(self, in_features: int, out_features_list: list[int], ctx: BuildContext, bias: bool = False):
        self.local_sizes = [_divide(n, ctx.tp_size, "out_features") for n in out_features_list]
        super().__init__(in_features, sum(self.local_sizes), bias, ctx)
        for p in self.parameters():
            set_loader(p, self.load_shard, tuple(range(len(out_features_list))))

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        n = self.local_sizes[shard_id]
        check_shape(loaded.shape, (n * self.tp_size, *param.shape[1:]), f"fused linear part {shard_id}")
        param.data.narrow(0, sum(self.local_sizes[:shard_id]), n).copy_(narrow_rank(loaded, 0, self.tp_rank, n))


class QKVParallelLinear(LinearBase):
    """Query, key and value projections in one, split by heads. Key/value heads are replicated
    when there are fewer of them than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, ctx: BuildContext, bias: bool = False):
        tp = ctx.tp_size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        sizes = (self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim)
        self.offsets = {"q": (0, sizes[0]), "k": (sizes[0], sizes[1]), "v": (sizes[0] + sizes[1], sizes[2])}
        self.full_heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        super().__init__(hidden_size, sum(sizes), bias, ctx)
        for p in self.parameters():
            set_loader(p, self.load_shard, ("q", "k", "v"))

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        start, size = self.offsets[shard_id]
        check_shape(loaded.shape, (self.full_heads[shard_id] * self.head_dim, *param.shape[1:]), f"{shard_id}_proj")
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        param.data.narrow(0, start, size).copy_(narrow_rank(loaded, 0, rank, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, ctx: BuildContext, bias: bool = False):
        self.local_in = _divide(in_features, ctx.tp_size, "in_features")
        super().__init__(self.local_in, out_features, bias, ctx)
        set_loader(self.weight, self.load_weight)
        if self.bias is not None:
            set_loader(self.bias, self.load_bias)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded.shape, (param.shape[0], self.local_in * self.tp_size), "row-split linear")
        param.data.copy_(narrow_rank(loaded, 1, self.tp_rank, self.local_in))

    def load_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded.shape, tuple(param.shape), "row-split linear bias")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the sum over ranks.
        out = self.quant.apply(self, x, None, self.ops)
        out = self.comm.all_reduce(out)
        return out if self.bias is None else out + self.bias
