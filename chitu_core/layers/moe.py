"""Mixture of experts: the routed experts of one layer as stacked tensors, and the router.

``FusedMoE`` holds every routed expert of a layer in one tensor per projection and runs them with
two ops: ``moe_route`` (router logits -> top-k weights and expert ids) and ``fused_experts`` (the
weighted sum of the chosen experts' MLPs), or the op of the quantization method that holds the
experts (contract 1.3: ``QuantMethod.holds_experts``, e.g. ``fused_experts_fp8``). Shared experts are
not part of it: a model composes them from the dense layers (a gated MLP beside the routed experts).

Checkpoints store one tensor per expert and projection (``...experts.{e}.gate_proj.weight``;
Mixtral's ``w1``/``w3``/``w2``), quantized ones with more tensors beside it
(``...experts.{e}.gate_proj.weight_scale_inv``). ``map_expert_weight`` turns such a name into the
stacked parameter and an ``ExpertShard``; a model's ``CausalLM.map_weight_name`` calls it first.

The routed experts of a layer that ``cpu_experts`` names stay in host memory and run on the CPU
backend while the rest of the layer runs on the device (see chitu_core/layers/cpu_experts.py).
"""

import re
from collections.abc import Callable
from math import ceil
from typing import NamedTuple

import torch
from torch import nn

from chitu_core.errors import ModelLoadError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.linear import _divide
from chitu_core.layers.weights import ShapeMismatch, check_shape, default_loader, set_loader
from chitu_core.ops.table import Ops
from chitu_core.quantization import QuantMethod
from chitu_core.quantization.base import UnquantizedMethod
from chitu_core.quantization.params import copy_span, per_tensor_value, stored_span

# Checkpoint projection name -> the part of an expert it is.
GATE_UP_DOWN = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}  # Qwen-MoE, DeepSeek
MIXTRAL_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}

_ROUTED_EXPERTS = re.compile(r"(^|[^_])experts\b")  # an ignore pattern naming routed experts, not shared_experts
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<tensor>\w+)$")


class ExpertShard(NamedTuple):
    """The shard id of one expert's projection in a stacked parameter: part is "gate", "up" or "down"."""

    expert: int
    part: str


def map_expert_weight(name: str, parts: dict[str, str] = GATE_UP_DOWN) -> tuple[str, ExpertShard] | None:
    """``"m.layers.1.mlp.experts.7.up_proj.weight"`` -> ``("m.layers.1.mlp.experts.w13",
    ExpertShard(7, "up"))``; another tensor of the projection keeps its name as a suffix
    (``...experts.7.down_proj.weight_scale_inv`` -> ``...experts.w2_weight_scale_inv``). None for a
    name that is not a routed expert's projection. ``parts`` maps the checkpoint's projection names
    onto gate/up/down."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["proj"] not in parts:
        return None
    part = parts[match["proj"]]
    family = "w2" if part == "down" else "w13"
    param = family if match["tensor"] == "weight" else f"{family}_{match['tensor']}"
    return f"{match['prefix']}.{param}", ExpertShard(int(match["expert"]), part)


def expert_method(ctx: BuildContext, ops: Ops | None = None) -> QuantMethod:
    """The method that holds a MoE layer's experts: the model's where it can hold experts; else
    unquantized where they are left dense (in situ, or where the checkpoint's ignore list names them).
    A checkpoint that stores experts in a format whose method cannot hold them is refused, as is a
    backend whose op table (``ops``, default ``ctx.ops``: the table that will run the experts) lacks a
    quantized method's expert op (only a table that is the reference's throughout, as tools and tests
    build, runs it on the reference; unquantized experts fall back as ``fused_experts`` always has)."""
    ops = ops or ctx.ops
    spec = ctx.quant
    dense = spec.method == "unquantized" or any(_ROUTED_EXPERTS.search(pattern) for pattern in spec.ignored)
    method = UnquantizedMethod() if dense else ctx.new_quant_method()
    if not method.holds_experts:
        if not spec.in_situ:
            raise ModelLoadError(f"quantized MoE experts ({spec.method!r}) are not supported yet; load an "
                                 "unquantized checkpoint, with --quantization to quantize its other linear layers")
        method = UnquantizedMethod()
    if isinstance(method, UnquantizedMethod):  # fused_experts falls back to the reference since contract 1.1
        return method
    missing = [op for op in method.expert_kernels if ops.sources[op].kind == "fallback"]
    backend = _backend_name(ops)
    if missing and backend is not None:
        raise ModelLoadError(f"backend {backend!r} does not run {method.name} MoE experts (its op table lacks "
                             f"{', '.join(missing)}); use another device, or an unquantized checkpoint")
    return method


def _backend_name(ops: Ops) -> str | None:
    """The backend an op table was resolved for, from its native ops; None for the reference's own table."""
    return next((source.origin for source in ops.sources.values() if source.kind == "native"), None)


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer.

    Constructor: ``FusedMoE(num_experts, hidden_size, intermediate_size, ctx, top_k, *, scoring="softmax",
    renormalize=False, num_groups=1, topk_groups=1, group_score="max", scaling=1.0,
    correction_bias=False, activation="silu", layer_idx=None)``. The routing arguments are
    ``ops.moe_route``'s, one to one (see chitu_core/ops/spec.py); ``intermediate_size`` is one expert's
    (e.g. moe_intermediate_size); ``layer_idx`` is the decoder layer's index, which ``cpu_experts`` names.
    With ``correction_bias`` the layer owns ``e_score_correction_bias`` (float32 [E], DeepSeek-V3's),
    replicated on every rank; a checkpoint that stores it under the router (``...gate.e_score_correction_bias``)
    maps it here in the model's ``map_weight_name``.

    Parameters, on the device (I_local = intermediate_size / tp_size), made by ``self.quant_method``
    (``expert_method``): unquantized, in the model dtype,
      ``w13`` [E, 2*I_local, H]: each expert's gate rows, then its up rows;
      ``w2``  [E, H, I_local]: each expert's down projection;
    a quantized method's stacked tensors otherwise (fp8: ``w13``/``w2`` float8_e4m3fn with ``w13_scale``
    and ``w2_scale``), each marked with how one expert's slice splits (``quantization.params``).
    Tensor parallelism splits every expert's intermediate dimension: rank r holds gate and up rows
    [r*I_local, (r+1)*I_local) and the same columns of down; its partial outputs are summed over
    ranks. Every expert lives on every rank; the router is replicated (see ``Router``). With expert
    parallelism (``ctx.expert_parallel``) rank r instead holds E/tp whole experts, [r*E/tp, (r+1)*E/tp)
    (``first_expert``, ``local_experts``): the tokens are on every rank already (attention is
    tensor-parallel), so routing to another rank's expert is a -1 slot here, and the same all-reduce
    sums the ranks' outputs.
    CPU experts (``layer_idx in ctx.cpu_expert_layers``): the parameters above live in host memory
    (``self.host`` is the ``CPUExperts``) and the quantization method runs them with the CPU backend's ops;
    routing, the rest of the layer and its all-reduce stay on the device.
    Loading: shard ids are ``ExpertShard(e, "gate" | "up")`` for the ``w13`` family of parameters and
    ``ExpertShard(e, "down")`` for the ``w2`` family, and each must be loaded once (``load_into`` checks it).
    Each loader has the two halves ``set_loader`` describes: ``local_part`` cuts this rank's share out
    of a whole checkpoint tensor, ``load_local`` copies such a share into place, so that
    ``python -m chitu_core.convert --tp`` pre-shards experts as it does linear layers.

    forward(x [T, H], router_logits [T, E], shared=None) -> [T, H] in x.dtype, plus ``shared()`` where
    given: the caller's shared experts as this rank's partial sum (their down projection unreduced, so
    that one all-reduce sums both), run on the device while CPU experts compute, or on the backend's
    side queue (``ctx.side``, contract 1.8) while the routed experts run. Summed over ranks
    unless ``reduce`` is False."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ctx: BuildContext, top_k: int, *,
                 scoring: str = "softmax", renormalize: bool = False, num_groups: int = 1, topk_groups: int = 1,
                 group_score: str = "max", scaling: float = 1.0, correction_bias: bool = False,
                 activation: str = "silu", layer_idx: int | None = None):
        super().__init__()
        self.ops, self.comm, self.side = ctx.ops, ctx.comm, ctx.side
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        self.num_experts, self.hidden_size = num_experts, hidden_size
        # Expert parallelism: rank r holds whole experts [r*E_local, (r+1)*E_local); else a slice of every one.
        self.expert_parallel = ctx.expert_parallel and ctx.tp_size > 1
        self.split, self.split_rank = (1, 0) if self.expert_parallel else (ctx.tp_size, ctx.tp_rank)
        self.local_experts = _divide(num_experts, ctx.tp_size, "number of routed experts") if self.expert_parallel \
            else num_experts
        self.first_expert = ctx.tp_rank * self.local_experts if self.expert_parallel else 0
        self.local_inter = _divide(intermediate_size, self.split, "moe intermediate_size")
        self.route_args = dict(top_k=top_k, scoring=scoring, renormalize=renormalize, num_groups=num_groups,
                               topk_groups=topk_groups, group_score=group_score, scaling=scaling)
        self.activation = activation
        self.reduce = True  # False: forward returns this rank's partial sum (see RowParallelLinear.reduce)
        if ctx.cpu_experts is not None and layer_idx is None:
            raise ModelLoadError("cpu_experts is set but the model builds its MoE layers without layer_idx, so "
                                 "they cannot tell whether their experts belong on the CPU; pass FusedMoE(layer_idx=i)")
        self.host = ctx.cpu_experts if layer_idx in ctx.cpu_expert_layers else None
        # Not ``quant``: the model's own pass over ``module.quant`` is for linear layers.
        self.quant_method = expert_method(ctx, self.host.ops if self.host else None)
        self.quant_method.create_expert_weights(self, self.local_experts, hidden_size, self.local_inter, ctx.dtype,
                                                torch.device("cpu") if self.host else ctx.device)
        experts = range(self.first_expert, self.first_expert + self.local_experts)
        for name, param in self.named_parameters(recurse=False):
            parts = ("down",) if name.startswith("w2") else ("gate", "up")
            set_loader(param, self.load_expert, tuple(ExpertShard(e, p) for e in experts for p in parts),
                       local_part=self.local_part, load_local=self.load_local)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32, device=ctx.device), requires_grad=False)
            set_loader(self.e_score_correction_bias, default_loader)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShard) -> None:
        """Copy this rank's share of one expert's whole checkpoint tensor into its slice of a ``w13``-
        or ``w2``-family parameter (nothing for an expert another rank holds, under expert parallelism)."""
        self._expert_part(shard_id)  # range check
        if self.holds(shard_id.expert):
            self.load_local(param, self.local_part(param, loaded, shard_id), shard_id)

    def holds(self, expert: int) -> bool:
        """Whether this rank holds (a share of) routed expert ``expert``."""
        return self.first_expert <= expert < self.first_expert + self.local_experts

    def local_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ExpertShard) -> torch.Tensor:
        """This rank's share of one expert's whole gate, up ([I, H] as a weight) or down ([H, I])
        checkpoint tensor: checked against the whole shape, narrowed along the intermediate dimension
        as the parameter's marks say; a 0-d (per-tensor) value as it is."""
        what, along = self._expert_part(shard_id)
        loaded = per_tensor_value(param, loaded)
        if not loaded.dim():
            return loaded
        dim, n = getattr(param, f"{along}_dim", None), self.local_inter
        shape = list(param.shape[1:])
        if dim is not None:
            shape[dim] = ceil(n * self.split / getattr(param, f"{along}_pack", 1))
        check_shape(loaded.shape, tuple(shape), what)
        span = stored_span(param, self.split_rank * n, n, along, what)
        return loaded if span is None else loaded.narrow(dim, *span)

    def load_local(self, param: nn.Parameter, local: torch.Tensor, shard_id: ExpertShard) -> None:
        """Copy ``local_part``'s share into expert ``shard_id.expert``'s slice of ``param``: gate at
        the first I_local rows of a ``w13``-family slice, up after them, down over the whole slice."""
        what, along = self._expert_part(shard_id)
        expert, part = shard_id
        n = self.local_inter
        dst = None if part == "down" else stored_span(param, 0 if part == "gate" else n, n, along, what)
        if not self.holds(expert):
            return
        copy_span(param.data[expert - self.first_expert], per_tensor_value(param, local), getattr(param, f"{along}_dim", None), dst,
                  None, what)

    def _expert_part(self, shard_id: ExpertShard) -> tuple[str, str]:
        """(how errors name the shard, the dimension of the expert's matrix its intermediate size runs along)."""
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ShapeMismatch(f"expert {expert} is out of range: config.json gives {self.num_experts} experts")
        return f"expert {expert} {part} projection", "in" if part == "down" else "out"

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_expert_weights_after_loading(self)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                shared: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        beside = self.host is None and shared is not None and self.side is not None
        extra = self.side.run(shared) if beside else None  # the shared experts beside routing and the routed ones
        weights, ids = self.ops.moe_route(router_logits, correction_bias=self.e_score_correction_bias, **self.route_args)
        if self.expert_parallel:  # slots routed to another rank's experts: -1, which the op skips
            ids = ids - self.first_expert
            ids = torch.where((ids >= 0) & (ids < self.local_experts), ids, -1)
        if self.host is None:
            out = self.quant_method.apply_experts(self, x, weights, ids, self.activation, self.ops)
            if beside:
                self.side.join()
            elif shared is not None:
                extra = shared()
        else:  # the copies are queued first, then the shared experts' work behind them, then the host works
            host = self.host
            inputs = host.to_host(x), host.to_host(weights), host.to_host(ids)
            copied = host.completion_event()
            extra = shared() if shared is not None else None
            out = self._run_on_host(*inputs, copied).to(x.device)
        if extra is not None:
            out = out + extra
        return self.comm.all_reduce(out) if self.reduce and self.tp_size > 1 else out

    def _run_on_host(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, copied) -> torch.Tensor:
        """The experts on the CPU backend, on the engine's thread (its OpenMP pool: a second thread's pool
        would share the cores and slow both), once the copies to the host are done."""
        if copied is not None:
            copied.synchronize()
        with torch.inference_mode():
            return self.quant_method.apply_experts(self, x, weights, ids, self.activation, self.host.ops)


class Router(nn.Module):
    """The gate of an MoE layer: replicated ``weight`` [E, H]; forward(x [T, H]) -> router logits [T, E].
    With ``logits_dtype`` (float32 for DeepSeek, whose reference code and transformers keep the gate's
    weight in float32 whatever the model dtype) the weight is held in that dtype, loaded from the
    checkpoint without rounding, and x is cast to it; otherwise weight and logits are in the model
    dtype, as Mixtral and Qwen."""

    def __init__(self, hidden_size: int, num_experts: int, ctx: BuildContext, logits_dtype: torch.dtype | None = None):
        super().__init__()
        self.ops, self.logits_dtype = ctx.ops, logits_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=logits_dtype or ctx.dtype,
                                               device=ctx.device), requires_grad=False)
        set_loader(self.weight, default_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.logits_dtype is None:
            return self.ops.linear(x, self.weight, None)
        if self.logits_dtype == torch.float32:
            return self.ops.linear_float32(x, self.weight)  # contract 1.11: x widened in the product, no cast first
        return self.ops.linear(x.to(self.logits_dtype), self.weight, None)
