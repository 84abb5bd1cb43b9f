"""The engine process's command pipe is written by a thread of its own: a caller (the server's event
loop) never waits while the engine, busy in a step, leaves the pipe full."""

import multiprocessing
import threading
import time

from chitu_core.engine.async_engine import CommandPipe


def test_sending_more_than_the_pipe_holds_does_not_wait_for_the_reader():
    reader, writer = multiprocessing.Pipe(duplex=False)
    pipe = CommandPipe(writer, on_broken=lambda exc: None)
    commands = [("add", f"r{i}", list(range(4000)), None, None, 0) for i in range(40)]  # about 400 KB pickled
    sender = threading.Thread(target=lambda: [pipe.send(c) for c in commands + [("stop",)]], daemon=True)
    sender.start()
    sender.join(2)
    blocked = sender.is_alive()  # still sending while the reader has not read a byte
    received = [reader.recv() for _ in range(len(commands) + 1)]
    assert not blocked
    assert received == commands + [("stop",)]  # all of them, in order
    pipe.close()
    assert not pipe._thread.is_alive()


def test_a_broken_pipe_is_reported_once_from_the_writer():
    reader, writer = multiprocessing.Pipe(duplex=False)
    broken, called = [], threading.Event()
    pipe = CommandPipe(writer, on_broken=lambda exc: (broken.append(exc), called.set()))
    reader.close()  # the engine process is gone
    pipe.send(("abort", "r0"))
    assert called.wait(5)
    pipe.send(("abort", "r1"))  # queued; nobody writes any more
    time.sleep(0.1)
    assert len(broken) == 1 and isinstance(broken[0], BrokenPipeError)
    assert not pipe._thread.is_alive()
