"""The byte floor of a decode step: the bytes it must read over the copy bandwidth measured now.

A decode step of B sequences reads every weight it multiplies with (all parameters except
an untied input-embedding table, of which it reads only B rows) and the keys and values of
every sequence's context. Its floor time is those bytes over the device-to-device copy
bandwidth (bytes read plus bytes written per second) measured in the same process run.

Under torchrun every rank has a floor of its own: its weight shard and KV share over the bandwidth
of its own device (the one of its local rank, which its copies and synchronizations must name);
``aggregate_floor`` combines them into the run's.
"""

import statistics
import time
from collections.abc import Callable

import torch

COPY_BYTES = 1 << 30


def copy_bandwidth(device: torch.device, synchronize: Callable[[], None], repeats: int = 10, trials: int = 3) -> float:
    """Bytes per second that a large tensor copy moves on ``device`` (read + write): ``repeats``
    back-to-back copies of COPY_BYTES between two synchronizations, the median of ``trials``."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    rates = []
    for _ in range(trials):
        synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        synchronize()
        rates.append(2 * COPY_BYTES * repeats / (time.perf_counter() - start))
    return statistics.median(rates)


def parameter_count(model) -> int:
    """This rank's weights as numbers, however they are stored: a linear layer or vocabulary table counts
    its [out, in] (packed or quantized ones too, whose tensors hold several numbers an element), a tied
    head nothing more, anything else its elements."""
    from chitu_core.layers.embedding import LMHead, VocabEmbedding
    from chitu_core.layers.linear import LinearBase

    counted, total = set(), 0
    for module in model.modules():
        if isinstance(module, LMHead) and module.tied is not None:
            continue
        if isinstance(module, LinearBase):
            total += module.in_features * module.out_features
        elif isinstance(module, VocabEmbedding):
            total += module.shard * module.hidden_size
        else:
            continue
        counted.update(id(p) for p in module.parameters(recurse=False) if p is not getattr(module, "bias", None))
    return total + sum(p.numel() for p in model.parameters() if id(p) not in counted)


def weight_bytes_read(model) -> int:
    """Bytes of the parameters a decode step multiplies with: all of them but an untied input
    embedding (a tied one is read whole as the LM head), and the buffers of layers a backend packed
    (``packed_*``, contract 1.7)."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    # On a pipeline stage either may be absent (a parameter-less stand-in); a packed head holds buffers.
    head = {id(p) for p in lm_head.parameters()} if isinstance(lm_head, torch.nn.Module) else set()
    seen = {id(p) for p in embed.parameters()} - head if isinstance(embed, torch.nn.Module) else set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    packed = (b for name, b in model.named_buffers() if name.rpartition(".")[2].startswith("packed_"))
    return total + sum(b.numel() * b.element_size() for b in packed)


def decode_kv_bytes(kv_bytes_per_token: int, batch_size: int, input_len: int, output_len: int) -> float:
    """Mean KV bytes a decode step reads: step j (1 <= j < output_len) attends over input_len + j keys
    in each of ``batch_size`` sequences."""
    steps = range(1, output_len)
    if not steps:
        return 0.0
    return kv_bytes_per_token * batch_size * statistics.fmean(input_len + j for j in steps)


class RoutedExperts:
    """The expert weights the decode steps of a MoE model actually read.

    A decode step reads, in each MoE layer, only the experts its tokens were routed to. While this
    recorder is open (a context manager), a forward hook on every ``FusedMoE`` layer repeats the
    layer's routing on its router logits and counts the distinct experts chosen; call it around an
    eager run (hooks do not run inside replayed graphs). ``bytes_per_step(max_tokens)`` is then the
    mean, over the forward passes of at most ``max_tokens`` tokens (decode steps), of the routed
    experts' bytes summed over layers."""

    def __init__(self, model):
        from chitu_core.layers.moe import FusedMoE

        self.layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        self.calls: list[tuple[int, int]] = []  # (tokens, expert bytes read) per layer call
        self._handles = []

    def __bool__(self) -> bool:
        return bool(self.layers)

    def all_expert_bytes(self) -> int:
        """Bytes of every routed expert of every layer (what weight_bytes_read counts for them)."""
        return sum(m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size() for m in self.layers)

    def _hook(self, layer, inputs, _output) -> None:
        _, ids = layer.ops.moe_route(inputs[1], correction_bias=layer.e_score_correction_bias, **layer.route_args)
        hit = int(ids[ids >= 0].unique().numel())
        per_expert = (layer.w13[0].numel() * layer.w13.element_size() + layer.w2[0].numel() * layer.w2.element_size())
        self.calls.append((inputs[0].shape[0], hit * per_expert))

    def __enter__(self) -> "RoutedExperts":
        self._handles = [m.register_forward_hook(self._hook) for m in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def bytes_per_step(self, max_tokens: int) -> float:
        decode = [b for t, b in self.calls if t <= max_tokens]
        return sum(decode) / (len(decode) / len(self.layers)) if decode else 0.0


def gather_floors(parallel, floor: dict) -> list[dict] | None:
    """Under torchrun: every rank's ``floor`` (its own weight shard and KV share over its own
    device's bandwidth), in rank order, on rank 0; None on the other ranks."""
    import torch.distributed as dist

    floors = [None] * parallel.world.world_size if parallel.is_driver else None
    dist.gather_object(floor, floors, dst=0, group=parallel.control)
    return floors


def aggregate_floor(floors: list[dict], batch_size: int, groups: int = 1) -> dict:
    """The run's floor from its ranks' (each with "pp_rank"): the bytes and bandwidths add up; a step
    waits for the slowest rank of each pipeline stage. One group: the batch passes the stages one
    after another. ``groups`` > 1 (a pipeline's decode batch as groups in flight,
    ``chitu_core.distributed.pipeline``): the stages work at once, each reading its weights once per
    group and its KV once per round, and the round in which every group advances a token takes as
    long as the slowest stage."""
    stages: dict[int, float] = {}
    for f in floors:
        ms = f["step_ms"] if groups == 1 else (groups * f["weight_bytes"] + f["kv_bytes_mean"]) / f["copy_gbps"] / 1e6
        stages[f["pp_rank"]] = max(stages.get(f["pp_rank"], 0.0), ms)
    step_ms = sum(stages.values()) if groups == 1 else max(stages.values())
    total = {k: sum(f[k] for f in floors) for k in ("weight_bytes", "kv_bytes_mean", "expert_bytes_all",
                                                    "expert_bytes_routed_mean") if k in floors[0]}
    return {"copy_gbps": round(sum(f["copy_gbps"] for f in floors), 1), **total, "step_ms": round(step_ms, 4),
            "decode_tok_per_s": round(batch_size / (step_ms / 1e3), 3), **({"groups": groups} if groups > 1 else {})}
