"""Routed experts held in host memory and run on the CPU backend (``cpu_experts``), for models whose
experts do not fit on the device.

``cpu_experts`` names layers ("all", or indices and ranges such as "0-11,20"); ``parse_cpu_experts``
turns it into layer indices and ``CPUExperts`` carries what a ``FusedMoE`` of such a layer needs: the
CPU backend's op table, whether host staging buffers are page-locked and the device backend's completion
event. Everything else of the layer (router, shared experts) and the rest of the model stay on the
device. The overlap, in ``FusedMoE.forward``: route on the device; queue the copies of the hidden states
and the routing to the host without waiting; queue the shared expert on the device behind them; then,
on the engine's own thread, wait for the copies, run ``fused_experts`` on the CPU while the device
computes the shared expert, copy the result back and add. The host work stays on the engine's thread:
OpenMP thread pools belong to the thread that opens them, and a worker thread's pool beside the
engine's shares the cores with it (on 2 cores, a DeepSeek-V2-Lite-shaped layer's experts took 4.5-5.5
ms on the engine's thread and 6.3-7.3 ms on a worker). Decode graphs cannot hold host work, so an
engine with any such layer runs eagerly.
"""

import logging
from collections.abc import Callable

import torch

from chitu_core.errors import ChituError
from chitu_core.ops.table import Ops

log = logging.getLogger(__name__)


def parse_cpu_experts(spec: str | None, num_layers: int) -> frozenset[int]:
    """``"all"`` -> every layer index; ``"0-11,20"`` -> {0, ..., 11, 20}; None or "" -> none. Ranges are
    inclusive; every index must be below ``num_layers`` (config.json's num_hidden_layers). A layer
    without routed experts (a dense one) may be named and then holds none."""
    if spec is None or not spec.strip():
        return frozenset()
    if spec.strip().lower() == "all":
        return frozenset(range(num_layers))
    layers: set[int] = set()
    for item in spec.split(","):
        bounds = item.strip().split("-")
        if len(bounds) > 2 or not all(b.strip().isdigit() for b in bounds):
            raise ChituError(f"cpu_experts {spec!r}: {item.strip()!r} is not a layer index or a range such as "
                             "'0-11'; expected 'all', or indices and ranges separated by commas ('0-11,20')")
        first, last = int(bounds[0]), int(bounds[-1])
        if first > last:
            raise ChituError(f"cpu_experts {spec!r}: range {item.strip()!r} runs backwards")
        if last >= num_layers:
            raise ChituError(f"cpu_experts {spec!r}: layer {last} is past the model's last layer "
                             f"({num_layers} layers: 0-{num_layers - 1})")
        layers.update(range(first, last + 1))
    return frozenset(layers)


class CPUExperts:
    """What the layers in ``layers`` need to run their routed experts on the host (see the module's note)."""

    def __init__(self, layers: frozenset[int], ops: Ops, pin_memory: bool = False,
                 completion_event: Callable[[], object] = lambda: None):
        self.layers, self.ops = layers, ops
        self.pin_memory, self.completion_event = pin_memory, completion_event

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        """A host copy of device tensor ``x``, queued without waiting (finished once the event
        ``completion_event()`` made after it says so); x itself where it is on the host already."""
        if x.device.type == "cpu":
            return x
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.pin_memory)
        return host.copy_(x, non_blocking=self.pin_memory)


def cpu_experts_for(spec: str | None, num_layers: int, backend) -> CPUExperts | None:
    """The engine's ``CPUExperts`` for config ``cpu_experts`` on device backend ``backend``, or None
    where no layer is named. The CPU backend's ops come from discovery (the chitu-cpu plugin)."""
    layers = parse_cpu_experts(spec, num_layers)
    if not layers:
        return None
    from chitu_core.plugins.discovery import backend_ops, get_backend

    cpu = backend if backend.name == "cpu" else get_backend("cpu")
    log.info("cpu_experts: the routed experts of %d layer(s) stay in host memory and run on the CPU backend; "
             "decode runs eagerly (no graphs)", len(layers))
    return CPUExperts(layers, backend_ops(cpu), backend.pin_memory(), backend.completion_event)
