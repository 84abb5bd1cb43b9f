"""The driver's lockstep messages: followers get every message whole and in order (commands of any size,
steps with none, heartbeats), and the driver does not wait for them to be taken."""

import time

import torch.distributed as dist
import torch.multiprocessing as mp

from chitu_core.engine.lockstep import Lockstep
from serving import free_port

BIG = list(range(300_000))  # a long prompt: a payload of megabytes
SCRIPT = [  # (commands, step), as the driver applies and flushes them
    ([("add", "a", [1, 2, 3], None, None, 0, True)], True),
    ([], True),
    ([("add", "b", BIG, None, None, 0, True), ("abort", "a")], True),
    ([], False),  # a heartbeat
    ([], True),
    ([("abort", "b")], True),
]
FOLLOWER_DELAY_S = 0.1  # before each receive: a follower busy with its own step


def _lockstep(group) -> Lockstep:
    """The message half of a Lockstep (no engine, no watchdog)."""
    lockstep = Lockstep.__new__(Lockstep)
    lockstep.control, lockstep._pending, lockstep._in_flight = group, [], []
    return lockstep


def _rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    lockstep, flushing = _lockstep(dist.new_group(backend="gloo")), 0.0
    if rank == 0:
        start = time.perf_counter()
        for commands, step in SCRIPT:
            for command in commands:
                lockstep.record(command)
            lockstep.flush(step)
        flushing = time.perf_counter() - start
        lockstep._reap(0)
        assert not lockstep._in_flight
    else:
        for want in SCRIPT:
            time.sleep(FOLLOWER_DELAY_S)
            assert lockstep.receive() == want
    dist.barrier()
    dist.destroy_process_group()
    assert flushing < FOLLOWER_DELAY_S * len(SCRIPT) / 3, f"the driver waited for the follower: {flushing:.3f} s"


def test_followers_get_every_message_in_order_while_the_driver_steps_on():
    mp.spawn(_rank, args=(free_port(),), nprocs=2, join=True)
