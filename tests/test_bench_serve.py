"""`python -m chitu_core.bench serve` against a real uvicorn server of a tiny model, run as a
subprocess as a user runs it: exact request and token counts, numbers that agree with each
other, the plot, and the errors a user meets (wrong model, no server, missing API key)."""

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from chitu_core.bench.serve import concurrency_list, percentile, token_range
from chitu_core.bench.server_memory import status_mb
from chitu_core.server.app import build_app
from serving import LiveServer, chat_engine

MODEL = "tiny-bench"
KEY = "sk-bench"
I, O, N = 8, 6, 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with chat_engine(tmp_path_factory.mktemp("bench-serve-llama")) as engine:  # vocab 512
        yield engine


@pytest.fixture(scope="module")
def server(llm):
    with LiveServer(build_app(llm, [MODEL])) as live:
        yield live


def bench(url: str, *args: str, model: str = MODEL) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chitu_core.bench", "serve", "--base-url", url, "--model", model, *args],
                          capture_output=True, text=True, timeout=300)


def test_json_report_is_exact_and_consistent(server, tmp_path):
    png = tmp_path / "serve.png"
    done = bench(server.url, "--concurrency", "1,4", "--input-len", str(I), "--output-len", str(O), "--num-prompts", str(N),
                 "--vocab-size", "512", "--json", "--plot", str(png))
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert (r["base_url"], r["endpoint"], r["model"], r["served_models"]) == (server.url, "/v1/completions", MODEL, [MODEL])
    assert (r["input_len"], r["output_len"], r["num_prompts"], r["seed"]) == (I, O, N, 0)
    assert r["server_max_model_len"] == 512 and r["prompt"] == "random token ids in [256, 512)"
    assert [x["concurrency"] for x in r["results"]] == [1, 4]
    for x in r["results"]:
        assert (x["completed"], x["failed"], x["errors"], x["peak_in_flight"]) == (N, 0, [], x["concurrency"])
        assert x["client_processes"] == 1
        assert (x["total_input_tokens"], x["total_output_tokens"]) == (N * I, N * O)
        assert x["output_tokens_from"] == "usage" and x["all_exact_output_len"] is True
        assert x["output_tok_per_s"] * x["duration_s"] == pytest.approx(N * O, rel=1e-3)
        assert x["request_throughput"] * x["duration_s"] == pytest.approx(N, rel=1e-3)
        ttft, tpot, e2e = x["ttft_ms"], x["tpot_ms"], x["e2e_ms"]
        for s in (ttft, tpot, e2e):
            assert 0 < s["median"] <= s["p90"] <= s["p99"]
        # Per request TTFT < e2e, so every percentile of TTFT is below e2e's; and TTFT plus O-1
        # token gaps is the time of the last token, before the stream's end.
        assert all(ttft[k] < e2e[k] for k in ("mean", "median", "p90", "p99"))
        assert ttft["mean"] + (O - 1) * tpot["mean"] <= e2e["mean"] + 0.01
        assert e2e["p99"] <= x["duration_s"] * 1e3 + 0.01
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert struct.unpack(">II", data[16:24]) == (1100, 420)  # IHDR: the figure's 11 x 4.2 inches at 100 dpi


def test_client_processes_share_a_level(server):
    """--client-procs 2: the level's requests split over two client processes that start together;
    the report counts all of them, and the prompts are the same as from one process."""
    done = bench(server.url, "--concurrency", "4", "--input-len", str(I), "--output-len", str(O), "--num-prompts", "6",
                 "--vocab-size", "512", "--client-procs", "2", "--json")
    assert done.returncode == 0, done.stderr
    x = json.loads(done.stdout)["results"][0]
    assert (x["client_processes"], x["completed"], x["failed"]) == (2, 6, 0)
    assert (x["total_input_tokens"], x["total_output_tokens"], x["all_exact_output_len"]) == (6 * I, 6 * O, True)
    assert 2 <= x["peak_in_flight"] <= 4  # two gates of 2
    assert x["output_tok_per_s"] * x["duration_s"] == pytest.approx(6 * O, rel=1e-3)
    assert x["e2e_ms"]["p99"] <= x["duration_s"] * 1e3 + 0.01


def test_warm_up_burst_goes_out_like_the_first_level(server):
    """--warmup 6 --concurrency 3,1: one request alone, then five at the first level's concurrency
    from its two client processes, for min(O, 4) tokens each; reported apart from the levels."""
    done = bench(server.url, "--concurrency", "3,1", "--input-len", str(I), "--output-len", str(O), "--num-prompts", "2",
                 "--vocab-size", "512", "--warmup", "6", "--client-procs", "2", "--json")
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    w = r["warmup_burst"]
    assert (w["concurrency"], w["client_processes"], w["completed"], w["failed"]) == (3, 2, 5, 0)
    assert (w["total_input_tokens"], w["total_output_tokens"], w["all_exact_output_len"]) == (5 * I, 5 * 4, True)
    assert 2 <= w["peak_in_flight"] <= 3
    assert [(x["concurrency"], x["completed"], x["total_output_tokens"]) for x in r["results"]] == [(3, 2, 2 * O), (1, 2, 2 * O)]
    one = json.loads(bench(server.url, "--concurrency", "2", "--input-len", str(I), "--output-len", str(O), "--num-prompts",
                           "2", "--vocab-size", "512", "--json").stdout)
    assert "warmup_burst" not in one and one["warmup"] == 1  # the default: one request alone


def test_chat_endpoint_text_table(server):
    done = bench(server.url + "/v1/", "--endpoint", "chat", "--concurrency", "2", "--input-len", "16", "--output-len", "4",
                 "--num-prompts", "4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"server   {server.url}/v1/chat/completions, model {MODEL}"
    assert lines[1].startswith("requests 4 per level, 16 input -> 4 output tokens, random text of ")
    assert lines[3].split()[:5] == ["conc", "ok", "fail", "in", "tok"]
    row = lines[4].split()
    assert row[:3] == ["2", "4", "0"] and row[-1] == "yes"
    assert float(row[3]) > 0  # the prompts' mean token count, from usage
    assert lines[5].startswith("in tok: mean input tokens per request (usage); output tokens counted from: usage ")


def test_wrong_model_shows_the_servers_404(server):
    done = bench(server.url, "--concurrency", "1", "--num-prompts", "1", "--vocab-size", "512", model="no-such-model")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"error: the warm-up request to {server.url}/v1/completions failed: HTTP 404: ")
    assert "the model 'no-such-model' does not exist; this server serves tiny-bench" in done.stderr


def test_out_of_vocabulary_prompt_ids_say_which_flag_helps(server):
    done = bench(server.url, "--concurrency", "1", "--num-prompts", "1")
    assert done.returncode == 1
    assert "HTTP 400: " in done.stderr and "are outside the vocabulary [0, 512)" in done.stderr
    assert "drawn from [1000, 20000): give --vocab-size for a smaller vocabulary" in done.stderr


def test_server_memory_of_a_process_tree(server, tmp_path):
    # The server here runs in this test's process; the bench itself is a process below it.
    me = os.getpid()
    args = ("--concurrency", "2", "--input-len", str(I), "--output-len", str(O), "--num-prompts", "4", "--vocab-size", "512",
            "--server-pid", str(me))
    done = bench(server.url, *args, "--json")
    assert done.returncode == 0, done.stderr
    mem = json.loads(done.stdout)["server_memory"]
    assert (mem["pid"], mem["interval_s"]) == (me, 0.1) and mem["processes"] >= 2
    mine = mem["rss_mb"][str(me)]
    assert 0 < mine["RssAnon"] <= mine["VmRSS"] <= mine["VmHWM"] <= round(status_mb(me)["VmHWM"], 1)
    assert mine["VmRSS"] <= mem["sampled_peak_mb"] <= mem["peak_mb"]
    text = bench(server.url, *args).stdout
    line = next(x for x in text.splitlines() if x.startswith("server memory"))
    assert line.startswith(f"server memory (pid {me} and the processes below it): peak RSS ")
    (tmp_path / "serve-thread.json").write_text(done.stdout)  # the page: the table, then the memory line
    page = subprocess.run([sys.executable, "-m", "chitu_core.bench", "report", str(tmp_path)], capture_output=True,
                          text=True, check=True).stdout.splitlines()
    row = next(i for i, x in enumerate(page) if x.startswith("| thread | 2 | 1 | 4 of 8/6 |"))
    assert page[row + 1:row + 3] == ["", (
        f"serve-thread: server memory (pid {me} and the processes below it): peak RSS {mem['peak_mb']:.0f} MB (the sum "
        f"of each one's VmHWM, loading included), {mem['sampled_peak_mb']:.0f} MB sampled every 0.1 s during the run, "
        f"{sum(p['VmRSS'] for p in mem['rss_mb'].values()):.0f} MB at the end.")]
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    done = bench(server.url, "--concurrency", "1", "--server-pid", str(gone))
    assert done.returncode == 1 and done.stderr == (f"error: --server-pid {gone}: no such process here (/proc/{gone}/status "
                                                    "cannot be read); give the pid of the server on this machine\n")


def test_unreachable_server_is_a_clear_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = bench(f"http://127.0.0.1:{port}", "--concurrency", "1")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"error: cannot reach the server at http://127.0.0.1:{port}: ConnectError: ")
    assert "Traceback" not in done.stderr


def test_api_key(llm):
    with LiveServer(build_app(llm, [MODEL], api_keys=[KEY])) as live:
        refused = bench(live.url, "--concurrency", "1", "--num-prompts", "1", "--vocab-size", "512")
        ok = bench(live.url, "--concurrency", "1", "--num-prompts", "2", "--output-len", "3", "--vocab-size", "512",
                   "--api-key", KEY, "--json")
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: GET {live.url}/v1/models answered HTTP 401: ")
    assert "missing or invalid API key" in refused.stderr
    assert ok.returncode == 0, ok.stderr
    (level,) = json.loads(ok.stdout)["results"]
    assert (level["completed"], level["total_output_tokens"]) == (2, 6)


def plain_server() -> FastAPI:
    """A bare OpenAI-style server that sends no usage and answers 503 to every third completion."""
    app, calls = FastAPI(), [0]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "plain", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        calls[0] += 1
        if calls[0] % 3 == 0:
            return JSONResponse({"error": {"message": "busy", "type": "server_error"}}, status_code=503)

        async def events():
            for _ in range(body["max_tokens"]):
                yield "data: " + json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": "x"}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_counts_chunks_without_usage_and_reports_failures():
    with LiveServer(plain_server()) as live:
        done = bench(live.url, "--concurrency", "1", "--num-prompts", "6", "--output-len", "5", "--json", model="plain")
    assert done.returncode == 1
    # Calls 1 (the warm-up) to 7: the 3rd and 6th fail, which are measured requests 2 and 5.
    (level,) = json.loads(done.stdout)["results"]
    assert (level["completed"], level["failed"], level["total_output_tokens"]) == (4, 2, 20)
    assert level["output_tokens_from"] == "chunks" and level["all_exact_output_len"] is True
    assert level["total_input_tokens"] is None  # no usage, no prompt token count
    busy = 'HTTP 503: {"error":{"message":"busy","type":"server_error"}}'
    assert level["errors"] == [busy]
    assert done.stderr == f"error: 2 request(s) failed; the first: {busy}\n"


def test_helpers():
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)  # numpy's linear interpolation
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0 and percentile([7.0], 99) == 7.0
    assert token_range(None) == token_range(50_000) == (1000, 20000)
    assert token_range(512) == (256, 512) and token_range(3000) == (1000, 3000)
    assert concurrency_list("1,8,64") == [1, 8, 64]
    for bad in ("1,x", "0,4", ""):
        with pytest.raises(Exception, match="comma-separated integers|at least 1"):
            concurrency_list(bad)
