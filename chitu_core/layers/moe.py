"""Mixture of experts: the routed experts of one layer as stacked tensors, and the router.

``FusedMoE`` holds every routed expert of a layer in one tensor per projection and runs them with
two ops: ``moe_route`` (router logits -> top-k weights and expert ids) and ``fused_experts`` (the
weighted sum of the chosen experts' MLPs). Shared experts are not part of it: a model composes them
from the dense layers (a gated MLP beside the routed experts).

Checkpoints store one tensor per expert and projection (``...experts.{e}.gate_proj.weight``;
Mixtral's ``w1``/``w3``/``w2``). ``map_expert_weight`` turns such a name into the stacked
parameter and an ``ExpertShard``; a model's ``CausalLM.map_weight_name`` calls it first.
"""

import re
from typing import NamedTuple

import torch
from torch import nn

from chitu_core.errors import ModelLoadError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.linear import _divide
from chitu_core.layers.weights import ShapeMismatch, check_shape, default_loader, narrow_rank, set_loader

# Checkpoint projection name -> the part of an expert it is.
GATE_UP_DOWN = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}  # Qwen-MoE, DeepSeek
MIXTRAL_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}

_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


class ExpertShard(NamedTuple):
    """The shard id of one expert's projection in a stacked parameter: part is "gate", "up" or "down"."""

    expert: int
    part: str


def map_expert_weight(name: str, parts: dict[str, str] = GATE_UP_DOWN) -> tuple[str, ExpertShard] | None:
    """``"m.layers.1.mlp.experts.7.up_proj.weight"`` -> ``("m.layers.1.mlp.experts.w13",
    ExpertShard(7, "up"))``; None for a name that is not a routed expert's projection. ``parts``
    maps the checkpoint's projection names onto gate/up/down."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None or match["proj"] not in parts:
        return None
    part = parts[match["proj"]]
    param = "w2" if part == "down" else "w13"
    return f"{match['prefix']}.{param}", ExpertShard(int(match["expert"]), part)


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer.

    Constructor: ``FusedMoE(num_experts, hidden_size, intermediate_size, ctx, top_k, *, scoring="softmax",
    renormalize=False, num_groups=1, topk_groups=1, group_score="max", scaling=1.0,
    correction_bias=False, activation="silu")``. The routing arguments are ``ops.moe_route``'s, one to
    one (see chitu_core/ops/spec.py); ``intermediate_size`` is one expert's (e.g. moe_intermediate_size).
    With ``correction_bias`` the layer owns ``e_score_correction_bias`` (float32 [E], DeepSeek-V3's),
    replicated on every rank; a checkpoint that stores it under the router (``...gate.e_score_correction_bias``)
    maps it here in the model's ``map_weight_name``.

    Parameters, in the model dtype on the device (I_local = intermediate_size / tp_size):
      ``w13`` [E, 2*I_local, H]: each expert's gate rows, then its up rows;
      ``w2``  [E, H, I_local]: each expert's down projection.
    Tensor parallelism splits every expert's intermediate dimension: rank r holds gate and up rows
    [r*I_local, (r+1)*I_local) and the same columns of down; its partial outputs are summed over
    ranks. Every expert lives on every rank; the router is replicated (see ``Router``).
    Loading: shard ids are ``ExpertShard(e, "gate" | "up")`` for w13 and ``ExpertShard(e, "down")`` for w2,
    and each must be loaded once (``load_into`` checks it).

    forward(x [T, H], router_logits [T, E]) -> [T, H] in x.dtype, summed over ranks.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ctx: BuildContext, top_k: int, *,
                 scoring: str = "softmax", renormalize: bool = False, num_groups: int = 1, topk_groups: int = 1,
                 group_score: str = "max", scaling: float = 1.0, correction_bias: bool = False,
                 activation: str = "silu"):
        super().__init__()
        # Experts stay in the model dtype: in situ (--quantization quantizes the other linears), or where the
        # checkpoint leaves them unquantized (its ignore list names them, as chitu_core.convert writes it).
        experts_dense = ctx.quant.in_situ or any("experts" in pattern for pattern in ctx.quant.ignored)
        if ctx.quant.method != "unquantized" and not experts_dense:
            raise ModelLoadError(f"quantized MoE experts ({ctx.quant.method!r}) are not supported yet; load an "
                                 "unquantized checkpoint, with --quantization to quantize its other linear layers")
        self.ops, self.comm = ctx.ops, ctx.comm
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.local_inter = _divide(intermediate_size, ctx.tp_size, "moe intermediate_size")
        self.route_args = dict(top_k=top_k, scoring=scoring, renormalize=renormalize, num_groups=num_groups,
                               topk_groups=topk_groups, group_score=group_score, scaling=scaling)
        self.activation = activation

        def empty(*shape: int, dtype: torch.dtype = ctx.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=ctx.device), requires_grad=False)

        self.w13 = empty(num_experts, 2 * self.local_inter, hidden_size)
        self.w2 = empty(num_experts, hidden_size, self.local_inter)
        experts = range(num_experts)
        set_loader(self.w13, self.load_expert, tuple(ExpertShard(e, p) for e in experts for p in ("gate", "up")))
        set_loader(self.w2, self.load_expert, tuple(ExpertShard(e, "down") for e in experts))
        if correction_bias:
            self.e_score_correction_bias = empty(num_experts, dtype=torch.float32)
            set_loader(self.e_score_correction_bias, default_loader)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShard) -> None:
        """Copy one expert's gate, up ([I, H]) or down ([H, I]) projection into its slice of w13 or w2."""
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ShapeMismatch(f"expert {expert} is out of range: config.json gives {self.num_experts} experts")
        n = self.local_inter
        if part == "down":
            check_shape(loaded.shape, (self.hidden_size, n * self.tp_size), f"expert {expert} down projection")
            param.data[expert].copy_(narrow_rank(loaded, 1, self.tp_rank, n))
            return
        check_shape(loaded.shape, (n * self.tp_size, self.hidden_size), f"expert {expert} {part} projection")
        offset = 0 if part == "gate" else n
        param.data[expert, offset : offset + n].copy_(narrow_rank(loaded, 0, self.tp_rank, n))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.moe_route(router_logits, correction_bias=self.e_score_correction_bias, **self.route_args)
        out = self.ops.fused_experts(x, self.w13, self.w2, weights, ids, self.activation)
        return self.comm.all_reduce(out) if self.tp_size > 1 else out


class Router(nn.Module):
    """The gate of an MoE layer: replicated ``weight`` [E, H] in the model dtype; forward(x [T, H]) ->
    router logits [T, E]. With ``logits_dtype`` (e.g. float32, as DeepSeek computes its gate) x is cast
    to it and multiplied with a copy of the weight made in that dtype once after loading; otherwise the
    logits are in the model dtype, as Mixtral and Qwen."""

    def __init__(self, hidden_size: int, num_experts: int, ctx: BuildContext, logits_dtype: torch.dtype | None = None):
        super().__init__()
        self.ops, self.logits_dtype = ctx.ops, logits_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=ctx.dtype, device=ctx.device),
                                   requires_grad=False)
        set_loader(self.weight, default_loader)
        self.cast_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        if self.logits_dtype is not None:
            self.cast_weight = self.weight.data.to(self.logits_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.logits_dtype is None:
            return self.ops.linear(x, self.weight, None)
        return self.ops.linear(x.to(self.logits_dtype), self.cast_weight, None)
