"""Contract 1.8's side queue (``Backend.side_queue``): a MoE layer forks its shared experts onto it and joins
it before summing; the tokens are those of running everything in order. The split-K counters of the side
queue are not the main queue's (two split-K kernels on two streams must never share a counter)."""

import torch

from chitu_core.backend import SideQueue
from chitu_core.kernels.triton.backend import QUEUE
from chitu_core.kernels.triton.split_k import split_counters
from chitu_cpu.backend import CpuBackend
from test_moe_models import PROMPTS, build_moe, greedy, load


class RecordingQueue(SideQueue):
    """Runs the work at once (the CPU has one queue) and records the calls."""

    def __init__(self):
        self.calls: list[str] = []

    def run(self, fn):
        self.calls.append("run")
        return fn()

    def join(self) -> None:
        self.calls.append("join")


def test_backends_have_no_side_queue_unless_they_say_so():
    assert CpuBackend().side_queue() is None


def test_shared_experts_run_on_the_side_queue_with_the_same_tokens(tmp_path, monkeypatch):
    build_moe(tmp_path, "qwen2_moe")  # a shared expert in every sparse layer (2 of 3)
    alone = greedy(load(tmp_path), PROMPTS[:3])
    queue = RecordingQueue()
    monkeypatch.setattr(CpuBackend, "side_queue", lambda self, index=0: queue)
    assert greedy(load(tmp_path), PROMPTS[:3]) == alone
    assert queue.calls and queue.calls == ["run", "join"] * (len(queue.calls) // 2)


def test_split_k_counters_are_per_queue():
    device = torch.device("cpu")
    main = split_counters(device)
    token = QUEUE.set(1)
    try:
        side = split_counters(device)
    finally:
        QUEUE.reset(token)
    assert side is not main and split_counters(device) is main
    assert not side.any() and not main.any()
