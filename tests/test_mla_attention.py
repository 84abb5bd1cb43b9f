"""Latent attention (MLA, contract 1.1): the CPU backend, the reference and the Triton kernels (interpreted)
against dense causal attention in float64 over the raw latents; and the conformance suite's MLA rows.

As in tests/test_attention.py, the cache is filled through ``forward`` itself: step 1 prefills every
sequence's context, step 2 runs a mixed batch of prefills, decodes after long contexts, chunked prefills
and, last, decode-graph padding rows (slot -1, sequence length 1). Blocks are shuffled, tables padded
with other sequences' ids, the cache starts as a sentinel; afterwards it must hold exactly each
sequence's latents at its slots and the sentinel everywhere else (padding rows wrote nothing).
"""

import importlib.util
import math
import re

import pytest
import torch

from chitu_core.attention.mla import ReferenceMLAAttention, mla_attention
from chitu_core.conformance.attention_cases import metadata
from chitu_core.conformance.case import Target
from chitu_core.conformance.mla_cases import dense_mla
from chitu_core.conformance.runner import Session, build_cases
from chitu_core.conformance.thresholds import ThresholdBook
from chitu_core.ops.table import resolve_ops
from chitu_cpu.backend import CpuBackend
from chitu_cpu.mla import CpuSdpaMLAAttention
from test_attention import SENTINEL, allocate_blocks

BACKENDS = {"sdpa-mla": CpuSdpaMLAAttention, "reference-mla": ReferenceMLAAttention}
# (context_len, new tokens): prefills, decodes after long contexts, chunked prefills; last blocks partial.
BATCH = [(0, 23), (1, 1), (997, 1), (300, 37), (16, 16), (5, 1), (0, 1), (63, 9)]
WIDE_BATCH = [(0, 9), (130, 1), (40, 7), (3, 1)]  # DeepSeek-V2-Lite geometry: float64 oracles cost more
PADDING = 2  # decode-graph padding rows at the end of step 2
# float32: float32 accumulation. bfloat16: the output's rounding (2**-8 relative) plus probabilities
# rounded to bfloat16 before the product with the latents (SDPA's fused CPU kernel).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=4e-3)}
CONFIGS = [  # (num_heads, kv_lora_rank, rope_dim, block_size, dtype, batch)
    (4, 32, 8, 16, torch.float32, BATCH),
    (4, 32, 8, 64, torch.bfloat16, BATCH),
    (4, 32, 8, 1, torch.float32, BATCH),
    (16, 512, 64, 16, torch.bfloat16, WIDE_BATCH),
    (16, 512, 64, 64, torch.float32, WIDE_BATCH),
]


def q_latent_views(n: int, heads: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, heads, width] and latents [n, width]: non-contiguous slices of wider projection outputs."""
    q = torch.randn(n, heads + 1, width, dtype=torch.float64).to(dtype)[:, 1:]
    latent = torch.randn(n, width + 5, dtype=torch.float64).to(dtype)[:, 3 : 3 + width]
    return q, latent


def run_step(attn, cache, tables, context_lens, query_lens, scale, padding=0):
    """One forward over every sequence's new tokens, then ``padding`` padding rows (their table rows are
    the last of ``tables``); returns (output, per-sequence (q, latent))."""
    rows = len(query_lens) + padding
    meta = metadata(tables[:rows], context_lens + [0] * padding, query_lens + [1] * padding, attn.block_size)
    meta.slot_mapping[sum(query_lens):] = -1
    meta.backend_state = attn.prepare(meta)
    q, latent = q_latent_views(sum(query_lens) + padding, attn.num_heads, attn.latent_dim, attn.dtype)
    out = attn.forward(q, latent, cache, meta, scale)
    assert out.shape == (*q.shape[:2], attn.kv_lora_rank) and out.dtype == attn.dtype
    assert out[sum(query_lens):].isfinite().all()
    bounds = meta.query_start_loc.tolist()
    return out, [(q[a:b], latent[a:b]) for a, b in zip(bounds[:-1], bounds[1 : len(query_lens) + 1])]


def check_mixed_batch(attn, batch, tol, fill=None):
    """Step 1 (the contexts, one prefill each, through ``fill`` if given) and step 2 (the batch, then
    padding rows), each output against dense attention; then the cache, exactly."""
    scale = 1 / math.sqrt(attn.latent_dim)
    contexts, news = [c for c, _ in batch], [n for _, n in batch]
    tables, num_blocks = allocate_blocks([c + n for c, n in batch] + [1] * PADDING, attn.block_size, spare=3)
    cache = attn.allocate_kv_cache(num_blocks)
    assert cache.shape == attn.kv_cache_shape(num_blocks) and not cache.any()
    cache.fill_(SENTINEL)
    written = {}
    for b, c in enumerate(contexts):
        if c:
            out, [(q, latent)] = run_step(fill or attn, cache, tables[b : b + 1], [0], [c], scale)
            torch.testing.assert_close(out.double(), dense_mla(q, latent, 0, scale, attn.kv_lora_rank), **tol)
            written[b] = latent
    out, parts = run_step(attn, cache, tables, contexts, news, scale, PADDING)
    history = []
    for b, (q, latent) in enumerate(parts):
        history.append(torch.cat((written.get(b, latent[:0]), latent)))
        want = dense_mla(q, history[b], contexts[b], scale, attn.kv_lora_rank)
        got = out[sum(news[:b]) : sum(news[: b + 1])]
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"sequence {b}: {m}")
    expected = torch.full_like(cache, SENTINEL)
    for b, latents in enumerate(history):
        pos = torch.arange(latents.shape[0])
        expected[tables[b].long()[pos // attn.block_size], pos % attn.block_size] = latents
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,lora,rope,block_size,dtype,batch", CONFIGS, ids=lambda v: {
    id(BATCH): "batch", id(WIDE_BATCH): "wide"}.get(id(v), str(v).removeprefix("torch.")))
def test_mla_matches_dense_attention(backend, heads, lora, rope, block_size, dtype, batch):
    attn = BACKENDS[backend](heads, lora, rope, block_size, dtype, torch.device("cpu"))
    check_mixed_batch(attn, batch, TOL[dtype])


def test_cpu_decode_steps_extend_the_same_sequences():
    """Decode steps in a row (the folded-heads path): each token attends over everything before it."""
    attn = CpuSdpaMLAAttention(4, 32, 8, 16, torch.float32, torch.device("cpu"))
    scale = 0.3
    lens = [15, 1, 40]
    tables, num_blocks = allocate_blocks([n + 3 for n in lens], 16, spare=2)
    cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
    _, parts = run_step(attn, cache, tables, [0, 0, 0], lens, scale)
    latents = [p[1] for p in parts]
    for step in range(3):
        contexts = [n + step for n in lens]
        out, new = run_step(attn, cache, tables, contexts, [1, 1, 1], scale)
        for b, (q, latent) in enumerate(new):
            latents[b] = torch.cat((latents[b], latent))
            want = dense_mla(q, latents[b], contexts[b], scale, 32)
            torch.testing.assert_close(out[b : b + 1].double(), want, **TOL[torch.float32])


def test_reference_is_the_oracle_in_float64():
    """The reference MLA backend in float64 equals the dense oracle to rounding (it is the fallback)."""
    tables, num_blocks = allocate_blocks([40, 3], 16, spare=1)
    cache = torch.full((num_blocks, 16, 40), SENTINEL, dtype=torch.float64)
    meta = metadata(tables, [0, 0], [40, 3], 16)
    q, latent = q_latent_views(43, 4, 40, torch.float64)
    out = mla_attention(q, latent, cache, meta, 0.2, 32)
    torch.testing.assert_close(out[:40], dense_mla(q[:40], latent[:40], 0, 0.2, 32), rtol=1e-12, atol=1e-12)


# ----- the Triton kernels under the interpreter (float32; see tests/test_triton_kernels.py for why) -----

TRITON_BATCH = [(0, 23), (1, 1), (90, 1), (40, 37), (16, 16), (5, 1), (0, 1), (63, 9)]


@pytest.fixture
def triton_mla():
    """chitu_core.kernels.triton.mla_attention defined and run under TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    from test_triton_kernels import interpreter  # skips if triton was imported before without the interpreter

    with interpreter():
        import chitu_core.kernels.triton.mla_attention as module

        if type(module._mla_attention_kernel).__name__ != "InterpretedFunction":
            pytest.skip("the Triton MLA kernels were defined for a device; run this file in a process of its own")
        yield module


def triton_attention(module, heads, lora, rope, block_size, num_splits=None):
    attn = module.TritonMLAAttention(heads, lora, rope, block_size, torch.float32, torch.device("cpu"))
    attn.force_num_splits = num_splits
    return attn


@pytest.mark.parametrize("heads,lora,rope,block_size", [(4, 32, 8, 16), (4, 32, 8, 64), (8, 48, 8, 1)])
def test_triton_mla_mixed_batch(triton_mla, heads, lora, rope, block_size):
    """L + R of 40 and 56 (neither a power of two, L itself not one either in the last)."""
    check_mixed_batch(triton_attention(triton_mla, heads, lora, rope, block_size), TRITON_BATCH, TOL[torch.float32])


def test_triton_mla_deepseek_geometry(triton_mla):
    """16 heads, L = 512, R = 64: the key split into its 512 and 64 parts; decode and prefill rows."""
    check_mixed_batch(triton_attention(triton_mla, 16, 512, 64, 16), [(0, 5), (70, 1), (20, 3)], TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [3, 8])
def test_triton_mla_split_kv_decode(triton_mla, num_splits):
    """Decode through the split-KV kernels (forced), contexts 1 to 200 keys in tiles of 64: some splits get
    no keys; padding rows end the batch."""
    attn = triton_attention(triton_mla, 4, 32, 8, 16, num_splits)
    tables, _ = allocate_blocks([201], 16, spare=1)
    assert attn.prepare(metadata(tables, [200], [1], 16)).plan.num_splits == num_splits
    check_mixed_batch(attn, [(130, 1), (1, 1), (70, 1), (200, 1)], TOL[torch.float32],
                      fill=triton_attention(triton_mla, 4, 32, 8, 16))


def test_triton_plan_splits_only_underfilled_long_decodes(triton_mla):
    plan = triton_mla.plan  # (num_heads, max_query_len, num_seqs, max_seq_len, compute units)
    assert plan(16, 1, 1, 8192, 132).num_splits == 32  # one program for 264 slots: MAX_SPLITS ranges
    assert plan(16, 1, 1, 300, 132).num_splits == 9  # one sequence: ranges of at least 32 keys
    assert plan(16, 1, 2, 300, 132).num_splits == 1  # a batch: ranges of at least 256
    assert plan(16, 1, 2, 1024, 132).num_splits == 4
    assert plan(16, 1, 32, 8192, 132).num_splits == 8  # 32 programs: 8 ranges stay within 264
    assert plan(16, 1, 64, 8192, 132).num_splits == 4
    assert plan(16, 1, 64, 4096, 16).num_splits == 1  # a small device is full already
    assert plan(16, 1, 1, 63, 132).num_splits == 1  # short context: fewer than two ranges of 32
    assert plan(16, 7, 1, 8192, 132).num_splits == 1  # not a pure decode step
    assert plan(128, 1, 1, 8192, 132).head_block == 32 and plan(128, 1, 1, 8192, 132).num_splits == 32
    wide = plan(16, 1, 1, 100, 132)
    assert (wide.head_block, wide.block_m, wide.block_n, wide.num_warps) == (16, 16, 32, 4)
    assert (plan(16, 9, 1, 100, 132).block_m, plan(16, 1, 1, 100, 132, dtype_bytes=4).block_n) == (32, 16)


def test_triton_write_latent_copies_exactly_and_skips_padding(triton_mla):
    """bfloat16 only moves through copies here (exact under the interpreter too)."""
    cache = torch.full((5, 16, 40), SENTINEL, dtype=torch.bfloat16)
    _, latent = q_latent_views(6, 1, 40, torch.bfloat16)
    slots = torch.randperm(5 * 16)[:6]
    slots[-1] = -1
    want = cache.clone()
    want.view(-1, 40)[slots[:-1]] = latent[:-1]
    triton_mla.write_latent(cache, latent, slots)
    assert torch.equal(cache, want)


def test_triton_warmup_runs_every_variant(triton_mla, monkeypatch):
    seen, launch = [], triton_mla.mla_attention

    def recording(q, cache, tables, seq_lens, qsl, scale, lora, step, *rest):
        seen.append((step.block_m, step.num_splits > 1))
        return launch(q, cache, tables, seq_lens, qsl, scale, lora, step, *rest)

    monkeypatch.setattr(triton_mla, "mla_attention", recording)
    triton_attention(triton_mla, 4, 32, 8, 16).warmup()
    assert sorted(seen) == [(16, False), (16, True), (32, False)]


# ----- the conformance suite's rows -----


def run_rows(backend, pattern: str, dtypes=(torch.float32,)):
    target = Target(backend, resolve_ops(backend.name, backend.native_ops()), torch.device("cpu"), ThresholdBook())
    cases = build_cases(target, dtypes, "mla_attention*")
    return cases, Session(target, [c for c in cases if pattern in c.label]).run_all()


def test_conformance_rows_for_the_cpu_backend():
    cases, results = run_rows(CpuBackend(), "L=32 R=8 bs=16", (torch.float32, torch.float16))
    assert {c.row for c in cases} == {"mla_attention/sdpa-mla", "mla_attention/sdpa-mla/fp8-kv"}
    assert {c.params["block_size"] for c in cases} == set(CpuSdpaMLAAttention.block_sizes)
    assert {(c.params["num_heads"], c.params["kv_lora_rank"], c.params["rope_dim"]) for c in cases} == {
        (4, 32, 8), (16, 512, 64)}
    statuses = {(r.dtype, r.status, r.source) for r in results}
    assert statuses == {("float32", "pass", "native"), ("float16", "unsupported", "")}, results
    assert any("pad*3" in r.label for r in results) and any("long chunked" in r.label for r in results)


class NoMLABackend(CpuBackend):
    def mla_attention_backends(self):
        return {}


class WritesPaddingSlots(ReferenceMLAAttention):
    """Writes padding rows too (slot -1 wraps to the cache's last slot)."""

    name = "writes-padding"

    def forward(self, q, latent, kv_cache, meta, scale):
        kv_cache.view(-1, kv_cache.shape[-1])[meta.slot_mapping] = latent.to(kv_cache.dtype)
        return super().forward(q, latent, kv_cache, meta, scale)


class IgnoresRope(ReferenceMLAAttention):
    """Scores from the first L channels only."""

    name = "no-rope"

    def forward(self, q, latent, kv_cache, meta, scale):
        q = torch.cat((q[..., : self.kv_lora_rank], torch.zeros_like(q[..., self.kv_lora_rank :])), -1)
        return super().forward(q, latent, kv_cache, meta, scale)


@pytest.mark.parametrize("planted,problem", [
    (WritesPaddingSlots,
     r"^step 2 \(padded decode batch\): attention (wrote into blocks|changed \d+ elements of block)"),
    (IgnoresRope, r"^step 1 sequence \d: NMSE .* exceeds 1e-09$"),
])
def test_conformance_catches_planted_mla_faults(planted, problem):
    class Planted(CpuBackend):
        def mla_attention_backends(self):
            return {planted.name: planted}

    _, results = run_rows(Planted(), "padded decode H=4")
    assert [(r.row, r.status) for r in results] == [(f"mla_attention/{planted.name}", "fail")]
    assert re.search(problem, results[0].detail), results[0].detail


def test_conformance_falls_back_to_the_reference_where_none_is_declared():
    _, results = run_rows(NoMLABackend(), "padded decode H=4")
    assert [(r.row, r.status, r.source) for r in results] == [("mla_attention/reference-mla", "fallback", "fallback")]
