"""The Communicator's collectives on two gloo ranks (spawned processes), and the identity of a world of one.

Each rank builds tensors whose values name the rank and the element, so every expected result is
exact. The ranks join through ``Communicator.from_env``, the torchrun path, on a free loopback port.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chitu_core.distributed import Communicator

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_tensor(rank: int, shape=(4, 6), dtype=torch.float32) -> torch.Tensor:
    """Element i of rank r holds 1000 * (r + 1) + i: distinct across ranks and positions."""
    return (torch.arange(shape[0] * shape[1]).reshape(shape) + 1000 * (rank + 1)).to(dtype)


def check_collectives(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    comm = Communicator.from_env("gloo")
    try:
        assert (comm.rank, comm.world_size) == (rank, WORLD)
        everyone = [rank_tensor(r) for r in range(WORLD)]

        for dtype in (torch.float32, torch.int64):
            x = rank_tensor(rank, dtype=dtype)
            out = comm.all_reduce(x)
            assert out is x and torch.equal(out, sum(rank_tensor(r, dtype=dtype) for r in range(WORLD)))
        x = rank_tensor(rank).t()  # in place into a non-contiguous view
        assert comm.all_reduce(x) is x and torch.equal(x, sum(everyone).t())

        for dim in (0, -1, 1):
            out = comm.all_gather(rank_tensor(rank), dim=dim)
            assert torch.equal(out, torch.cat(everyone, dim=dim)), dim
        # A non-contiguous input (a transposed view) gathers its values, not its storage order.
        out = comm.all_gather(rank_tensor(rank).t(), dim=0)
        assert torch.equal(out, torch.cat([t.t() for t in everyone], dim=0))

        total = sum(everyone)
        for dim in (0, -1):
            out = comm.reduce_scatter(rank_tensor(rank), dim=dim)
            assert torch.equal(out, total.chunk(WORLD, dim=dim)[rank]), dim
        with pytest.raises(ValueError, match="not divisible"):
            comm.reduce_scatter(rank_tensor(rank, shape=(3, 6)), dim=0)

        for src in range(WORLD):
            x = rank_tensor(rank)
            out = comm.broadcast(x, src=src)
            assert out is x and torch.equal(x, rank_tensor(src))
        x = rank_tensor(rank).t()
        assert comm.broadcast(x, src=1) is x and torch.equal(x, rank_tensor(1).t())

        # Send/recv both ways: a non-contiguous view sent, then one received into (a column of a buffer).
        if rank == 0:
            comm.send(rank_tensor(0, shape=(6, 4)).t(), dst=1)
            buffer = torch.zeros(3, 7)
            got = comm.recv(buffer[:, 2], src=1)
            assert got.data_ptr() == buffer[:, 2].data_ptr()
            assert torch.equal(buffer[:, 2], -rank_tensor(1, shape=(1, 3))[0])
            assert not buffer[:, [0, 1, 3, 4, 5, 6]].any()
        else:
            got = comm.recv(torch.zeros(4, 6), src=0)
            assert torch.equal(got, rank_tensor(0, shape=(6, 4)).t())
            comm.send(-rank_tensor(1, shape=(1, 3))[0], dst=0)
    finally:
        dist.destroy_process_group()


def test_two_ranks_collectives():
    mp.spawn(check_collectives, args=(free_port(),), nprocs=WORLD, join=True)


def test_world_of_one_returns_inputs_unchanged(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for comm in (Communicator.single(), Communicator.from_env("gloo")):
        assert (comm.rank, comm.world_size, comm.group) == (0, 1, None)
        x = rank_tensor(0)
        before = x.clone()
        assert comm.all_reduce(x) is x
        assert comm.all_gather(x, dim=-1) is x
        assert comm.reduce_scatter(x, dim=0) is x
        assert comm.broadcast(x, src=0) is x
        assert torch.equal(x, before)
    assert not dist.is_initialized()


def test_in_place_collectives_hand_the_group_contiguous_tensors(monkeypatch):
    """NCCL takes contiguous tensors only: an all_reduce or broadcast of a strided view goes through a
    contiguous buffer, and the view gets the result."""
    seen = []

    def fake(op):
        def run(t, *args, **kwargs):
            seen.append((op, t.is_contiguous()))
            t.mul_(2)  # stands for the collective's result
        return run

    monkeypatch.setattr(dist, "all_reduce", fake("all_reduce"))
    monkeypatch.setattr(dist, "broadcast", fake("broadcast"))
    comm = Communicator(group=None, world_size=2, rank=0)
    base = torch.arange(24.0).reshape(4, 6)
    view = base.clone().t()  # [6, 4], not contiguous
    assert comm.all_reduce(view) is view and torch.equal(view, 2 * base.t())
    assert comm.broadcast(view, src=1) is view and torch.equal(view, 4 * base.t())
    dense = base.clone()
    comm.all_reduce(dense)
    assert torch.equal(dense, 2 * base)
    assert seen == [("all_reduce", True), ("broadcast", True), ("all_reduce", True)]


class OnePassBoundary:
    """A backend's small-message all-reduce with the one-pass layer boundary (contract 1.5), standing in
    for two ranks: the sum is the message doubled; shapes of more than four rows it declines (None)."""

    max_bytes, dtypes = 1024, frozenset({torch.float32})

    def __init__(self):
        self.calls = []

    def __call__(self, x):
        self.calls.append(("all_reduce", tuple(x.shape)))
        x.mul_(2)

    def add_rms_norm(self, x, residual, weight, eps):
        self.calls.append(("add_rms_norm", tuple(x.shape)))
        if x.shape[0] > 4:
            return None
        from chitu_core.ops import reference
        return reference.fused_add_rms_norm(2 * x, residual, weight, eps)


@pytest.mark.parametrize("rows,dtype,calls", [
    (2, torch.float32, [("add_rms_norm", (2, 8))]),  # fits: one pass
    (5, torch.float32, [("add_rms_norm", (5, 8)), ("all_reduce", (5, 8))]),  # declined: all-reduce, then the op
    (40, torch.float32, []),  # over max_bytes: the process group, then the op
    (2, torch.float64, []),  # a dtype it does not take
])
def test_the_layer_boundary_takes_the_one_pass_path_where_it_fits(monkeypatch, rows, dtype, calls):
    from chitu_core.ops import reference

    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: t.mul_(2))
    comm = Communicator(group=None, world_size=2, rank=0)
    comm.fast = fast = OnePassBoundary()
    x = torch.randn(rows, 8, dtype=dtype)
    residual, weight = torch.randn(rows, 8, dtype=dtype), torch.rand(8, dtype=dtype)
    want = reference.fused_add_rms_norm(2 * x, residual, weight, 1e-6)
    got = comm.all_reduce_add_rms_norm(x.clone(), residual, weight, 1e-6, reference)
    assert fast.calls == calls
    torch.testing.assert_close(got, want, rtol=0, atol=0)
