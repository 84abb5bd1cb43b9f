"""Contract 1.4's small-message all-reduce: the Communicator sends a message to the backend's
FastAllReduce when it is contiguous, of a dtype it takes and no larger than its max_bytes, and to the
process group otherwise; a backend without the method (contract 1.3) keeps the process group."""

import torch
import torch.distributed as dist

from chitu_core.distributed import Communicator


class Recording:
    """Doubles its input (a stand-in for the sum over two ranks) and records the sizes it took."""

    max_bytes, dtypes = 64, frozenset({torch.bfloat16, torch.float32})

    def __init__(self):
        self.calls = []

    def __call__(self, x):
        self.calls.append(x.numel() * x.element_size())
        x.mul_(2)


class Offering:
    def fast_all_reduce(self, comm):
        return Recording()


def test_small_contiguous_messages_take_the_fast_path_and_the_rest_the_process_group(monkeypatch):
    group_calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda buf, group=None: (group_calls.append(buf.numel()), buf.mul_(3)))
    comm = Communicator(None, 2, 0)
    comm.use_fast_all_reduce(Offering())
    x = torch.ones(16)  # 64 bytes: the limit
    assert comm.all_reduce(x) is x and torch.equal(x, torch.full((16,), 2.0))
    y = torch.ones(17)  # 68 bytes
    comm.all_reduce(y)
    assert torch.equal(y, torch.full((17,), 3.0))
    z = torch.ones(4, 2).t()  # small but a strided view: the process group, through a contiguous copy
    comm.all_reduce(z)
    assert torch.equal(z, torch.full((2, 4), 3.0))
    h = torch.ones(8, dtype=torch.float16)  # a dtype it does not take
    comm.all_reduce(h)
    assert torch.equal(h, torch.full((8,), 3.0, dtype=torch.float16))
    b = torch.ones(32, dtype=torch.bfloat16)  # 64 bytes of bf16
    comm.all_reduce(b)
    assert comm.fast.calls == [64, 64] and group_calls == [17, 8, 8]


def test_a_world_of_one_asks_nothing_and_a_backend_without_the_method_keeps_the_process_group():
    one = Communicator.single()
    one.use_fast_all_reduce(Offering())
    assert one.fast is None
    two = Communicator(None, 2, 0)
    from chitu_cpu.backend import CpuBackend  # it declares no fast_all_reduce: the base's default answers

    assert "fast_all_reduce" not in vars(CpuBackend)
    two.use_fast_all_reduce(CpuBackend())
    assert two.fast is None
