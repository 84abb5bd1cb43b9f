"""The Communicator contract: the collectives tensor and pipeline parallelism need.

It wraps one torch.distributed process group; the device backend names the
process-group backend (``Backend.process_group_backend()``). Launch is
torchrun's business: ``Communicator.from_env`` reads RANK/WORLD_SIZE as torchrun
sets them. With a world of one, every collective returns its input and no
process group is created.
"""

import os
from typing import Protocol

import torch
import torch.distributed as dist

Tensor = torch.Tensor


class FastAllReduce(Protocol):
    """A backend's all-reduce for small messages (contract 1.4, ``Backend.fast_all_reduce``): e.g. one
    shot over buffers every rank of the group maps. Made once per group at start (its buffers are
    allocated then, never per call), so it may run inside captured graphs."""

    max_bytes: int  # the Communicator sends larger messages, and other dtypes, through the process group
    dtypes: frozenset[torch.dtype]

    def __call__(self, x: Tensor) -> None:
        """Sum the contiguous ``x`` over the group's ranks, in place."""

    # Optional (contract 1.5): ``add_rms_norm(x, residual, weight, eps) -> (out, new_residual) | None``, the
    # layer boundary in one pass: the sum of the contiguous ``x`` [T, H] over the ranks, plus ``residual``,
    # then RMSNorm, with the roundings of ``ops.fused_add_rms_norm`` applied to the summed ``x``; returns
    # None for a shape it does not take. Every rank must compute the same sum (ranks in a fixed order).
    # Optional (contract 1.13): ``linear_add(x, weight, bias, residual) -> out | None``, a row-parallel linear
    # with its all-reduce and the residual add in one pass: residual + the sum over the ranks of
    # ``x @ weight.T`` (each rank's product rounded to the dtype, the sum rounded once more; ``bias``, where
    # given, added once after the sum); ``weight`` in the backend's own linear layout; None for a shape it
    # does not take.


class Communicator:
    """Collectives for one group of ranks. Tensors must live on this rank's device."""

    def __init__(self, group: "dist.ProcessGroup | None" = None, world_size: int = 1, rank: int = 0,
                 ranks: "list[int] | None" = None):
        """``rank``: this rank's index in the group; ``ranks``: the group's members as world ranks
        (default: 0..world_size-1, the whole world). ``send``/``recv`` take group indices."""
        self.group, self.world_size, self.rank = group, world_size, rank
        self.ranks = ranks if ranks is not None else list(range(world_size))
        self.fast: FastAllReduce | None = None  # set by use_fast_all_reduce

    def use_fast_all_reduce(self, backend) -> None:
        """Take the backend's small-message all-reduce for this group, where it offers one (a
        collective: every rank of the group calls it at the same point)."""
        if self.world_size > 1:
            self.fast = backend.fast_all_reduce(self)

    @classmethod
    def single(cls) -> "Communicator":
        """A world of one: every collective is the identity."""
        return cls()

    @classmethod
    def from_env(cls, pg_backend: str) -> "Communicator":
        """Join the default process group from torchrun's environment (or stay single)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls.single()
        if not dist.is_initialized():
            dist.init_process_group(backend=pg_backend)
        return cls(dist.group.WORLD, dist.get_world_size(), dist.get_rank())

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum of x over ranks, in place; returns x. x may be a non-contiguous view."""
        if self.world_size == 1:
            return x
        if self._fits(x):
            self.fast(x)
        else:
            self._in_place(x, lambda buf: dist.all_reduce(buf, group=self.group))
        return x

    def all_reduce_add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                ops) -> tuple[Tensor, Tensor]:
        """Contract 1.5, the layer boundary of tensor parallelism: ``ops.fused_add_rms_norm`` of the sum of
        ``x`` over ranks and ``residual``, i.e. (rms_norm(sum(x) + residual) * weight, sum(x) + residual).
        In one pass where the backend's small-message all-reduce offers ``add_rms_norm``; otherwise the
        all-reduce, then the op. ``x`` may be overwritten."""
        fast = self.fast
        fused = getattr(fast, "add_rms_norm", None)
        if fused is not None and self._fits(x):
            out = fused(x, residual, weight, eps)
            if out is not None:
                return out
        return ops.fused_add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def fuses_linear_all_reduce(self) -> bool:
        """Whether the backend's small-message all-reduce offers the row-parallel linear in one pass
        (``linear_add``, contract 1.13): the models' decode-step fusions then take tensor parallelism too."""
        return self.world_size > 1 and callable(getattr(self.fast, "linear_add", None))

    def linear_all_reduce_add(self, x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor,
                              ops) -> Tensor:
        """Contract 1.13, a row-parallel linear ending the residual stream's sublayer: residual + the sum
        over ranks of ``x @ weight.T`` (+ ``bias``, once). In one pass where the backend's small-message
        all-reduce offers ``linear_add`` and takes the shape; otherwise ``ops.linear``, the all-reduce
        and the add. ``x``, ``weight``, ``bias`` and ``residual`` are left unchanged."""
        fused = getattr(self.fast, "linear_add", None)
        if fused is not None and self._fits(residual) and residual.is_contiguous():
            out = fused(x, weight, bias, residual)
            if out is not None:
                return out
        partial = ops.linear(x, weight, bias if self.rank == 0 else None)
        return self.all_reduce(partial) + residual

    def _fits(self, x: Tensor) -> bool:
        fast = self.fast
        return (fast is not None and x.is_contiguous() and x.dtype in fast.dtypes
                and x.numel() * x.element_size() <= fast.max_bytes)

    @staticmethod
    def _in_place(x: Tensor, collective) -> None:
        """Run an in-place collective on x through a contiguous buffer where x is a strided view
        (some process-group backends take contiguous tensors only)."""
        if x.is_contiguous():
            collective(x)
            return
        buf = x.contiguous()
        collective(buf)
        x.copy_(buf)

    def all_gather(self, x: Tensor, dim: int = 0) -> Tensor:
        """Concatenation of every rank's x along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: Tensor, dim: int = 0) -> Tensor:
        """Sum over ranks of x, split along ``dim`` into world_size equal parts; rank r gets part r."""
        if self.world_size == 1:
            return x
        if x.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible by world size {self.world_size}")
        parts = [p.contiguous() for p in x.chunk(self.world_size, dim=dim)]
        out = torch.empty_like(parts[self.rank])
        if self.group is not None and dist.get_backend(self.group) == "gloo":
            # gloo has no reduce_scatter: reduce everything, keep our part.
            total = x.contiguous().clone()
            dist.all_reduce(total, group=self.group)
            return total.chunk(self.world_size, dim=dim)[self.rank].contiguous()
        dist.reduce_scatter(out, parts, group=self.group)
        return out

    def broadcast(self, x: Tensor, src: int = 0) -> Tensor:
        """x from rank ``src`` on every rank, in place; returns x. x may be a non-contiguous view."""
        if self.world_size > 1:
            self._in_place(x, lambda buf: dist.broadcast(buf, src=src, group=self.group))
        return x

    def broadcast_async(self, x: Tensor, src: int = 0) -> "Pending":
        """Start broadcasting the contiguous ``x`` from rank ``src``; ``wait()`` on the result before
        reading ``x`` (on a device with streams, the wait orders the current stream after the transfer
        and returns at once; else it blocks). ``x`` must stay unchanged and alive until then."""
        if self.world_size == 1:
            return Pending(None)
        if not x.is_contiguous():
            raise ValueError("broadcast_async takes a contiguous tensor")
        return Pending(dist.broadcast(x, src=src, group=self.group, async_op=True))

    def send(self, x: Tensor, dst: int) -> None:
        """Send x to the group's rank ``dst`` (blocking)."""
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.group)

    def recv(self, x: Tensor, src: int) -> Tensor:
        """Receive into x from the group's rank ``src`` (blocking); returns x. x may be a non-contiguous view."""
        buf = x if x.is_contiguous() else torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.recv(buf, src=self.ranks[src], group=self.group)
        return x if buf is x else x.copy_(buf)


class Pending:
    """A collective in flight (``Communicator.broadcast_async``): ``wait()`` once before using its
    result; later calls return at once."""

    def __init__(self, work):
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
