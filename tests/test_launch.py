"""Serving and benchmarking under torchrun, on CPU and gloo, with real processes: rank 0 serves and the
others step with it, on one node or two (loopback); a rank that dies ends the run with one clear
line, from the server or from a follower; a rank stuck while a peer hangs is ended by its watchdog;
the offline bench reports every rank's floor; two pipeline stages serve a burst of concurrent requests as one
process does. First, in one process: what the driver mirrors, and
that replaying it reproduces the driver's tokens."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from builders import build_chat_model
from chitu_core import SamplingParams
from chitu_core.config import EngineConfig
from chitu_core.engine.core import EngineCore
from chitu_core.engine.engine import LLMEngine
from chitu_core.engine.lockstep import apply
from chitu_core.server.app import build_app
from serving import LiveServer, cpu_engine, free_port, wait_healthy

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SERVE = ["-m", "chitu_core.serve", "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2"]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch-llama")
    build_chat_model(path)
    return path


class Recorder:
    """The driver's side of a Lockstep, in one process: keeps the messages it would broadcast."""

    def __init__(self):
        self.messages: list[tuple[list[tuple], bool]] = []
        self.pending: list[tuple] = []

    def record(self, command: tuple) -> None:
        self.pending.append(command)

    def flush(self, step: bool) -> None:
        self.messages.append((self.pending, step))
        self.pending = []

    def stop(self) -> None:
        self.record(("stop",))
        self.flush(step=False)


def test_a_follower_replaying_the_drivers_messages_samples_the_same_tokens(tiny_llama):
    """The driver mirrors every add (the rejected one too, with its verdict) and abort before the step
    that follows, a heartbeat while idle, and the stop; an engine that replays them samples the same
    tokens, unseeded requests included (their seeds come from the engine's seed in arrival order)."""
    config = EngineConfig(model=str(tiny_llama[0]), device="cpu", dtype="float32", load_progress=False)
    driver, follower, recorder = LLMEngine(config), LLMEngine(config), Recorder()
    sampled = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    script = [None, ("add", "a", [5, 6, 7], sampled, None, 0), ("add", "bad", [10**6], sampled, None, 0),
              ("add", "b", [8, 9], sampled, None, 0), ("abort", "nobody")]
    driven: dict[str, list[int]] = {}

    def receive(timeout):
        return script.pop(0) if script else None if driver.has_unfinished() else ("stop",)

    def send(message):
        for out in message[1] if message[0] == "outputs" else []:
            driven.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)

    EngineCore(driver, receive, send, recorder).run()
    heartbeat, first, *steps, stop = recorder.messages
    assert heartbeat == ([], False) and stop == ([("stop",)], False)
    *adds, abort = first[0]
    assert [(c[1], c[-1]) for c in adds] == [("a", True), ("bad", False), ("b", True)] and abort == ("abort", "nobody")
    assert first[1] and all(message == ([], True) for message in steps)

    replayed: dict[str, list[int]] = {}
    for commands, step in recorder.messages[:-1]:
        for command in commands:
            apply(follower, command)
        for out in follower.step() if step else []:
            replayed.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert replayed == driven and len(driven["a"]) == len(driven["b"]) == 6


class Launch:
    """torchrun invocations whose every process (workers, engine cores) carries a marker in its
    environment, so that all of them can be found, and killed at the end, even once orphaned."""

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.marker = tmp_path, f"chitu-launch-{uuid.uuid4().hex}"
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
        log_path = self.tmp_path / f"torchrun-{len(self.procs)}.log"
        env = {**os.environ, "CHITU_LOAD_PROGRESS": "false", "CHITU_TEST_LAUNCH": self.marker, **(env or {})}
        with open(log_path, "w") as log:
            proc = subprocess.Popen([*TORCHRUN, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append((proc, log_path))
        return proc, log_path

    def pids(self) -> list[tuple[int, dict, str]]:
        """(pid, environment, command line) of every live process of this launch."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                if f"CHITU_TEST_LAUNCH={self.marker}".encode() in environ:
                    env = dict(e.decode().split("=", 1) for e in environ if b"=" in e)
                    found.append((int(entry.name), env, (entry / "cmdline").read_bytes().decode()))
            except (OSError, ValueError):
                continue
        return found

    def worker(self, rank: int) -> int:
        """The pid of the process torchrun started for ``rank`` (not an engine core it spawned)."""
        agents = {proc.pid for proc, _ in self.procs}
        [pid] = [pid for pid, env, _ in self.pids() if env.get("RANK") == str(rank) and parent(pid) in agents]
        return pid

    def kill_all(self) -> None:
        for pid, _, _ in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc, _ in self.procs:
            proc.wait(timeout=30)


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@contextmanager
def launch(tmp_path: Path):
    runs = Launch(tmp_path)
    try:
        yield runs
    finally:
        runs.kill_all()


def chat(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
    text = client.chat.completions.create(model=model, **CHAT, extra_body={"ignore_eos": True}).choices[0].message.content
    assert text
    return text


def error_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("ERROR")]


def one_process_text(model_path: Path) -> str:
    with cpu_engine(model_path) as llm, LiveServer(build_app(llm, [model_path.stem])) as live:
        return chat(live.url, model_path.stem)


@pytest.mark.parametrize("placement", ["--engine-process", "--no-engine-process"])
def test_tp2_serves_as_one_process_does_and_ends_when_rank_1_dies(model_path, tmp_path, placement):
    """(a) rank 0 serves what a one-process server would; (c) SIGKILL of rank 1 ends the server
    within 30 s, exit status non-zero, with one ERROR line naming rank 1: the server's where the engine
    core runs in a process of its own (the default on devices), the core's where it runs in a thread
    (the CPU's default), since rank 0's watchdog then ends the process itself."""
    expected = one_process_text(model_path)
    port = free_port()
    logger = "chitu_core.serve" if placement == "--engine-process" else "chitu_core.engine.async_engine"
    with launch(tmp_path) as runs:
        proc, log = runs.start("--nproc-per-node", "2", "--master-port", str(free_port()), *SERVE,
                               "--model", str(model_path), "--port", str(port), placement)
        wait_healthy(port, [(proc, log)])
        assert chat(f"http://127.0.0.1:{port}", model_path.stem) == expected
        assert "INFO chitu_core.engine.lockstep[rank 1]: rank 1 of 2 follows the driver" in log.read_text()
        rank1 = runs.worker(1)
        os.kill(rank1, signal.SIGKILL)
        start = time.monotonic()
        assert proc.wait(timeout=30) != 0
        assert time.monotonic() - start < 30
        assert error_lines(log) == [(f"ERROR {logger}: exiting: the engine failed: rank 1, pid {rank1} on "
                                     f"{socket.gethostname()}, stopped: its connection closed")]
        assert "exitcode  : 1 " in log.read_text()  # rank 0's own status, in torchrun's summary


def completions(url: str, model: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy completions of ``prompts`` (token ids), all in flight at once; each one's tokens."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)

    def one(prompt):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=1,
                                        extra_body={"ignore_eos": True})
        return out.choices[0].logprobs.tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_pp2_serves_a_burst_as_one_process_does(model_path, tmp_path):
    """Two pipeline stages under torchrun take 20 concurrent requests: a decode batch of 16 and more runs
    as two groups in flight, their tokens broadcast from the last stage without waiting, while rank 1
    follows the driver's steps; every request gets one process's tokens."""
    prompts = [[(7 * i + 3 * j) % 500 + 2 for j in range(3 + i % 7)] for i in range(20)]
    with cpu_engine(model_path) as llm, LiveServer(build_app(llm, [model_path.stem])) as live:
        expected = completions(live.url, model_path.stem, prompts)
    port = free_port()
    serve = [arg if arg != "--tensor-parallel-size" else "--pipeline-parallel-size" for arg in SERVE]
    with launch(tmp_path) as runs:
        proc, log = runs.start("--nproc-per-node", "2", "--master-port", str(free_port()), *serve,
                               "--model", str(model_path), "--port", str(port))
        wait_healthy(port, [(proc, log)])
        assert completions(f"http://127.0.0.1:{port}", model_path.stem, prompts) == expected
        assert "rank 1 of 2 follows the driver" in log.read_text()


def test_two_nodes_serve_and_the_follower_ends_with_the_driver(model_path, tmp_path):
    """(b) two torchrun invocations (c10d rendezvous on loopback) serve a chat completion; (d) when
    the driver dies (its worker and engine core), the follower exits non-zero, saying why."""
    port, rdzv = free_port(), f"127.0.0.1:{free_port()}"
    with launch(tmp_path) as runs:
        nodes = [runs.start("--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", rdzv, *SERVE, "--model", str(model_path), "--port", str(port))
                 for n in range(2)]
        wait_healthy(port, nodes)
        chat(f"http://127.0.0.1:{port}", model_path.stem)
        follower_log = next(log for _, log in nodes if "follows the driver" in log.read_text())
        follower = next(proc for proc, log in nodes if log == follower_log)
        os.killpg(runs.worker(0), signal.SIGKILL)  # torchrun made it a session leader: this kills its engine core too
        assert follower.wait(timeout=30) != 0
        [line] = error_lines(follower_log)
        assert line.startswith("ERROR chitu_core.engine.lockstep[rank 1]: exiting: rank 0 (the driver), pid ")
        assert line.endswith(f"on {socket.gethostname()}, stopped: its connection closed")


STUCK = """
import logging, os, signal, threading
import torch.distributed as dist
from chitu_core.distributed.watchdog import Watchdog
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
dist.init_process_group("gloo")
group = dist.new_group(backend="gloo")
peers = [f"pid {pid}" for pid in range(dist.get_world_size())]
Watchdog(group, dist.get_rank(), peers, lambda reason: logging.error("exiting: %s", reason)).start()
print(f"rank {dist.get_rank()} watching", flush=True)
threading.Event().wait()  # as stuck as a rank in a device collective with a dead peer
"""


def test_watchdog_ends_a_stuck_rank_when_a_peer_hangs(tmp_path):
    """A rank whose main thread never returns (stuck in a collective) is ended by its watchdog, with
    status 1, when a peer stops answering: here rank 1 is stopped (SIGSTOP), so it is found by time.
    (torchrun itself then waits 30 s for the stopped rank before it kills it: not waited for here.)"""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    with launch(tmp_path) as runs:
        proc, log = runs.start("--nproc-per-node", "2", "--master-port", str(free_port()), str(script),
                               env={"CHITU_CONTROL_TIMEOUT_S": "2"})
        deadline = time.monotonic() + 60
        while log.read_text().count("watching") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        rank0, rank1 = runs.worker(0), runs.worker(1)
        os.kill(rank1, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while rank0 in [pid for pid, _, _ in runs.pids()]:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(0.5)
        assert f"Sending process {rank1} closing signal SIGTERM" in log.read_text()  # torchrun saw rank 0 fail
        assert error_lines(log) == [("ERROR root: exiting: rank 1, pid 1, did not answer for 2 s (CHITU_CONTROL_TIMEOUT_S): "
                                     "hung, or its host is gone")]


def test_bench_offline_reports_every_ranks_floor(model_path, tmp_path):
    """Under torchrun only rank 0 prints; each rank measured its own shard on its own device."""
    with launch(tmp_path) as runs:
        proc, log = runs.start("--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "chitu_core.bench",
                               "offline", "--model", str(model_path), "--device", "cpu", "--dtype", "float32",
                               "--tensor-parallel-size", "2", "--batch-size", "2", "--input-len", "6", "--output-len",
                               "5", "--warmup", "0", "--json")
        assert proc.wait(timeout=300) == 0, log.read_text()
    [line] = [line for line in log.read_text().splitlines() if line.startswith("{")]
    r = json.loads(line)
    ranks, f = r["floor_ranks"], r["floor"]
    assert [(g["rank"], g["tp_rank"], g["pp_rank"]) for g in ranks] == [(0, 0, 0), (1, 1, 0)]
    assert all(g["copy_gbps"] > 0 for g in ranks)
    assert ranks[0]["weight_bytes"] == ranks[1]["weight_bytes"] and ranks[0]["kv_bytes_mean"] == ranks[1]["kv_bytes_mean"]
    assert f["weight_bytes"] == 2 * ranks[0]["weight_bytes"] and f["kv_bytes_mean"] == 2 * ranks[0]["kv_bytes_mean"]
    assert f["step_ms"] == max(g["step_ms"] for g in ranks)  # one stage: the slower rank sets the step
