"""The engine core's loop, on a scripted transport: a burst of requests reaching an idle engine is
taken in whole before the first step; the gathering stops at a gap, at its time limit, and on "stop"."""

from chitu_core.engine import core
from chitu_core.engine.core import BURST_GAP_S, EngineCore
from chitu_core.engine.engine import EngineStats


class FakeEngine:
    """Counts what each step would schedule; every request is done after one step."""

    def __init__(self):
        self.waiting: list[str] = []
        self.steps: list[list[str]] = []
        self.stats = EngineStats()

    def add_request(self, request_id, ids, params, prompt, priority):
        self.waiting.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def step(self):
        self.steps.append(self.waiting)
        self.waiting = []
        return []


def add(i: int) -> tuple:
    return ("add", f"r{i}", [1, 2], None, None, 0)


def run(script: list, monkeypatch=None) -> tuple[FakeEngine, list]:
    """Each receive() takes the next scripted item (None: nothing came within the timeout)."""
    engine, timeouts, sent = FakeEngine(), [], []

    def receive(timeout):
        timeouts.append(timeout)
        return script.pop(0) if script else ("stop",)

    EngineCore(engine, receive, sent.append).run()
    return engine, timeouts


def test_a_burst_is_gathered_into_one_step():
    # r0 wakes the idle core; nothing else waits (0); r1-r3 come within the gap; a gap; then r4.
    engine, timeouts = run([add(0), None, add(1), add(2), add(3), None, add(4), None, None])
    assert engine.steps == [["r0", "r1", "r2", "r3"], ["r4"]]
    assert timeouts[:6] == [None, 0, BURST_GAP_S, BURST_GAP_S, BURST_GAP_S, BURST_GAP_S]


def test_gathering_stops_at_its_time_limit(monkeypatch):
    clock = iter(range(0, 10_000, 5))  # each look at the clock: 5 ms later
    monkeypatch.setattr(core.time, "monotonic", lambda: next(clock) / 1000)
    engine, _ = run([add(0), None] + [add(i) for i in range(1, 30)] + [None, None])
    # 20 ms of arrivals, then the first step; the rest were waiting by then: the next step takes them.
    assert engine.steps == [[f"r{i}" for i in range(4)], [f"r{i}" for i in range(4, 30)]]


def test_stop_ends_the_loop_while_gathering():
    engine, _ = run([add(0), None, add(1), ("stop",), add(2)])
    assert engine.steps == []
