"""`python -m chitu_core.serve` with no --model: the embedded SmolLM2-135M-Instruct, answering for real."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    env = {**os.environ, "CHITU_CACHE_DIR": str(tmp_path_factory.mktemp("cache")), "CHITU_MAX_NUM_SEQS": "8"}
    cmd = [sys.executable, "-m", "chitu_core.serve", "--device", "cpu", "--dtype", "float32", "--port", str(port),
           "--max-model-len", "2048", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not come up in 240 s")
        time.sleep(0.5)
    yield url, proc
    # Ctrl-C: uvicorn shuts down, then the engine process leaves on "stop", leaking nothing.
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "leaked" not in out, out[-2000:]


def test_on_the_cpu_the_engine_core_runs_in_a_thread_of_the_server(served):
    _, proc = served  # a spawned core would hold a second copy of the runtime and share the same cores
    children = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout
    assert "spawn_main" not in children
    threads = subprocess.run(["ps", "-o", "nlwp=", "-p", str(proc.pid)], capture_output=True, text=True).stdout
    assert int(threads) > 1


def test_the_embedded_default_knows_the_capital_of_france(served):
    client = openai.OpenAI(base_url=served[0] + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    # "Name the capital of France.": every greedy step up to "Paris" leads by 1.38 nats or more. "What is the
    # capital of France?" opens on a near-tie (0.08 nats in transformers-float32 on the dequantized weights), which
    # the bfloat16 products of a machine without AVX-512 resolve to "L'Étoile" instead.
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
                                       messages=[{"role": "user", "content": "Name the capital of France."}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # it ends its answer with the end-of-turn token


def test_help_lists_every_option_with_its_default():
    out = subprocess.run([sys.executable, "-m", "chitu_core.serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--model", "--device", "--dtype", "--host", "--port", "--api-key", "--max-num-seqs",
                 "--max-model-len", "--kv-cache-memory", "--enable-prefix-caching", "--served-model-name"):
        assert flag in out.stdout, flag
    assert "(default: 8000)" in out.stdout and "(default: 127.0.0.1)" in out.stdout
