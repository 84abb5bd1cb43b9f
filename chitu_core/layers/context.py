"""What layers are built with (BuildContext) and what a forward pass carries (StepContext)."""

from dataclasses import dataclass, field

import torch

from chitu_core.attention.contract import AttentionBackend, AttentionMetadata
from chitu_core.attention.mla import MLAAttentionBackend
from chitu_core.backend import SideQueue
from chitu_core.distributed.communicator import Communicator
from chitu_core.distributed.parallel import Parallel
from chitu_core.layers.cpu_experts import CPUExperts
from chitu_core.ops.table import Ops
from chitu_core.quantization import QuantMethod
from chitu_core.quantization.select import QuantSpec


@dataclass
class BuildContext:
    """Everything a layer needs at construction: the backend's ops and attention, the
    tensor-parallel communicator, the weights' dtype, device and quantization method, and where
    the run's pipeline stages and experts are."""

    ops: Ops
    attention: AttentionBackend | MLAAttentionBackend  # the kind the model's KVGeometry asked for
    comm: Communicator
    dtype: torch.dtype
    device: torch.device
    quant: QuantSpec = field(default_factory=QuantSpec)
    parallel: Parallel | None = None  # the pipeline and expert layout (None: one stage, comm's ranks only)
    expert_parallel: bool = False  # routed experts split whole over the tensor-parallel ranks
    cpu_experts: CPUExperts | None = None  # layers whose routed experts stay in host memory, run on the CPU
    side: SideQueue | None = None  # the backend's second work queue (contract 1.8), for independent work
    fusion_max_tokens: int | None = None  # steps of at most this many tokens take the decode-step fusions (1.9)

    @property
    def cpu_expert_layers(self) -> frozenset[int]:
        return self.cpu_experts.layers if self.cpu_experts is not None else frozenset()

    @property
    def pp_rank(self) -> int:
        return self.parallel.pp_rank if self.parallel is not None else 0

    @property
    def pp_size(self) -> int:
        return self.parallel.pp_size if self.parallel is not None else 1

    @property
    def tp_rank(self) -> int:
        return self.comm.rank

    @property
    def tp_size(self) -> int:
        return self.comm.world_size

    def new_quant_method(self) -> QuantMethod:
        return self.quant.new_method()


@dataclass
class StepContext:
    """One forward step: the attention metadata and every layer's KV-cache tensor."""

    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]
