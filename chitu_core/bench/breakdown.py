"""``python -m chitu_core.bench profile``: where a decode step's time goes, by the model's modules.

The batch of ``bench offline`` (B random prompts of I token ids, greedy, ignore_eos) runs eagerly, since
module hooks do not fire in replayed graphs, and N decode steps after the first few are profiled with
torch.profiler. Each *site*, a module that holds weights (linears, norms, embeddings, the LM head,
experts) or reads the KV cache (attention), is a named range while it runs, the device waited for at
both ends. A site's time is that of the device kernels that ran inside its range, less those of the
sites nested in it (``attribute_device``); on a backend without
device kernels (the CPU), the host time inside the range, likewise. The sites of every layer add up
under one name (``model.layers.*.mlp.down_proj``). Each row: calls and microseconds a step, the share
of the step's kernel (or host) time, the bytes the site must read a step and the bandwidth that makes.
The bytes are its weights; for attention, the KV its layer holds for the step's contexts; for the input
embedding, the rows of the step's tokens; for routed experts, not known without the routing (left out).
``other_us`` is the time launched outside every site (sampling, the step's inputs). Eager kernels take
as long as replayed ones; the gaps between them do not show here (``bench offline`` gives the step's
wall time).
"""

import argparse
import json
import re
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.profiler import profile, record_function, supported_activities

from chitu_core.bench.offline import random_prompts
from chitu_core.bench.report_kernels import breakdown_lines
from chitu_core.engine.llm import LLM
from chitu_core.layers.attention import Attention
from chitu_core.layers.embedding import LMHead, VocabEmbedding
from chitu_core.layers.mla import MultiHeadLatentAttention
from chitu_core.layers.moe import FusedMoE
from chitu_core.layers.stage import Absent
from chitu_core.sampling.params import SamplingParams

PREFIX = "chitu.site:"
KV_SITES = (Attention, MultiHeadLatentAttention)


def own_bytes(module: nn.Module) -> int:
    """Bytes of the weights a module holds itself (not its children's): parameters and packed buffers."""
    tensors = list(module.parameters(recurse=False))
    tensors += [b for n, b in module.named_buffers(recurse=False) if n.startswith("packed_")]
    return sum(t.numel() * t.element_size() for t in tensors)


def find_sites(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that hold weights or read the KV cache, by their names in ``model``."""
    return {name: m for name, m in model.named_modules()
            if name and not isinstance(m, Absent) and (own_bytes(m) or isinstance(m, KV_SITES))}


def site_group(name: str) -> str:
    """The name shared by the same site of every layer: ``model.layers.7.mlp`` -> ``model.layers.*.mlp``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


class _Ranges:
    """Forward hooks that open a profiler range named after each site while it runs. With ``sync`` (a
    device's), the device is waited for as a range opens and as it closes, so that the kernels a site
    launches also run inside its range: kernels are then attributed by time (``attribute_device``), which
    holds for every launcher (a Triton kernel's launch is no PyTorch operator the profiler could link)."""

    def __init__(self, sites: dict[str, nn.Module], sync=None):
        self.open: dict[int, list] = defaultdict(list)
        self.handles, self.sync = [], sync
        for name, m in sites.items():
            self.handles.append(m.register_forward_pre_hook(self._enter(name)))
            self.handles.append(m.register_forward_hook(self._exit))

    def _enter(self, name: str):
        def hook(module, args):
            if self.sync is not None:
                self.sync()
            r = record_function(PREFIX + name)
            r.__enter__()
            self.open[id(module)].append(r)
        return hook

    def _exit(self, module, args, output):
        if self.sync is not None:
            self.sync()
        self.open[id(module)].pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _own_time(event, device: bool) -> float:
    """Microseconds of an event and its descendants, stopping at nested sites: device kernel time, or
    host time (self time of each operator) where there is no device."""
    own = sum(k.duration for k in event.kernels) if device else event.self_cpu_time_total
    return own + sum(_own_time(c, device) for c in event.cpu_children if not c.name.startswith(PREFIX))


def attribute(events, device: bool) -> tuple[dict[str, list[float]], float]:
    """Per site name, the (own) microseconds of each of its ranges; and the time outside every site."""
    per_site: dict[str, list[float]] = defaultdict(list)
    outside = 0.0
    for e in events:
        if e.name.startswith(PREFIX):
            per_site[e.name[len(PREFIX):]].append(_own_time(e, device))
        elif e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU:
            outside += _own_time(e, device)
    return per_site, outside


def attribute_device(events) -> tuple[dict[str, list[float]], float]:
    """``attribute`` for device kernels, from the profiler's kineto events (``name()``, ``device_type()``,
    ``start_ns()``, ``end_ns()``, ``is_user_annotation()``): each kernel (or copy) belongs to the innermost
    site range whose host interval holds it (``_Ranges`` with ``sync`` runs a site's kernels inside its
    range); one outside every range is ``outside``. Microseconds."""
    host = torch.autograd.DeviceType.CPU
    ranges = sorted(((e.start_ns(), e.end_ns(), e.name()[len(PREFIX):]) for e in events
                     if e.device_type() == host and e.name().startswith(PREFIX)), key=lambda r: (r[0], -r[1]))
    own = [0.0] * len(ranges)
    outside = 0.0
    for e in events:
        if e.device_type() == host or e.is_user_annotation():
            continue
        start, end = e.start_ns(), e.end_ns()
        best = None  # the innermost holding range: the latest-starting one that holds it (ranges nest)
        for i, (lo, hi, _) in enumerate(ranges):
            if lo > start:
                break
            if end <= hi:
                best = i
        if best is None:
            outside += (end - start) / 1e3
        else:
            own[best] += (end - start) / 1e3
    per_site: dict[str, list[float]] = defaultdict(list)
    for (_, _, name), us in zip(ranges, own):
        per_site[name].append(us)
    return per_site, outside


def breakdown(llm: LLM, batch: int, input_len: int, steps: int, warmup_steps: int = 3, seed: int = 0) -> dict[str, Any]:
    """Profile ``steps`` decode steps of a batch on ``llm`` (built with ``enforce_eager``): the table above."""
    engine = llm.engine
    model = engine.model
    prompts = random_prompts(batch, input_len, engine.vocab_size, seed)
    params = SamplingParams(max_tokens=1 + warmup_steps + steps + 2, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(f"profile-{i}", p, params).seqs[0] for i, p in enumerate(prompts)]
    while not all(s.output_token_ids for s in seqs):  # prefill
        engine.step()
    for _ in range(warmup_steps):
        engine.step()
    engine.backend.synchronize(engine.device_index)
    sites = find_sites(model)
    device = engine.device.type != "cpu"
    activities = list(supported_activities())  # the host's, and those of every device torch was built for
    ranges = _Ranges(sites, (lambda: engine.backend.synchronize(engine.device_index)) if device else None)
    contexts = 0
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                contexts += sum(s.num_tokens for s in seqs if not s.is_finished)
                engine.step()
            engine.backend.synchronize(engine.device_index)
    finally:
        ranges.remove()
    while engine.has_unfinished():
        engine.step()
    if device:
        per_site, outside = attribute_device(list(prof.profiler.kineto_results.events()))
    else:
        per_site, outside = attribute(prof.events(), device)
    kv_per_token = engine.attention.bytes_per_block() // engine.attention.block_size  # one layer's cache
    total = sum(sum(v) for v in per_site.values()) + outside
    groups: dict[str, dict[str, Any]] = {}
    for name, times in per_site.items():
        m = sites[name]
        g = groups.setdefault(site_group(name), {"site": site_group(name), "kind": type(m).__name__, "calls": 0,
                                                 "us": 0.0, "bytes": 0})
        g["calls"] += len(times) / steps
        g["us"] += sum(times) / steps
        if isinstance(m, FusedMoE) or g["bytes"] is None:
            g["bytes"] = None  # the routed experts' bytes depend on the routing
        elif isinstance(m, VocabEmbedding) and not isinstance(m, LMHead):  # a lookup, not the head's product
            g["bytes"] += round(len(times) / steps * own_bytes(m) / m.shard * batch)  # the tokens' rows
        else:
            reads = len(times) / steps
            g["bytes"] += round(reads * own_bytes(m) + (kv_per_token * contexts / steps if isinstance(m, KV_SITES) else 0))
    rows = sorted(groups.values(), key=lambda g: -g["us"])
    for g in rows:
        g["share"] = g["us"] / (total / steps) if total else 0.0
        g["gbps"] = g["bytes"] / (g["us"] * 1e3) if g["bytes"] and g["us"] else None
        g["us"], g["calls"] = round(g["us"], 2), round(g["calls"], 2)
    return {"model": llm.config.model, "backend": engine.backend.name, "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": engine.quant.describe(), "batch": batch, "input_len": input_len, "steps": steps,
            "time": "device kernels" if device else "host",
            "step_us": round(total / steps, 2), "other_us": round(outside / steps, 2), "rows": rows}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory or GGUF file")
    parser.add_argument("--device", default="auto", help="backend name, or auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="decode steps profiled")
    parser.add_argument("--quantization", default=None, choices=["fp8", "int8", "int4"],
                        help="quantize a 16-bit (or dummy) model's linears in situ, as bench offline does")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (bench report reads breakdown-*.json)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.input_len < 1 or args.steps < 1:
        raise SystemExit("bench profile: --batch-size, --input-len and --steps must be at least 1")
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format, load_progress=False,
              enforce_eager=True, async_scheduling=False, max_num_seqs=args.batch_size, quantization=args.quantization,
              max_model_len=args.input_len + args.steps + 16)
    result = breakdown(llm, args.batch_size, args.input_len, args.steps)
    print(json.dumps(result, indent=1) if args.json else "\n".join(breakdown_lines(result)))
    return 0
