"""GPU check of the NVIDIA backend's latent attention (MLA, contract 1.1) at DeepSeek-V2-Lite geometry
(16 heads, kv_lora_rank 512, rope_dim 64), in one run:

  (a) decode steps, batch 1, 32 and 64 at contexts 128 to 8192, bfloat16: max error and NMSE
      (||got - want||^2 / ||want||^2) against the reference MLA in float64; median time of the step's
      forward (latent write + attention) and of the attention launch alone; the latent bytes it reads
      per second, against the measured device-to-device copy bandwidth (read + write); the split count
      the planner chose, and batch 1 / 8 without the split for its worth;
  (b) prefill and mixed batches, bfloat16 and float32 (tf32x3), with TFLOP/s;
  (c) a CUDA graph captured at the longest context with padding rows (slot -1), replayed with other
      lengths, block tables and contents: equal to eager, close to the reference, padding slots unwritten;
  (d) a sweep of key-tile sizes and warps for decode (section ``sweep``).

Install as for gpu_check.py (see its docstring), then from the repository root:

    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/mla_check.py [SECTION ...]

Writes mla_check.json under $OUT (or the current folder) and prints a table last. ``--smoke`` runs
tiny shapes on the CPU under TRITON_INTERPRET=1 (float32), to check the script itself.
"""

import functools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.argv.remove("--smoke")

import torch  # noqa: E402
import triton.testing  # noqa: E402

from chitu_core.attention.contract import AttentionMetadata  # noqa: E402
from chitu_core.attention.mla import mla_attention as reference_mla  # noqa: E402
from chitu_core.kernels.triton import mla_attention as kernels  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
OUT = Path(os.environ.get("OUT", "."))
HEADS, LORA, ROPE = (4, 32, 8) if SMOKE else (16, 512, 64)  # DeepSeek-V2-Lite
WIDTH = LORA + ROPE
SCALE = 192**-0.5  # DeepSeek's 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
BATCHES, CONTEXTS = ((1, 3), (20, 70)) if SMOKE else ((1, 32, 64), (128, 512, 1024, 2048, 4096, 8192))
DTYPE = torch.float32 if SMOKE else torch.bfloat16  # the interpreter's bfloat16 products are wrong
RESULTS: dict = {"decode": [], "batches": [], "graph": {}, "sweep": [], "errors": []}
if SMOKE:
    MLA = kernels.TritonMLAAttention
else:
    from chitu_nvidia.backend import NvidiaBackend

    MLA = next(iter(NvidiaBackend().mla_attention_backends().values()))
BLOCK = MLA.block_sizes[0]


def log(*args) -> None:
    print(*args, flush=True)


def section(fn):
    """Run one section; a failure is recorded and the next section still runs."""
    @functools.wraps(fn)
    def run():
        start = time.time()
        try:
            fn()
        except Exception as exc:  # report and carry on: one call must say as much as it can
            RESULTS["errors"].append(f"{fn.__name__}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        log(f"[{fn.__name__} {time.time() - start:.1f} s]")
    return run


def nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.double(), want.double()
    return float(((g - w) ** 2).sum() / (w**2).sum().clamp_min(1e-300))


def time_ms(fn) -> float:
    if SMOKE:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


@section
def environment():
    if SMOKE:
        RESULTS["device"], n = "cpu (interpreter)", 1 << 24
    else:
        props = torch.cuda.get_device_properties(DEV)
        RESULTS["device"], n = f"{props.name}, {props.multi_processor_count} SMs", 1 << 31
    RESULTS["versions"] = f"torch {torch.__version__}, triton {triton.__version__}; backend {MLA.__name__}"
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    RESULTS["copy_gbps"] = 2 * a.numel() / time_ms(lambda: b.copy_(a)) / 1e6
    log(RESULTS["device"], "|", RESULTS["versions"], f"| copy {RESULTS['copy_gbps']:.0f} GB/s")


class Step:
    """One step: per sequence (context, new tokens), then ``padding`` decode-graph padding rows (slot -1,
    sequence length 1); shuffled blocks, the cache random where read, the backend prepared for it."""

    def __init__(self, contexts: list[int], news: list[int], dtype: torch.dtype, splits: int | None = None,
                 padding: int = 0, max_seq_len: int | None = None):
        lens = [c + n for c, n in zip(contexts, news)]
        needed = [-(-n // BLOCK) for n in lens]
        self.num_blocks = sum(needed) + 8
        pool = torch.randperm(self.num_blocks)
        tables = torch.randint(0, self.num_blocks, (len(lens) + padding, max(needed)), dtype=torch.int32)
        start = 0
        for row, n in zip(tables, needed):
            row[:n], start = pool[start : start + n], start + n
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, news)])
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(news))
        slots = torch.cat((tables[seq, pos // BLOCK].long() * BLOCK + pos % BLOCK, torch.full((padding,), -1)))
        qsl = torch.zeros(len(lens) + padding + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(news + [1] * padding).cumsum(0)
        self.meta = AttentionMetadata(
            slots.to(DEV), tables.to(DEV), torch.tensor(lens + [1] * padding, dtype=torch.int32, device=DEV),
            torch.tensor(contexts + [0] * padding, dtype=torch.int32, device=DEV), qsl.to(DEV), max(news),
            max_seq_len or max(lens), BLOCK)
        self.cache = torch.randn(self.num_blocks, BLOCK, WIDTH, device=DEV, dtype=dtype)
        self.q = torch.randn(len(slots), HEADS, WIDTH, device=DEV, dtype=dtype)
        self.latent = torch.randn(len(slots), WIDTH, device=DEV, dtype=dtype)
        self.attn = MLA(HEADS, LORA, ROPE, BLOCK, dtype, DEV)
        self.attn.force_num_splits = splits
        self.meta.backend_state = self.attn.prepare(self.meta)
        self.lens, self.real = lens, len(pos)
        e = self.cache.element_size()
        self.latent_bytes = sum(lens) * WIDTH * e
        self.nbytes = self.latent_bytes + self.q.numel() * e + len(slots) * HEADS * LORA * e + len(slots) * WIDTH * e
        self.flops = 2 * HEADS * (WIDTH + LORA) * sum(n * c + n * (n + 1) // 2 for c, n in zip(contexts, news))

    def forward(self) -> torch.Tensor:
        return self.attn.forward(self.q, self.latent, self.cache, self.meta, SCALE)

    def attend(self) -> torch.Tensor:
        state = self.meta.backend_state
        return kernels.mla_attention(self.q, self.cache, self.meta.block_tables, self.meta.seq_lens,
                                     self.meta.query_start_loc, SCALE, LORA, state.plan, state.workspace,
                                     self.attn.float32_dot_precision)

    def reference(self, cache_before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [real rows], cache after) of the float64 reference from ``cache_before``."""
        cache = cache_before.double()
        out = reference_mla(self.q.double(), self.latent.double(), cache, self.meta, SCALE, LORA)
        return out[: self.real], cache


def row(kind: str, label: str, step: Step) -> dict:
    before = step.cache.clone()
    got = step.forward()
    want, _ = step.reference(before)
    got = got[: step.real]
    ms, attend_ms = time_ms(step.forward), time_ms(step.attend)
    plan = step.meta.backend_state.plan
    out = dict(case=label, dtype=str(step.cache.dtype).removeprefix("torch."), splits=plan.num_splits,
               block_n=plan.block_n, warps=plan.num_warps, max_err=float((got.double() - want).abs().max()),
               nmse=nmse(got, want), finite=bool(got.isfinite().all()), ms=ms, attend_ms=attend_ms,
               latent_gbps=step.latent_bytes / attend_ms / 1e6, gbps=step.nbytes / ms / 1e6,
               tflops=step.flops / attend_ms / 1e9)
    RESULTS[kind].append(out)
    log(out)
    return out


@section
def decode():
    for b in BATCHES:
        for c in CONTEXTS:
            row("decode", f"decode {b} x ctx {c}", Step([c] * b, [1] * b, DTYPE))
    for b in (1, 8):
        c = CONTEXTS[-1]
        row("decode", f"decode {b} x ctx {c} (no split)", Step([c] * b, [1] * b, DTYPE, splits=1))
    if not SMOKE:
        torch.cuda.empty_cache()


@section
def batches():
    n = 8 if SMOKE else 1024
    for dtype in (DTYPE, torch.float32) if not SMOKE else (DTYPE,):
        row("batches", f"prefill 4x{n}", Step([0] * 4, [n] * 4, dtype))
        row("batches", f"mixed 2x{n // 2} pre + 28 dec + 2 chunks", Step(
            [0] * 2 + [2 * n] * 28 + [n] * 2, [n // 2] * 2 + [1] * 28 + [n // 4] * 2, dtype))
        row("batches", f"chunked 1x{n // 2} after {4 * n}", Step([4 * n], [n // 2], dtype))


@section
def graph():
    """Capture at the longest context with 2 padding rows; replay with other lengths, tables and contents."""
    b, longest = (3, 70) if SMOKE else (32, CONTEXTS[-1])
    step = Step([longest] * b, [1] * b, DTYPE, padding=2, max_seq_len=longest + 1)
    if SMOKE:
        replay = step.forward
    else:
        from chitu_core.kernels.triton.graphs import DeviceGraphRunner

        replay = DeviceGraphRunner().capture(step.forward)
    other = Step([int(x) for x in torch.randint(1, longest, (b,))], [1] * b, DTYPE, padding=2)
    assert other.num_blocks <= step.num_blocks
    for name in ("slot_mapping", "seq_lens", "context_lens", "query_start_loc"):
        getattr(step.meta, name).copy_(getattr(other.meta, name))
    step.meta.block_tables.zero_()[:, : other.meta.block_tables.shape[1]] = other.meta.block_tables
    step.q.copy_(other.q)
    step.latent.copy_(other.latent)
    step.cache[: other.num_blocks] = other.cache
    before = step.cache.clone()
    got = replay().clone()
    after = step.cache.clone()
    step.cache.copy_(before)
    eager = step.forward()
    want, want_cache = step.reference(before)
    g = RESULTS["graph"]
    g["case"] = f"captured {b} x ctx {longest} + 2 padding; replayed at contexts {other.lens}"
    g["equal_to_eager"] = bool(torch.equal(got, eager))
    g["nmse"], g["finite"] = nmse(got[: step.real], want), bool(got.isfinite().all())
    g["cache_exact"] = bool(torch.equal(after.double(), want_cache))  # padding slots unwritten
    g["splits"] = step.meta.backend_state.plan.num_splits
    log(g)


@section
def sweep():
    """Key tiles and warps for decode (bf16), the planner's head block and split count kept."""
    for b, c in ((1, CONTEXTS[-1]), (BATCHES[-1], CONTEXTS[-2])):
        step = Step([c] * b, [1] * b, DTYPE)
        planned = step.meta.backend_state.plan
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                step.meta.backend_state.plan = kernels.MLAPlan(planned.head_block, planned.block_m, block_n,
                                                               planned.num_splits, warps)
                try:
                    ms = time_ms(step.attend)
                except Exception as exc:  # e.g. out of shared memory: record it, try the next
                    ms = float("nan")
                    log(f"sweep {b}x{c} block_n {block_n} warps {warps}: {type(exc).__name__}: {exc}")
                RESULTS["sweep"].append(dict(case=f"decode {b} x ctx {c}", block_n=block_n, warps=warps, ms=ms,
                                             latent_gbps=step.latent_bytes / ms / 1e6,
                                             planned=(block_n, warps) == (planned.block_n, planned.num_warps)))


def fmt(x, spec=".3g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table() -> str:
    r = RESULTS
    copy = r.get("copy_gbps", float("nan"))
    out = [f"device: {r.get('device')} | {r.get('versions')} | copy {fmt(copy, '.0f')} GB/s",
           f"MLA H={HEADS} L={LORA} R={ROPE} block {BLOCK}; GB/s = latent bytes read / attention time", "",
           f"{'case':<42}{'dtype':<9}{'split':>5}{'max err':>9}{'NMSE':>9}{'fwd ms':>8}{'attn ms':>8}{'GB/s':>7}"
           f"{'%copy':>6}{'TF/s':>6}"]
    for a in r["decode"] + r["batches"]:
        out.append(f"{a['case']:<42}{a['dtype']:<9}{a['splits']:>5}{fmt(a['max_err']):>9}{fmt(a['nmse']):>9}"
                   f"{fmt(a['ms']):>8}{fmt(a['attend_ms']):>8}{fmt(a['latent_gbps'], '.0f'):>7}"
                   f"{fmt(100 * a['latent_gbps'] / copy, '.0f'):>6}{fmt(a['tflops'], '.0f'):>6}"
                   + ("" if a["finite"] else " NONFINITE"))
    if r["graph"]:
        out += ["", "graph: " + ", ".join(f"{k} {v}" for k, v in r["graph"].items())]
    if r["sweep"]:
        out += ["", "decode tile sweep: case, block_n/warps: attention ms (latent GB/s), * = planned"]
        for case in dict.fromkeys(x["case"] for x in r["sweep"]):
            out.append(f"  {case}: " + ", ".join(
                f"{x['block_n']}/{x['warps']}{'*' if x['planned'] else ''}: {fmt(x['ms'])} ({fmt(x['latent_gbps'], '.0f')})"
                for x in r["sweep"] if x["case"] == case))
    out += [f"ERROR {e}" for e in r["errors"]]
    return "\n".join(out)


SECTIONS = {f.__name__: f for f in (environment, decode, batches, graph, sweep)}


def main() -> int:
    torch.manual_seed(0)
    for name in ["environment"] + [n for n in (sys.argv[1:] or list(SECTIONS)) if n != "environment"]:
        SECTIONS[name]()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "mla_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    log("\n" + table())
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
