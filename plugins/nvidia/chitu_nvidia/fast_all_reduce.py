"""The small-message all-reduce (contract 1.4) over torch's symmetric memory: every rank of the group
maps one buffer per dtype of every other rank's (NVLink peer access). Up to ONE_SHOT_BYTES a one-shot
kernel reads all of them and writes the sum; above, up to ``max_bytes``, a two-shot kernel has each rank
sum its share of the message and then gathers the shares; both fenced by the group's signal pads. No
NVLink multicast is used.

Measured with ``scripts/allreduce_bench.py`` (docs/benchmarks/nvidia-h200x2-twoshot.md: on two H200s both
paths beat NCCL at every size up to 8 MB, the largest measured, so ``max_bytes`` defaults to 8 MB);
messages above ``max_bytes`` go through NCCL; ``CHITU_FAST_ALL_REDUCE_MAX_BYTES`` sets it. The layer
boundary (all-reduce + residual add + RMSNorm, contract 1.5) is one Triton kernel of its own over
symmetric memory (``boundary_kernel.py``); ``CHITU_FUSED_BOUNDARY=0`` composes it from the all-reduce
and the norm instead. So is the row-parallel linear at batch 1 with its all-reduce and residual add
(contract 1.13, ``gemv_all_reduce.py``); ``CHITU_FUSED_LINEAR_ALL_REDUCE=0`` leaves it out, and the
models' decode steps then keep the layer boundary.
"""

import logging
import os

import torch

log = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float32)  # torch's one-shot kernel has no float16
ONE_SHOT_BYTES = 512 << 10
MAX_BYTES = int(os.environ.get("CHITU_FAST_ALL_REDUCE_MAX_BYTES", str(8 << 20)))


class SymmetricMemoryAllReduce:
    """One- or two-shot all-reduce of messages up to ``max_bytes`` through buffers made once per dtype."""

    def __init__(self, comm, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = comm.group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required by torch <= 2.11 before a rendezvous, a no-op later
            enable(self.group_name)
        self.max_bytes, self.dtypes = max_bytes, frozenset(DTYPES)
        self.buffers = {}
        for dtype in DTYPES:
            buf = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self.group_name)
            self.buffers[dtype] = buf
        self.boundary = None
        if os.environ.get("CHITU_FUSED_BOUNDARY", "1") != "0":
            from chitu_nvidia.boundary_kernel import LayerBoundary

            self.boundary = LayerBoundary(self.group_name, device, DTYPES, min(max_bytes, ONE_SHOT_BYTES))
        if os.environ.get("CHITU_FUSED_LINEAR_ALL_REDUCE", "1") != "0":
            from chitu_nvidia.gemv_all_reduce import GemvAllReduce

            self.linear_add = GemvAllReduce(self.group_name, device, DTYPES)  # contract 1.13's optional method

    def add_rms_norm(self, x, residual, weight, eps):
        """The layer boundary in one kernel, or None (the Communicator composes it)."""
        return None if self.boundary is None else self.boundary(x, residual, weight, eps)

    def __call__(self, x: torch.Tensor) -> None:
        flat = x.view(-1)
        buf = self.buffers[x.dtype][: flat.numel()]
        if flat.numel() * flat.element_size() <= ONE_SHOT_BYTES:
            flat.copy_(torch.ops.symm_mem.one_shot_all_reduce_copy(buf, flat, "sum", self.group_name))
        else:
            buf.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
            flat.copy_(buf)


def fast_all_reduce(comm, device: torch.device):
    """The group's SymmetricMemoryAllReduce, or None (one log line) where it cannot be made."""
    if os.environ.get("CHITU_FAST_ALL_REDUCE", "1") == "0":
        return None
    try:
        return SymmetricMemoryAllReduce(comm, device)
    except Exception as exc:  # no peer access, an old torch, a group that is not NCCL's
        log.info("the small-message all-reduce is off (%s: %s); NCCL takes every all-reduce", type(exc).__name__, exc)
        return None
