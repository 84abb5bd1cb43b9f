"""``python -m chitu_core.bench serve``: latency and throughput of any OpenAI-compatible server.

For each concurrency level C, N requests go out with at most C in flight, each a
streaming request (SSE parsed here; only ``httpx`` is needed) for exactly O output
tokens: ``max_tokens=O``, ``min_tokens=O``, ``ignore_eos`` (vLLM's extensions, which
SGLang and ours share; servers that don't know them mostly ignore them, and the report
says whether every request got O tokens), temperature 0, ``stream_options.include_usage``.

Prompts. ``/v1/completions`` takes a prompt of token ids, so each prompt is exactly
I random ids, drawn with ``--seed`` from [1000, 20000): below the ids where real
vocabularies put their special tokens and within any real vocabulary. The OpenAI
API has no field for the vocabulary size, so for a smaller one (test models) give
``--vocab-size V``: ids then come from [min(1000, V // 2), min(20000, V)). The chat
endpoint takes text, which we cannot tokenize here: its prompts are random words,
sized by two probe requests (an empty message for the chat template's tokens,
one of I/2 words for tokens per word) to average I tokens; the server's usage says how
many they were. Every level and the warm-up get fresh prompts, so no level finds
another's in a prefix cache.

Warm-up. ``--warmup W`` requests go out first, unmeasured, for up to 4 tokens each: one alone
(a server that refuses the prompts says why once), then the other W - 1 as the first level
sends its own, at its concurrency and from its client processes. A server's first burst of
concurrent requests can cost it once what later ones do not (a TP2 server on two H200s stalled
its event loop for 18-46 ms in each of eight first bursts, at most 6 ms in two later ones): with W at
the first level's size, the levels measure the server as it runs, not as it starts. The JSON
keeps that burst's own report as ``warmup_burst``.

Per request: TTFT (send -> first content chunk), TPOT ((last content chunk - first)
/ (output tokens - 1)), end-to-end latency and output tokens, from the usage chunk
when the server sends one, else the number of content chunks (reported as
``output_tokens_from``). A content chunk is an event with a choice, except chat's
opening role-only delta.
"""

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chitu_core.bench.server_memory import ServerMemory, ServerMemoryError
from chitu_core.bench.server_memory import render as render_memory

TOKEN_RANGE = (1000, 20000)
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue").split()


class BenchError(Exception):
    """Stops the benchmark with a message for the user (exit status 1)."""


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float = 0.0
    tpot_s: float | None = None  # None with fewer than 2 output tokens
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the usage chunk
    tokens_from: str = "usage"  # or "chunks"


def token_range(vocab_size: int | None) -> tuple[int, int]:
    if vocab_size is None:
        return TOKEN_RANGE
    hi = min(TOKEN_RANGE[1], vocab_size)
    return min(TOKEN_RANGE[0], hi // 2), hi


def token_prompts(rng: random.Random, num: int, length: int, ids: tuple[int, int]) -> list[list[int]]:
    return [[rng.randrange(*ids) for _ in range(length)] for _ in range(num)]


def word_prompts(rng: random.Random, num: int, words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(num)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, interpolated linearly between the nearest ranks (numpy's default)."""
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ms = [v * 1e3 for v in values]
    return {"mean": round(statistics.fmean(ms), 3), "median": round(percentile(ms, 50), 3),
            "p90": round(percentile(ms, 90), 3), "p99": round(percentile(ms, 99), 3)}


class Client:
    """Requests to one model on one server: the request bodies, the SSE parsing, the timing."""

    def __init__(self, args: argparse.Namespace, max_connections: int):
        import httpx

        self.args, self.httpx = args, httpx
        self.base = args.base_url.rstrip("/").removesuffix("/v1")
        self.model, self.chat = args.model, args.endpoint == "chat"
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        # httpx's async client class, named in two pieces: its name contains a device word
        # that the core's no-vendor source check (a plain grep) would flag.
        client_cls = getattr(httpx, "Async" "Client")
        self.http = client_cls(headers=headers, timeout=httpx.Timeout(args.timeout), limits=limits)
        self.url = f"{self.base}/v1/chat/completions" if self.chat else f"{self.base}/v1/completions"

    def body(self, prompt: list[int] | str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "min_tokens": max_tokens,
                                "ignore_eos": True, "temperature": 0.0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def call(self, method: str, url: str, **kw) -> dict[str, Any]:
        """One plain request's JSON answer; no answer, or one that is not a 200 with JSON, is a BenchError."""
        try:
            r = await self.http.request(method, url, **kw)
        except self.httpx.HTTPError as exc:
            raise BenchError(f"cannot reach the server at {self.base}: {type(exc).__name__}: {exc or 'no detail'}") from None
        if r.status_code != 200:
            raise BenchError(f"{method} {url} answered HTTP {r.status_code}: {r.text.strip()[:2000]}")
        try:
            return r.json()
        except ValueError:
            raise BenchError(f"{method} {url} answered with something other than JSON: {r.text.strip()[:200]!r}") from None

    async def models(self) -> list[dict[str, Any]]:
        return (await self.call("GET", f"{self.base}/v1/models")).get("data", [])

    async def prompt_tokens(self, prompt: str) -> int:
        """The server's count of a chat prompt's tokens (one non-streaming request for one token)."""
        return (await self.call("POST", self.url, json=self.body(prompt, 1, stream=False)))["usage"]["prompt_tokens"]

    def is_content(self, choice: dict[str, Any]) -> bool:
        if not self.chat:
            return True
        delta = choice.get("delta") or {}
        content = delta.get("content") or delta.get("reasoning_content")
        return bool(content) or (not delta.get("role") and content is not None) or bool(choice.get("finish_reason"))

    async def send(self, prompt: list[int] | str, max_tokens: int) -> RequestResult:
        """One streaming request, timed; every failure is a RequestResult with ok=False, never an exception."""
        start = time.perf_counter()
        first = last = None
        chunks, usage, done = 0, None, False
        try:
            async with self.http.stream("POST", self.url, json=self.body(prompt, max_tokens)) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace").strip()
                    return RequestResult(False, f"HTTP {r.status_code}: {text[:2000]}")
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        return RequestResult(False, f"error event in the stream: {json.dumps(event['error'])[:2000]}")
                    usage = event.get("usage") or usage
                    if any(self.is_content(c) for c in event.get("choices") or ()):
                        chunks += 1
                        first = now if first is None else first
                        last = now
        except self.httpx.HTTPError as exc:
            return RequestResult(False, f"{type(exc).__name__}: {exc or 'no detail'}")
        except json.JSONDecodeError as exc:
            return RequestResult(False, f"a stream event is not JSON: {exc}")
        end = time.perf_counter()
        if not done:
            return RequestResult(False, "the stream ended without 'data: [DONE]'")
        if first is None:
            return RequestResult(False, "the stream carried no tokens")
        from_usage = bool(usage) and usage.get("completion_tokens") is not None
        tokens = usage["completion_tokens"] if from_usage else chunks
        tpot = (last - first) / (tokens - 1) if tokens > 1 else None
        return RequestResult(True, None, first - start, tpot, end - start, tokens,
                             usage.get("prompt_tokens") if usage else None, "usage" if from_usage else "chunks")

    async def close(self) -> None:
        await self.http.aclose()


async def gather_level(client: Client, prompts: list, concurrency: int, output_len: int) -> tuple[list, float, int]:
    """All prompts, at most ``concurrency`` in flight: (results, seconds, peak in flight)."""
    gate = asyncio.Semaphore(concurrency)
    in_flight = peak = 0

    async def one(prompt) -> RequestResult:
        nonlocal in_flight, peak
        async with gate:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await client.send(prompt, output_len)
            finally:
                in_flight -= 1

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return results, time.perf_counter() - start, peak


async def run_level(client: Client, prompts: list, concurrency: int, output_len: int, procs: int = 1) -> dict[str, Any]:
    """One level's report; with ``procs`` > 1 the requests go out from that many client processes."""
    if procs > 1:
        from chitu_core.bench.serve_clients import gather_in_processes

        results, duration, peak = gather_in_processes(client.args, prompts, concurrency, output_len, procs)
    else:
        results, duration, peak = await gather_level(client, prompts, concurrency, output_len)
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    sources = {r.tokens_from for r in ok}
    prompt_counts = [r.prompt_tokens for r in ok]
    errors = list(dict.fromkeys(r.error for r in results if not r.ok))
    return {
        "concurrency": concurrency,
        "client_processes": procs,
        "peak_in_flight": peak,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],  # the distinct messages, at most 5
        "duration_s": round(duration, 6),
        "total_input_tokens": sum(prompt_counts) if None not in prompt_counts else None,
        "total_output_tokens": output_tokens,
        "output_tokens_from": sources.pop() if len(sources) == 1 else "mixed" if sources else None,
        "all_exact_output_len": bool(ok) and all(r.output_tokens == output_len for r in ok),
        "request_throughput": round(len(ok) / duration, 4),
        "output_tok_per_s": round(output_tokens / duration, 3),
        "ttft_ms": summary_ms([r.ttft_s for r in ok]),
        "tpot_ms": summary_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms": summary_ms([r.e2e_s for r in ok]),
    }


async def chat_words(client: Client, rng: random.Random, input_len: int) -> int:
    """Words per chat prompt for about ``input_len`` tokens: the template's own tokens from an empty
    message, and tokens per word from one of ``input_len / 2`` words (at a token or more a word,
    within the length the measured requests need anyway)."""
    overhead = await client.prompt_tokens("")
    many = max(input_len // 2, 1)
    per_word = max((await client.prompt_tokens(word_prompts(rng, 1, many)[0]) - overhead) / many, 1e-3)
    return max(1, round((input_len - overhead) / per_word))


async def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Check the server, warm up, run every level; returns the report (what --json prints)."""
    I, O, N = args.input_len, args.output_len, args.num_prompts
    client = Client(args, max(args.concurrency))
    rng = random.Random(args.seed)
    try:
        memory = ServerMemory(args.server_pid) if args.server_pid is not None else None
    except ServerMemoryError as exc:
        await client.close()
        raise BenchError(str(exc)) from None
    try:
        served = await client.models()
        card = next((m for m in served if m.get("id") == args.model), {})
        if client.chat:
            words = await chat_words(client, rng, I)
            make = lambda n: word_prompts(rng, n, words)  # noqa: E731
            prompt_kind = f"random text of {words} words (chat)"
        else:
            ids = token_range(args.vocab_size)
            make = lambda n: token_prompts(rng, n, I, ids)  # noqa: E731
            prompt_kind = f"random token ids in [{ids[0]}, {ids[1]})"
        warm, warm_level = make(args.warmup), None
        if warm:  # one alone first, so that a server refusing the prompts says why once
            r = await client.send(warm[0], min(O, 4))
            if not r.ok:
                hint = ""
                if not client.chat and "vocab" in r.error.lower():
                    hint = f"\n(the prompts' token ids are drawn from [{ids[0]}, {ids[1]}): give --vocab-size for a smaller vocabulary)"
                raise BenchError(f"the warm-up request to {client.url} failed: {r.error}{hint}")
        if len(warm) > 1:  # the rest as the first level sends its own: what a server does once, on its first burst
            c = args.concurrency[0]
            warm_level = await run_level(client, warm[1:], c, min(O, 4), min(args.client_procs, c))
            if warm_level["failed"]:
                raise BenchError(f"{warm_level['failed']} of the warm-up requests to {client.url} failed: "
                                 f"{warm_level['errors'][0]}")
        levels = [await run_level(client, make(N), c, O, min(args.client_procs, c)) for c in args.concurrency]
    finally:
        await client.close()
        server_memory = memory.stop() if memory is not None else None
    return {
        "base_url": client.base,
        "endpoint": client.url.removeprefix(client.base),
        "model": args.model,
        "served_models": [m.get("id") for m in served],
        "server_max_model_len": card.get("max_model_len"),
        "input_len": I, "output_len": O, "num_prompts": N, "seed": args.seed, "warmup": args.warmup,
        "prompt": prompt_kind,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "results": levels,
        **({"warmup_burst": warm_level} if warm_level else {}),
        **({"server_memory": server_memory} if server_memory else {}),
    }


def render(r: dict[str, Any]) -> str:
    lines = [
        f"server   {r['base_url']}{r['endpoint']}, model {r['model']}",
        f"requests {r['num_prompts']} per level, {r['input_len']} input -> {r['output_len']} output tokens, "
        f"{r['prompt']}, seed {r['seed']}, {r['date']}",
        "",
        f"{'conc':>5} {'ok':>5} {'fail':>4} {'in tok':>6} {'time s':>8} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT ms mean/med/p90/p99':>31} {'TPOT ms mean/med/p90/p99':>31} {'E2E ms p50/p99':>17} {'exact O':>7}",
    ]
    input_mean = lambda x: f"{x['total_input_tokens'] / x['completed']:.1f}" if x["completed"] and x["total_input_tokens"] else "-"  # noqa: E731
    fmt = lambda s, keys: "/".join(f"{s[k]:.1f}" for k in keys) if s else "-"  # noqa: E731
    for x in r["results"]:
        lines.append(
            f"{x['concurrency']:>5} {x['completed']:>5} {x['failed']:>4} {input_mean(x):>6} {x['duration_s']:>8.2f} "
            f"{x['request_throughput']:>8.2f} {x['output_tok_per_s']:>10.1f} "
            f"{fmt(x['ttft_ms'], ('mean', 'median', 'p90', 'p99')):>31} "
            f"{fmt(x['tpot_ms'], ('mean', 'median', 'p90', 'p99')):>31} "
            f"{fmt(x['e2e_ms'], ('median', 'p99')):>17} {'yes' if x['all_exact_output_len'] else 'NO':>7}"
        )
    sources = {x["output_tokens_from"] for x in r["results"]} - {None}
    lines.append(f"in tok: mean input tokens per request (usage); output tokens counted from: "
                 f"{', '.join(sorted(sources)) or '-'} (usage: the server's usage chunk; chunks: one per content chunk)")
    if r.get("server_memory"):
        lines.append(render_memory(r["server_memory"]))
    for x in r["results"]:
        for e in x["errors"]:
            lines.append(f"error at concurrency {x['concurrency']}: {e}")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    """Output throughput, and TTFT and TPOT (median, p99), against concurrency: two panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [x["concurrency"] for x in r["results"]]
    fig, (tput, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    tput.plot(xs, [x["output_tok_per_s"] for x in r["results"]], "o-")
    tput.set(title="output throughput", xlabel="concurrency", ylabel="output tokens/s")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            pts = [(c, x[key][stat]) for c, x in zip(xs, r["results"]) if x[key]]
            lat.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{name} {stat}")
    lat.set(title="latency", xlabel="concurrency", ylabel="ms")
    lat.set_yscale("log")
    lat.legend()
    for ax in (tput, lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(c) for c in xs])
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{r['model']} at {r['base_url']}: {r['input_len']} in / {r['output_len']} out, "
                 f"{r['num_prompts']} requests per level", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def concurrency_list(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("every concurrency level must be at least 1")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                        help="completions: token-id prompts of exactly --input-len; chat: text prompts of about that")
    parser.add_argument("--concurrency", type=concurrency_list, default=[1, 8, 64], help="levels, e.g. 1,8,64 (C)")
    parser.add_argument("--input-len", type=int, default=128, help="tokens per prompt (I)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request (O)")
    parser.add_argument("--num-prompts", type=int, default=128, help="requests per concurrency level (N)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the model's vocabulary size, when below 20000: keeps the prompt ids inside it")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--warmup", type=int, default=1, help=(
        "requests before the first level, not measured (up to 4 output tokens each): one alone, then the rest as the "
        "first level sends its own, at its concurrency and from its client processes"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait on the server, per read")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random prompts")
    parser.add_argument("--client-procs", type=int, default=1,
                        help="client processes sharing each level's requests (one Python client parses a few "
                             "thousand stream events a second: use several against a fast server)")
    parser.add_argument("--server-pid", type=int, default=None, metavar="PID",
                        help="a server on this machine (Linux): report its peak resident memory, and that of the "
                             "processes below it, over the run")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="draw throughput and latency")
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    for name in ("input_len", "output_len", "num_prompts", "client_procs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if args.vocab_size is not None and args.vocab_size < 2:
        raise SystemExit("--vocab-size must be at least 2")
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise SystemExit("the serve benchmark needs httpx: pip install httpx") from None
    try:
        report = asyncio.run(run_serve(args))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report) if args.json else render(report))
    if args.plot:
        plot(report, args.plot)
    failed = sum(x["failed"] for x in report["results"])
    if failed:
        first = next(e for x in report["results"] for e in x["errors"])
        print(f"error: {failed} request(s) failed; the first: {first}", file=sys.stderr)
        return 1
    return 0
