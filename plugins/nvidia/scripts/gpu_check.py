"""GPU check of the NVIDIA backend, in one run: kernels against the float64 reference, their speed,
and a random-weight Llama-3.1-8B end to end against transformers.

  (a) every Triton kernel on Llama-3.1-8B shapes in bfloat16 and float32: max error and NMSE
      (||got - want||^2 / ||want||^2) against the reference ops in float64;
  (b) their median time (triton.testing.do_bench) against the reference ops in the same dtype,
      and GB/s against the measured device-to-device copy bandwidth (bytes read + written);
  (c) the model through LLM(device="nvidia", dtype="bfloat16"), greedy 32 tokens for prompts of
      several lengths in one batch, against transformers on the same weights in bfloat16 and in
      float32 (see ``model_vs_transformers``);
  (d) a torch.profiler table of a few decode steps at batch 1 and 64 (throughput against
      transformers and the byte floor: ``python -m chitu_core.bench offline --peer hf``);
  (e) a sweep of the attention kernel's tile shapes (section ``sweep``).

The weights are made on the GPU (from_config) and saved to local disk there; nothing is carried.
Writes gpu_check.json and profile.txt under $OUT (or the current folder); prints a table last.
On the lent machine (torch, triton and transformers installed; `bash ../shared/gpu/wheels.sh` puts
the rest in .whl, with setuptools>=77 to build our three distributions), from the repository root:

    pip install --no-index --no-deps --target ~/site .whl/*.whl  (setuptools into ~/bt instead)
    PYTHONPATH=~/bt pip install --no-index --no-deps --no-build-isolation --target ~/chitu . ./models ./plugins/nvidia
    PYTHONPATH=~/chitu:~/site python3 plugins/nvidia/scripts/gpu_check.py [SECTION ...]
"""

import functools
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.testing

from chitu_core.attention.contract import AttentionMetadata
from chitu_core.attention.reference import paged_attention as reference_attention
from chitu_core.kernels.triton.kv_cache import write_kv
from chitu_core.kernels.triton.ops import TRITON_OPS
from chitu_core.kernels.triton.paged_attention import AttentionPlan, paged_attention
from chitu_core.kernels.triton.rotary import rotary_embedding, rotary_embedding_and_write_kv
from chitu_core.ops import reference
from chitu_nvidia.backend import NvidiaBackend

DEV = torch.device("cuda")
OUT = Path(os.environ.get("OUT", "."))
HIDDEN, INTER, HQ, HK, HEAD_DIM, BLOCK, VOCAB = 4096, 14336, 32, 8, 128, 16, 128256  # Llama-3.1-8B
TOKENS = 8192  # rows of the op checks
RESULTS: dict = {"ops": [], "attention": [], "sweep": [], "errors": []}
ATTENTION = next(iter(NvidiaBackend().attention_backends().values()))


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
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def f64(a):
    return a.double() if torch.is_tensor(a) and a.is_floating_point() else a


@section
def environment():
    props = torch.cuda.get_device_properties(DEV)
    import transformers

    RESULTS["device"] = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
    RESULTS["versions"] = f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"
    a = torch.empty(1 << 31, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    RESULTS["copy_gbps"] = 2 * a.numel() / time_ms(lambda: b.copy_(a)) / 1e6
    log(RESULTS["device"], "|", RESULTS["versions"], f"| copy {RESULTS['copy_gbps']:.0f} GB/s")


def op_row(name: str, dtype: torch.dtype, shape: str, args: tuple, kwargs: dict, nbytes: int) -> None:
    ours, ref = TRITON_OPS[name], getattr(reference, name)
    got, want = ours(*args, **kwargs), ref(*[f64(a) for a in args], **kwargs)
    pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
    ms, ref_ms = time_ms(lambda: ours(*args, **kwargs)), time_ms(lambda: ref(*args, **kwargs))
    RESULTS["ops"].append(dict(
        kernel=name, dtype=str(dtype).removeprefix("torch."), shape=shape,
        max_err=max(float((g.double() - w).abs().max()) for g, w in pairs),
        nmse=max(nmse(g, w) for g, w in pairs), finite=all(bool(g.isfinite().all()) for g, _ in pairs),
        ms=ms, ref_ms=ref_ms, gbps=nbytes / ms / 1e6))


def index_copy_kv(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


@section
def ops():
    t = TOKENS
    for dtype in (torch.bfloat16, torch.float32):
        e = torch.empty((), dtype=dtype).element_size()
        x, r = (torch.randn(t, HIDDEN, device=DEV, dtype=dtype) for _ in range(2))
        w = torch.randn(HIDDEN, device=DEV, dtype=dtype) * 0.1 + 1
        op_row("rms_norm", dtype, f"{t}x{HIDDEN}", (x, w, 1e-5), {}, 2 * x.numel() * e)
        op_row("fused_add_rms_norm", dtype, f"{t}x{HIDDEN}", (x, r, w, 1e-5), {}, 4 * x.numel() * e)
        gate_up = torch.randn(t, 2 * INTER, device=DEV, dtype=dtype)
        op_row("silu_and_mul", dtype, f"{t}x{2 * INTER}", (gate_up,), {}, 3 * t * INTER * e)
        del x, r, gate_up
        qkv = torch.randn(t, HQ + 2 * HK, HEAD_DIM, device=DEV, dtype=dtype)  # q, k: slices of the projection
        q, k = qkv[:, :HQ], qkv[:, HQ : HQ + HK]
        positions = torch.randint(0, 131072, (t,), device=DEV)
        angles = torch.rand(131072, HEAD_DIM // 2, device=DEV, dtype=torch.float64) * 100
        cos_sin = torch.cat((angles.cos(), angles.sin()), -1).float()
        for neox in (True, False):
            op_row("rotary_embedding", dtype, f"{t}x({HQ}+{HK})x{HEAD_DIM} {'neox' if neox else 'interleaved'}",
                   (positions, q, k, cos_sin, neox), {}, 2 * t * (HQ + HK) * HEAD_DIM * e)
        v = qkv[:, HQ + HK :]
        cache = torch.zeros(2, t // BLOCK + 4, BLOCK, HK, HEAD_DIM, device=DEV, dtype=dtype)
        slots = torch.randperm(cache[0].numel() // (HK * HEAD_DIM), device=DEV)[:t]
        write_kv(cache, k, v, slots)
        flat = cache.view(2, -1, HK, HEAD_DIM)
        exact = bool(torch.equal(flat[0][slots], k) and torch.equal(flat[1][slots], v))
        ms = time_ms(lambda: write_kv(cache, k, v, slots))
        ref_ms = time_ms(lambda: index_copy_kv(flat, k, v, slots))
        RESULTS["ops"].append(dict(kernel="write_kv", dtype=str(dtype).removeprefix("torch."), shape=f"{t}x{HK}x{HEAD_DIM}",
                                   max_err=0.0 if exact else float("nan"), nmse=0.0 if exact else float("nan"), finite=True,
                                   ms=ms, ref_ms=ref_ms, gbps=4 * t * HK * HEAD_DIM * e / ms / 1e6))
        fused = lambda: rotary_embedding_and_write_kv(positions, q, k, v, cos_sin, True, cache, slots)  # noqa: E731
        fq, fk = fused()
        rq, rk = rotary_embedding(positions, q, k, cos_sin, True)
        exact = bool(torch.equal(fq, rq) and torch.equal(fk, rk) and torch.equal(flat[0][slots], rk)
                     and torch.equal(flat[1][slots], v))
        ms = time_ms(fused)
        separate_ms = time_ms(lambda: (rotary_embedding(positions, q, k, cos_sin, True), write_kv(cache, k, v, slots)))
        RESULTS["ops"].append(dict(kernel="rotary+write_kv", dtype=str(dtype).removeprefix("torch."),
                                   shape=f"{t}x({HQ}+{HK})x{HEAD_DIM} fused; ref=separate", max_err=0.0 if exact else float("nan"),
                                   nmse=0.0 if exact else float("nan"), finite=True, ms=ms, ref_ms=separate_ms,
                                   gbps=(2 * t * (HQ + HK) + 3 * t * HK) * HEAD_DIM * e / ms / 1e6))
        del qkv, cache, angles, cos_sin
    torch.cuda.empty_cache()


def attention_step(contexts: list[int], news: list[int], dtype: torch.dtype, splits: int | None = None) -> dict:
    """One step of paged attention on Llama-3.1-8B heads: shuffled blocks, the cache random where written,
    the backend's attention prepared for it, and the float64 reference output."""
    lens = [c + n for c, n in zip(contexts, news)]
    needed = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(needed) + 8
    pool = torch.randperm(num_blocks)
    tables = torch.zeros(len(lens), max(needed), dtype=torch.int32)
    start = 0
    for row, n in zip(tables, needed):
        row[:n], start = pool[start : start + n], start + n
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, news)])
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(news))
    slots = (tables[seq, pos // BLOCK].long() * BLOCK + pos % BLOCK).to(DEV)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(news).cumsum(0)
    meta = AttentionMetadata(slots, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV),
                             torch.tensor(contexts, dtype=torch.int32, device=DEV), qsl.to(DEV), max(news), max(lens), BLOCK)
    cache = torch.randn(2, num_blocks, BLOCK, HK, HEAD_DIM, device=DEV, dtype=dtype)
    flat = cache.view(2, -1, HK, HEAD_DIM)
    q = torch.randn(len(pos), HQ, HEAD_DIM, device=DEV, dtype=dtype)
    k, v = flat[0][slots].clone(), flat[1][slots].clone()  # the step rewrites what the cache holds
    attn = ATTENTION(HQ, HK, HEAD_DIM, BLOCK, dtype, DEV)
    attn.force_num_splits = splits
    meta.backend_state = attn.prepare(meta)
    scale = HEAD_DIM**-0.5
    want = reference_attention(q.double(), k.double(), v.double(), cache.double(), meta, scale)
    e = cache.element_size()
    return dict(attn=attn, q=q, k=k, v=v, cache=cache, meta=meta, scale=scale, want=want, lens=lens,
                nbytes=sum(lens) * HK * HEAD_DIM * 2 * e + 2 * q.numel() * e,
                flops=4 * HQ * HEAD_DIM * sum(n * c + n * (n + 1) // 2 for c, n in zip(contexts, news)))


def attention_row(label: str, contexts: list[int], news: list[int], dtype: torch.dtype, splits: int | None = None,
                  sdpa: bool = False) -> None:
    st = attention_step(contexts, news, dtype, splits)
    attn, q, k, v, cache, meta, scale = (st[n] for n in ("attn", "q", "k", "v", "cache", "meta", "scale"))
    got = attn.forward(q, k, v, cache, meta, scale)
    ms = time_ms(lambda: attn.forward(q, k, v, cache, meta, scale))
    small = len(q) * max(st["lens"]) <= 1 << 24
    ref_ms = time_ms(lambda: reference_attention(q, k, v, cache, meta, scale)) if small else float("nan")
    row = dict(case=label, dtype=str(dtype).removeprefix("torch."), splits=meta.backend_state.plan.num_splits,
               block_m=meta.backend_state.plan.block_m, max_err=float((got.double() - st["want"]).abs().max()),
               nmse=nmse(got, st["want"]), finite=bool(got.isfinite().all()), ms=ms, ref_ms=ref_ms,
               gbps=st["nbytes"] / ms / 1e6, tflops=st["flops"] / ms / 1e9)
    if sdpa:  # the same attention on dense tensors through PyTorch's SDPA, for scale (equal lengths only)
        b, n, c = len(st["lens"]), news[0], contexts[0]
        qd = torch.randn(b, HQ, n, HEAD_DIM, device=DEV, dtype=dtype)
        kd, vd = (torch.randn(b, HK, c + n, HEAD_DIM, device=DEV, dtype=dtype) for _ in range(2))
        causal = c == 0 and n > 1
        row["sdpa_ms"] = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, is_causal=causal, enable_gqa=True))
    RESULTS["attention"].append(row)


@section
def attention():
    for dtype in (torch.bfloat16, torch.float32):
        attention_row("prefill 8x1024", [0] * 8, [1024] * 8, dtype, sdpa=dtype == torch.bfloat16)
        attention_row("decode 64 x ctx 2048", [2048] * 64, [1] * 64, dtype, sdpa=dtype == torch.bfloat16)
        attention_row("mixed 4x512 pre + 60 dec + 2 chunks", [0] * 4 + [1000] * 60 + [1024] * 2,
                      [512] * 4 + [1] * 60 + [256] * 2, dtype)
    for splits in (None, 1):
        attention_row(f"decode 1 x ctx 8192 ({'planned' if splits is None else 'no split'})", [8192], [1],
                      torch.bfloat16, splits, sdpa=splits is None)
        attention_row(f"decode 8 x ctx 4096 ({'planned' if splits is None else 'no split'})", [4096] * 8, [1] * 8,
                      torch.bfloat16, splits)
    torch.cuda.empty_cache()


@section
def sweep():
    """Tile shapes of the attention kernel (block_m, block_n, warps) on three bf16 steps: NMSE and time."""
    cases = {"prefill 8x1024": ([0] * 8, [1024] * 8, [(64, 64, 4), (64, 32, 4), (128, 64, 8), (128, 32, 4),
                                                      (128, 64, 4), (64, 128, 4), (128, 128, 8)]),
             "decode 64 x ctx 2048": ([2048] * 64, [1] * 64, [(16, 64, 4), (16, 32, 4), (16, 128, 4), (16, 64, 2),
                                                              (16, 128, 8), (16, 32, 2)]),
             "mixed": ([0] * 4 + [1000] * 60 + [1024] * 2, [512] * 4 + [1] * 60 + [256] * 2,
                       [(64, 64, 4), (16, 64, 4), (128, 64, 8), (32, 64, 4)])}
    for label, (contexts, news, shapes) in cases.items():
        st = attention_step(contexts, news, torch.bfloat16)
        meta, q, cache = st["meta"], st["q"], st["cache"]
        for block_m, block_n, warps in shapes:
            plan = AttentionPlan(block_m, block_n, 1, warps)
            run = lambda: paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,  # noqa: E731
                                          st["scale"], plan)
            ms = time_ms(run)
            RESULTS["sweep"].append(dict(case=label, block_m=block_m, block_n=block_n, warps=warps,
                                         nmse=nmse(run(), st["want"]), ms=ms, tflops=st["flops"] / ms / 1e9,
                                         gbps=st["nbytes"] / ms / 1e6))
    torch.cuda.empty_cache()


MODEL: dict = {}


@section
def build_model():
    from transformers import AutoModelForCausalLM

    from chitu_core.bench.random_model import hf_config

    torch.manual_seed(0)
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(hf_config("llama-3.1-8b"), dtype=torch.bfloat16)
    hf.eval()
    MODEL["inv_freq"] = {n: b.clone() for n, b in hf.named_buffers() if n.endswith("inv_freq")}
    assert MODEL["inv_freq"] and all(b.dtype == torch.float32 for b in MODEL["inv_freq"].values())
    path = Path(tempfile.mkdtemp(prefix="llama8b-"))
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # as ignore_eos: never stop, never mask EOS
    hf.generation_config.pad_token_id = 0
    # What a decode step must read: every weight but the embedding table, of which it reads a row a token.
    weight_bytes = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if "embed_tokens" not in n)
    MODEL.update(hf=hf, path=path, weight_bytes=weight_bytes)
    log(f"model: {weight_bytes / 1e9:.2f} GB of bf16 weights read per decode step; saved to {path}")


def _last_hidden(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The final hidden state of each prompt's last token, one eager prefill each."""
    from chitu_core.attention.contract import AttentionMetadata
    from chitu_core.layers.context import StepContext

    engine, out = llm.engine, []
    bs = engine.attention.block_size
    with torch.inference_mode():
        for p in prompts:
            n = len(p)
            blocks = -(-n // bs)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(n, device=DEV), block_tables=torch.arange(blocks, dtype=torch.int32, device=DEV)[None],
                seq_lens=torch.tensor([n], dtype=torch.int32, device=DEV), context_lens=torch.zeros(1, dtype=torch.int32, device=DEV),
                query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEV), max_query_len=n, max_seq_len=n, block_size=bs)
            meta.backend_state = engine.attention.prepare(meta)
            hidden = engine.model(torch.tensor(p, device=DEV), torch.arange(n, device=DEV), StepContext(meta, engine.runner.kv_caches))
            out.append(hidden[-1])
    return out


def cast(hf, dtype: torch.dtype) -> None:
    """hf.to(dtype), but RoPE's inverse frequencies stay float32: Module.to casts every floating buffer,
    and inv_freq rounded to bfloat16 turns positions into wrong angles, more wrong the further they are.
    The float32 values are the ones ``build_model`` kept."""
    hf.to(dtype)
    for name, value in MODEL["inv_freq"].items():
        owner, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(owner), attr, value)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at |x| (8 significant bits): the rounding a bf16 logit carries."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@section
def model_vs_transformers():
    """Ours (bf16) against transformers on the same weights, in bf16 and in float32:
    last-token logits NMSE of a batched prefill, and of each prompt's batch-1 decode steps (each prompt
    generated alone, the one-row kernels'); greedy 32 tokens free-running, equal up to the first divergence, which
    must fall on a near-tie of transformers' logits there (top-2 gap under one bf16 ulp of the top
    logit); teacher-forced on our tokens, the steps where ours is not transformers' argmax, and
    of those, the ones whose margin is over that ulp."""
    from chitu_core import LLM, SamplingParams

    hf = MODEL["hf"]
    start = time.time()
    llm = LLM(str(MODEL["path"]), device="nvidia", dtype="bfloat16", max_model_len=384, max_num_seqs=64,
              load_progress=False)
    MODEL.update(llm=llm, load_s=time.time() - start)
    model = llm.engine.model
    captured: list[torch.Tensor] = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: captured.append(compute_logits(h)) or captured[-1]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 33, 100, 128)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    first = captured[0].clone()  # the step that prefilled every prompt: one row each, in order
    outs, decode = [], []  # then each prompt alone: its batch-1 decode steps' logits (the one-row kernels')
    graphs = llm.engine.runner.graphs
    if graphs is not None:  # replayed steps' logits: the graph's output rows, copied before the next replay
        replay = graphs.run
        graphs.run = lambda seqs, size, *a, **k: captured.append(replay(seqs, size, *a, **k)[:len(seqs)].clone()) \
            or captured[-1]
    for p in prompts:
        captured.clear()
        outs.append(llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids)
        decode.append(torch.cat(captured[1:]).float())  # steps 2..32: logits of tokens 1..31 in
    model.compute_logits = compute_logits
    if graphs is not None:
        del graphs.run
    RESULTS["model"] = dict(load_s=MODEL["load_s"], graphs=llm.engine.runner.graphs is not None,
                            native=[n for n, s in llm.engine.ops.sources.items() if s.kind == "native"],
                            fallback=llm.engine.ops.fallbacks())
    del llm, model, captured
    MODEL.pop("llm")
    gc.collect()
    torch.cuda.empty_cache()
    # Ours in float32 (the same bf16 weights, upcast): the implementation without bf16's noise.
    llm32 = LLM(str(MODEL["path"]), device="nvidia", dtype="float32", max_model_len=384, max_num_seqs=8,
                load_progress=False)
    first32 = torch.stack([llm32.engine.model.compute_logits(h) for h in _last_hidden(llm32, prompts)])
    del llm32
    gc.collect()
    torch.cuda.empty_cache()
    rows, hf_bf16_first = [], []
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            cast(hf, dtype)
            for i, (p, ours) in enumerate(zip(prompts, outs)):
                forced = hf(torch.tensor([p + ours[:-1]], device=DEV)).logits[0, len(p) - 1 :].float()
                top2 = forced.topk(2, dim=1).values
                tol = bf16_ulp(top2[:, 0])
                chosen = forced.gather(1, torch.tensor(ours, device=DEV)[:, None])[:, 0]
                margin = top2[:, 0] - chosen  # 0 where ours is transformers' argmax
                row = dict(dtype=str(dtype)[6:], prompt_len=len(p), last_logits_nmse=nmse(first[i], forced[0]),
                           forced_off=int((margin > 0).sum()), forced_off_over_ulp=int((margin > tol).sum()),
                           worst_margin=float(margin.max()), worst_margin_ulps=float((margin / tol).max()))
                if dtype == torch.bfloat16:
                    theirs = hf.generate(torch.tensor([p], device=DEV), max_new_tokens=32, min_new_tokens=32,
                                         do_sample=False)[0, len(p):].tolist()
                    same = [a == b for a, b in zip(ours, theirs)]
                    div = same.index(False) if False in same else len(same)
                    row.update(equal_prefix=div)
                    if div < len(same):  # transformers' own top-2 gap at the divergence
                        gap = float(top2[div, 0] - top2[div, 1])
                        row.update(divergence_gap=gap, divergence_gap_ulps=gap / float(tol[div]))
                    hf_bf16_first.append(forced)
                else:
                    row.update(ours_fp32_nmse=nmse(first32[i], forced[0]), hf_bf16_nmse=nmse(hf_bf16_first[i][0], forced[0]),
                               decode_nmse=nmse(decode[i], forced[1:]), hf_bf16_decode_nmse=nmse(hf_bf16_first[i][1:], forced[1:]))
                rows.append(row)
                log("model:", row)
        cast(hf, torch.bfloat16)
    RESULTS["model_rows"] = rows


@section
def profile():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from chitu_core.bench.offline import random_prompts
    from chitu_core.sampling.params import SamplingParams

    from chitu_core import LLM

    engine = LLM(str(MODEL["path"]), device="nvidia", dtype="bfloat16", max_model_len=384, max_num_seqs=64,
                 load_progress=False).engine
    lines = []
    for b in (1, 64):
        for i, p in enumerate(random_prompts(b, 128, VOCAB, 3)):
            engine.add_request(f"prof{b}-{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        for _ in range(10):  # prefill and the first decode steps
            engine.step()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                engine.step()
            torch.cuda.synchronize()
        while engine.has_unfinished():
            engine.step()
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
        lines += [f"===== batch {b}: 10 decode steps =====", table]
        kernels = sorted((e for e in prof.key_averages() if e.device_type == DeviceType.CUDA),
                         key=lambda e: -e.self_device_time_total)
        RESULTS[f"profile_b{b}"] = dict(
            gpu_ms_per_step=sum(e.self_device_time_total for e in kernels) / 10 / 1e3,
            launches_per_step=sum(e.count for e in kernels) / 10,
            top=[(e.key[:40], round(e.self_device_time_total / 10 / 1e3, 3)) for e in kernels[:6]])
    (OUT / "profile.txt").write_text("\n".join(lines))


def fmt(x, spec=".3g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table() -> str:
    r = RESULTS
    out = [f"device: {r.get('device')} | {r.get('versions')} | copy {fmt(r.get('copy_gbps'), '.0f')} GB/s", "",
           f"{'kernel':<19}{'dtype':<9}{'shape':<34}{'max err':>9}{'NMSE':>9}{'ms':>8}{'ref ms':>8}{'GB/s':>7}{'%copy':>6}"]
    for o in r["ops"]:
        out.append(f"{o['kernel']:<19}{o['dtype']:<9}{o['shape']:<34}{fmt(o['max_err']):>9}{fmt(o['nmse']):>9}"
                   f"{fmt(o['ms']):>8}{fmt(o['ref_ms']):>8}{fmt(o['gbps'], '.0f'):>7}"
                   f"{fmt(100 * o['gbps'] / r.get('copy_gbps', float('nan')), '.0f'):>6}" + ("" if o["finite"] else " NONFINITE"))
    out += ["", f"{'attention (32/8 heads, d128)':<38}{'dtype':<9}{'split':>5}{'max err':>9}{'NMSE':>9}{'ms':>8}"
                f"{'ref ms':>8}{'sdpa ms':>8}{'GB/s':>7}{'TF/s':>6}"]
    for a in r["attention"]:
        out.append(f"{a['case']:<38}{a['dtype']:<9}{a['splits']:>5}{fmt(a['max_err']):>9}{fmt(a['nmse']):>9}{fmt(a['ms']):>8}"
                   f"{fmt(a['ref_ms']):>8}{fmt(a.get('sdpa_ms')):>8}{fmt(a['gbps'], '.0f'):>7}{fmt(a['tflops'], '.0f'):>6}"
                   + ("" if a["finite"] else " NONFINITE"))
    if r["sweep"]:
        out += ["", "attention tile sweep (bf16): case, block_m/block_n/warps: ms (NMSE)"]
        for case in dict.fromkeys(x["case"] for x in r["sweep"]):
            out.append(f"  {case}: " + ", ".join(f"{x['block_m']}/{x['block_n']}/{x['warps']}: {fmt(x['ms'])} ({fmt(x['nmse'], '.2g')})"
                                                for x in r["sweep"] if x["case"] == case))
    if "model_rows" in r:
        out += ["", "Llama-3.1-8B (random weights, bf16), ours against transformers in bf16 and float32: "
                "last-token NMSE, teacher-forced steps off its argmax (of them over one bf16 ulp), worst margin "
                "(ulps), free-running equal prefix of 32, transformers' top-2 gap at the divergence (ulps)"]
        for m in r["model_rows"]:
            out.append(f"  {m['dtype']:<9} prompt {m['prompt_len']:>4}: NMSE {fmt(m['last_logits_nmse'])}, off "
                       f"{m['forced_off']}/32 ({m['forced_off_over_ulp']} over), worst {fmt(m['worst_margin'])} "
                       f"({fmt(m['worst_margin_ulps'])} ulps)" + (f", equal {m['equal_prefix']}/32" if "equal_prefix" in m else "")
                       + (f", gap {fmt(m['divergence_gap'])} ({fmt(m['divergence_gap_ulps'])} ulps)" if "divergence_gap" in m else "")
                       + (f"; ours in float32 NMSE {fmt(m['ours_fp32_nmse'])}, transformers bf16 NMSE {fmt(m['hf_bf16_nmse'])}"
                          f"; batch-1 decode steps 2-32 NMSE {fmt(m['decode_nmse'])}, transformers bf16 "
                          f"{fmt(m['hf_bf16_decode_nmse'])}" if "ours_fp32_nmse" in m else ""))
    for b in (1, 64):
        p = r.get(f"profile_b{b}")
        if p:
            out.append(f"profile batch {b}: {fmt(p['gpu_ms_per_step'])} ms GPU/step, {fmt(p['launches_per_step'], '.0f')} kernels/step; "
                       + ", ".join(f"{k} {v}" for k, v in p["top"]))
    out += [f"ERROR {e}" for e in r["errors"]]
    return "\n".join(out)


SECTIONS = {f.__name__: f for f in (environment, ops, attention, sweep, build_model, model_vs_transformers, profile)}


def main() -> int:
    names = sys.argv[1:] or list(SECTIONS)  # or some, in this order; the model's need build_model first
    for name in names:
        SECTIONS[name]()
    (OUT / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    log("\n" + table())
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
