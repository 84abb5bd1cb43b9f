"""How the ranks of a run are arranged: tensor parallelism inside a pipeline stage, pipeline stages
in order, and a host-side control group every rank joins.

Rank ``r`` of a world of ``tp_size * pp_size`` ranks is tensor-parallel rank ``r % tp_size`` of
pipeline stage ``r // tp_size``: the ranks of one stage are neighbours, so a stage's all-reduces
stay inside a node when nodes hold whole stages. Expert parallelism (``enable_expert_parallel``)
splits a stage's routed experts over that stage's tensor-parallel ranks, so it needs no group of its
own. Launch is torchrun's: ``Parallel.from_env`` reads RANK / WORLD_SIZE as torchrun sets them.
"""

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from chitu_core.distributed.communicator import Communicator
from chitu_core.errors import ChituError

# How long a rank waits for another in a host-side exchange before it calls the run dead.
CONTROL_TIMEOUT = timedelta(seconds=float(os.environ.get("CHITU_CONTROL_TIMEOUT_S", "20")))


@dataclass
class Parallel:
    """This rank's place in the run and the communicators of its groups.

    tp: this stage's tensor-parallel ranks (the communicator layers are built with).
    pp: this rank's pipeline: one rank of each stage, all with this rank's tp_rank, in stage order.
    world: every rank. control: a host-side (gloo) group over every rank for the engine's own
    messages (lockstep commands, sampled tokens), or None in a world of one."""

    tp: Communicator = field(default_factory=Communicator.single)
    pp: Communicator = field(default_factory=Communicator.single)
    world: Communicator = field(default_factory=Communicator.single)
    control: "dist.ProcessGroup | None" = None

    @property
    def tp_size(self) -> int:
        return self.tp.world_size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def pp_size(self) -> int:
        return self.pp.world_size

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 of the world: the one that takes requests and tells the others what to run."""
        return self.world.rank == 0

    @property
    def sampler_rank(self) -> int:
        """The world rank whose sampled tokens every rank takes: tensor-parallel rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    def stage_rank(self, stage: int) -> int:
        """The world rank of this rank's counterpart (same tp_rank) in pipeline stage ``stage``."""
        return stage * self.tp_size + self.tp_rank

    @classmethod
    def single(cls) -> "Parallel":
        return cls()

    @classmethod
    def from_env(cls, pg_backend: str, tensor_parallel_size: int | None = None,
                 pipeline_parallel_size: int = 1) -> "Parallel":
        """Join torchrun's world and split it: ``tensor_parallel_size`` (default: the world size
        over ``pipeline_parallel_size``) ranks a stage, ``pipeline_parallel_size`` stages."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        pp = pipeline_parallel_size
        tp = tensor_parallel_size or max(1, world_size // pp)
        if tp * pp != world_size:
            raise ChituError(
                f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {tp * pp} ranks, but the launch has "
                f"WORLD_SIZE={world_size}; start as many processes as tp x pp (torchrun --nproc-per-node ... "
                "--nnodes ...), or change the sizes")
        if world_size == 1:
            return cls.single()
        world = Communicator.from_env(pg_backend)
        rank = world.rank
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if world_size > 1 else None
        # Every rank must create every group, in the same order, even those it is not in.
        tp_comm = pp_comm = None
        for stage in range(pp):
            ranks = list(range(stage * tp, (stage + 1) * tp))
            group = world.group if tp == world_size else dist.new_group(ranks, backend=pg_backend)
            if rank in ranks:
                tp_comm = Communicator(group, tp, ranks.index(rank))
        for tp_rank in range(tp):
            ranks = [stage * tp + tp_rank for stage in range(pp)]
            group = world.group if pp == world_size else dist.new_group(ranks, backend=pg_backend)
            if rank in ranks:
                pp_comm = Communicator(group, pp, ranks.index(rank), ranks)
        return cls(tp_comm, pp_comm, world, control)
