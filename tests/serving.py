"""A real uvicorn server on 127.0.0.1 (a free port) in a thread, free ports for servers in subprocesses, and a CPU
engine to serve, for tests."""

import asyncio
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from chitu_core.config import EngineConfig
from chitu_core.engine.async_engine import AsyncLLM


@contextmanager
def cpu_engine(path, **options) -> Iterator[AsyncLLM]:
    """An AsyncLLM (engine core in a thread) on the model at ``path``, on the CPU in float32; shut down on exit."""
    engine = AsyncLLM(EngineConfig(model=str(path), device="cpu", dtype="float32", load_progress=False, **options))
    try:
        yield engine
    finally:
        asyncio.run(engine.shutdown())


@contextmanager
def chat_engine(path, **options) -> Iterator[AsyncLLM]:
    """``cpu_engine`` on a tiny random chat model (``builders.build_chat_model``, vocab 512) made at ``path``."""
    from builders import build_chat_model

    build_chat_model(path)
    with cpu_engine(path, **options) as engine:
        yield engine


class LiveServer:
    def __init__(self, app):
        # log_config=None: uvicorn leaves logging alone, so its records reach pytest's caplog.
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", log_config=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def free_port() -> int:
    """A port nothing listens on now, for a server started in a subprocess: below the system's ephemeral range
    and not handed out before in this process. A port the OS picked (bind to 0) returns to that range once
    the probe closes, and a socket another process opens meanwhile (gloo's, a client's) could be given it
    before the server binds it: a two-rank serve test once failed so ("address already in use")."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = random.randrange(max(1024, low - 16384), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port below {low} after 1000 tries")


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the range the OS picks ephemeral ports from (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_healthy(port: int, procs, timeout: float = 120) -> None:
    """Wait for http://127.0.0.1:port/health to answer 200, while every (subprocess, its log path) of
    ``procs`` still runs; a process that exits, or the timeout, fails the test with that log."""
    deadline = time.monotonic() + timeout
    while True:
        for proc, log in procs:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
