"""Paged attention (the CPU backend's SDPA and the reference) against dense causal attention in float64.

The oracle works from the raw per-sequence queries, keys and values, never from the cache. The
cache is filled through ``forward`` itself: a first step writes every sequence's context (as
prefills), a second step runs the mixed batch of prefills, decodes and chunked prefills. Blocks
are handed out shuffled, tables are padded with ids of other blocks, and the cache starts as a
sentinel value, so that reads or writes of the wrong slots show.
"""

import math

import pytest
import torch

from chitu_core.attention.reference import ReferenceAttention
from chitu_core.errors import ChituError
from chitu_core.conformance.attention_cases import metadata  # the suite's step builder, shared
from chitu_cpu.attention import CpuSdpaAttention

BACKENDS = {"sdpa": CpuSdpaAttention, "reference": ReferenceAttention}
# (context_len, new tokens): prefills (no context), decodes (one new token), chunked prefills.
BATCH = [(0, 23), (1, 1), (997, 1), (300, 37), (16, 16), (5, 1), (0, 1), (63, 9)]
SENTINEL = -7.25  # a distinctive finite value, exact in bfloat16 and float32
# float32: the contract's float32 accumulation. bfloat16: the output's rounding (2**-8 relative) plus,
# in SDPA's flash kernel, probabilities rounded to bfloat16 before the product with V (up to 2**-9 of
# max|v| absolute; about 2e-3 seen here).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=4e-3)}
CONFIGS = [  # (num_heads, num_kv_heads, head_dim, block_size, dtype): GQA ratios 1, 4, 8
    (4, 4, 64, 16, torch.float32),
    (8, 2, 128, 1, torch.float32),
    (8, 1, 128, 16, torch.float32),
    (8, 1, 64, 16, torch.bfloat16),
    (4, 1, 64, 1, torch.bfloat16),
    (2, 2, 128, 16, torch.bfloat16),
]


def allocate_blocks(lens: list[int], block_size: int, spare: int) -> tuple[torch.Tensor, int]:
    """int32 block tables for sequences of ``lens`` tokens from a shuffled pool; padding holds other ids."""
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + spare
    pool = torch.randperm(num_blocks)
    width = max(needed) + 2
    tables = torch.randint(0, num_blocks, (len(lens), width))  # padding: ids that belong to others
    start = 0
    for row, n in zip(tables, needed):
        row[:n] = pool[start : start + n]
        start += n
    return tables.to(torch.int32), num_blocks


def qkv_views(n: int, hq: int, hk: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q [n, hq, d], k and v [n, hk, d]: non-contiguous slices of one projection output, as models give them."""
    qkv = torch.randn(n, hq + 2 * hk, d, dtype=torch.float64).to(dtype)
    return qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, scale: float) -> torch.Tensor:
    """float64 causal attention of q (positions context..context+n-1) over k, v (positions 0..L-1)."""
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1)
    values = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    visible = torch.arange(k.shape[0])[None, :] <= (context + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def run_step(attn, cache, tables, context_lens, query_lens, scale):
    """One forward over every sequence's new tokens; returns (output, per-sequence (q, k, v))."""
    meta = metadata(tables, context_lens, query_lens, attn.block_size)
    meta.backend_state = attn.prepare(meta)
    q, k, v = qkv_views(sum(query_lens), attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.dtype)
    out = attn.forward(q, k, v, cache, meta, scale)
    assert out.shape == q.shape and out.dtype == attn.dtype
    return out, [(q[a:b], k[a:b], v[a:b]) for a, b in zip(meta.query_start_loc[:-1], meta.query_start_loc[1:])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hq,hk,d,block_size,dtype", CONFIGS, ids=lambda v: str(v).removeprefix("torch."))
def test_paged_attention_matches_dense_attention(backend, hq, hk, d, block_size, dtype):
    attn = BACKENDS[backend](hq, hk, d, block_size, dtype, torch.device("cpu"))
    scale = 1 / math.sqrt(d)
    contexts, news = [c for c, _ in BATCH], [n for _, n in BATCH]
    tables, num_blocks = allocate_blocks([c + n for c, n in BATCH], block_size, spare=3)
    cache = attn.allocate_kv_cache(num_blocks)
    assert cache.shape == attn.kv_cache_shape(num_blocks) and not cache.any()
    cache.fill_(SENTINEL)

    # Step 1: each sequence with a context prefills it (one call each: padding a batch to the
    # longest context would cost more than the test's budget allows).
    written = {}
    for b, c in enumerate(contexts):
        if c:
            out, [(q, k, v)] = run_step(attn, cache, tables[b : b + 1], [0], [c], scale)
            torch.testing.assert_close(out.double(), dense_attention(q, k, v, 0, scale), **TOL[dtype])
            written[b] = (k, v)
    # Step 2: the mixed batch, every sequence's new tokens after its context.
    out, parts = run_step(attn, cache, tables, contexts, news, scale)
    full_k, full_v = [], []
    for b, (q, k, v) in enumerate(parts):
        ctx_k, ctx_v = written.get(b, (k[:0], v[:0]))
        full_k.append(torch.cat((ctx_k, k)))
        full_v.append(torch.cat((ctx_v, v)))
        want = dense_attention(q, full_k[b], full_v[b], contexts[b], scale)
        got = out[sum(news[:b]) : sum(news[: b + 1])]
        torch.testing.assert_close(got.double(), want, **TOL[dtype], msg=lambda m: f"sequence {b}: {m}")

    # The cache holds exactly each sequence's keys and values at its slots, and the sentinel elsewhere.
    expected = torch.full_like(cache, SENTINEL)
    for b, (keys, values) in enumerate(zip(full_k, full_v)):
        pos = torch.arange(keys.shape[0])
        blocks, offsets = tables[b].long()[pos // block_size], pos % block_size
        expected[0, blocks, offsets] = keys
        expected[1, blocks, offsets] = values
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_steps_extend_the_same_sequences(backend):
    """Several decode steps in a row: each token attends over everything written before it."""
    hq, hk, d, block_size = 4, 2, 64, 16
    attn = BACKENDS[backend](hq, hk, d, block_size, torch.float32, torch.device("cpu"))
    scale = 1 / math.sqrt(d)
    lens = [15, 1, 40]
    tables, num_blocks = allocate_blocks([n + 4 for n in lens], block_size, spare=2)
    cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
    _, parts = run_step(attn, cache, tables, [0, 0, 0], lens, scale)
    ks, vs = [p[1] for p in parts], [p[2] for p in parts]
    for step in range(4):
        contexts = [n + step for n in lens]
        out, new = run_step(attn, cache, tables, contexts, [1, 1, 1], scale)
        for b, (q, k, v) in enumerate(new):
            ks[b], vs[b] = torch.cat((ks[b], k)), torch.cat((vs[b], v))
            want = dense_attention(q, ks[b], vs[b], contexts[b], scale)
            torch.testing.assert_close(out[b : b + 1].double(), want, **TOL[torch.float32])


@pytest.mark.parametrize("kernel", [True, False], ids=["decode_kernel", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).removeprefix("torch."))
def test_a_compiled_decode_step_reads_the_cache_in_place(dtype, kernel):
    """Under torch.compile the CPU attention's decode steps take the C++ kernel (``chitu_cpu.decode_kernel``)
    as an opaque op, or where it is not built ``decode_attention`` (the graph reads the cache through the
    block tables, then an opaque op writes the new keys and values): each token attends over everything
    written before it, windows included, and the cache ends as the eager path leaves it."""
    hq, hk, d, block_size = 6, 2, 64, 16
    attn = CpuSdpaAttention(hq, hk, d, block_size, dtype, torch.device("cpu"))
    scale = 1 / math.sqrt(d)
    lens = [15, 1, 40, 16]
    tables, num_blocks = allocate_blocks([n + 4 for n in lens], block_size, spare=2)
    cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
    assert attn.decode_kernel  # built at allocation: this machine has inductor's C++ compiler
    attn.decode_kernel = kernel
    _, parts = run_step(attn, cache, tables, [0] * 4, lens, scale)
    ks, vs = [p[1] for p in parts], [p[2] for p in parts]
    eager_cache = cache.clone()
    compiled = torch.compile(attn.forward, dynamic=True)
    for step in range(4):
        contexts = [n + step for n in lens]
        meta = metadata(tables, contexts, [1] * 4, block_size)
        meta.backend_state = attn.prepare(meta)
        q, k, v = qkv_views(4, hq, hk, d, dtype)
        window = 9 if step == 3 else None
        out = compiled(q, k, v, cache, meta, scale, window=window)
        eager = attn.forward(q, k, v, eager_cache, meta, scale, window=window)
        for b in range(4):
            ks[b], vs[b] = torch.cat((ks[b], k[b : b + 1])), torch.cat((vs[b], v[b : b + 1]))
            seen = slice(max(0, contexts[b] + 1 - window), None) if window else slice(None)
            want = dense_attention(q[b : b + 1], ks[b][seen], vs[b][seen], contexts[b] - (seen.start or 0), scale)
            torch.testing.assert_close(out[b : b + 1].double(), want, **TOL[dtype], msg=lambda m: f"step {step}, {b}: {m}")
        torch.testing.assert_close(out, eager, **TOL[dtype])
        assert torch.equal(cache, eager_cache)


@pytest.mark.parametrize("hq,hk,d,block_size,dtype", [(9, 3, 64, 16, torch.float32), (8, 1, 128, 1, torch.float32),
                                                      (4, 4, 80, 16, torch.bfloat16)],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_the_decode_kernel_over_contexts_of_several_chunks(hq, hk, d, block_size, dtype):
    """``chitu_cpu.decode_kernel`` cuts contexts into chunks (at most 512 positions, about four a thread)
    whose softmax partials it combines: lengths at and around the cuts, a batch of one (the most
    chunks) and of several, a window that starts inside a chunk, the new token's key stored before the
    reads (its slot holds the sentinel until then)."""
    attn = CpuSdpaAttention(hq, hk, d, block_size, dtype, torch.device("cpu"))
    scale = 1 / math.sqrt(d)
    for lens, window in (([1100], None), ([1, 16, 17, 513], None), ([700, 40], 300)):
        tables, num_blocks = allocate_blocks(lens, block_size, spare=2)
        cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
        contexts = [n - 1 for n in lens]
        keys = [torch.randn(n, hk, d, dtype=torch.float64).to(dtype) for n in lens]
        values = [torch.randn(n, hk, d, dtype=torch.float64).to(dtype) for n in lens]
        for b, n in enumerate(lens):  # the contexts, written as a prefill would
            pos = torch.arange(n - 1)
            blocks, offsets = tables[b].long()[pos // block_size], pos % block_size
            cache[0, blocks, offsets], cache[1, blocks, offsets] = keys[b][:-1], values[b][:-1]
        meta = metadata(tables, contexts, [1] * len(lens), block_size)
        meta.backend_state = attn.prepare(meta)
        assert type(meta.backend_state).__name__ == "DecodePlan"
        q = torch.randn(len(lens), hq, d, dtype=torch.float64).to(dtype)
        k = torch.stack([x[-1] for x in keys])
        v = torch.stack([x[-1] for x in values])
        out = attn.forward(q, k, v, cache, meta, scale, window=window)
        for b, n in enumerate(lens):
            seen = slice(max(0, n - window), None) if window else slice(None)
            want = dense_attention(q[b : b + 1], keys[b][seen], values[b][seen], n - 1 - (seen.start or 0), scale)
            torch.testing.assert_close(out[b : b + 1].double(), want, **TOL[dtype],
                                       msg=lambda m: f"lens {lens}, sequence {b}: {m}")
            slot = int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
            assert torch.equal(cache.view(2, -1, hk, d)[:, slot], torch.stack((k[b], v[b])))


@pytest.mark.parametrize("path", ["decode_kernel", "portable", "compiled", "compiled-portable"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=lambda v: str(v).removeprefix("torch."))
def test_a_float32_model_with_a_16bit_cache(cache_dtype, path):
    """Contract 1.15: a float32 model's cache in float16 or bfloat16 holds every key and value rounded to it
    (to nearest even), and every step (prefills, decodes through the kernel or SDPA, eager or compiled, a
    chunked prefill) attends in float32 over what it holds, the new tokens included."""
    hq, hk, d, block_size = 6, 2, 64, 16
    attn = CpuSdpaAttention(hq, hk, d, block_size, torch.float32, torch.device("cpu"))
    attn.set_kv_cache_dtype(str(cache_dtype).removeprefix("torch."))
    assert attn.bytes_per_block() * 2 == CpuSdpaAttention(hq, hk, d, block_size, torch.float32,
                                                          torch.device("cpu")).bytes_per_block()
    scale, lens = 1 / math.sqrt(d), [15, 1, 40]
    tables, num_blocks = allocate_blocks([n + 12 for n in lens], block_size, spare=2)
    cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
    assert cache.dtype == cache_dtype and attn.decode_kernel
    attn.decode_kernel = path in ("decode_kernel", "compiled")
    forward = torch.compile(attn.forward, dynamic=True) if path.startswith("compiled") else attn.forward
    ks, vs = [torch.empty(0, hk, d)] * 3, [torch.empty(0, hk, d)] * 3  # each sequence's, as the cache rounds them
    steps = [([0] * 3, lens)] + [([n + i for n in lens], [1] * 3) for i in range(3)] + [([n + 3 for n in lens], [2, 1, 5])]
    for contexts, news in steps:
        meta = metadata(tables, contexts, news, block_size)
        meta.backend_state = attn.prepare(meta)
        q, k, v = qkv_views(sum(news), hq, hk, d, torch.float32)
        out = (forward if max(news) == 1 else attn.forward)(q, k, v, cache, meta, scale)
        bounds = meta.query_start_loc.tolist()
        for b in range(3):
            a, e = bounds[b], bounds[b + 1]
            ks[b] = torch.cat((ks[b], k[a:e].to(cache_dtype).float()))
            vs[b] = torch.cat((vs[b], v[a:e].to(cache_dtype).float()))
            want = dense_attention(q[a:e], ks[b], vs[b], contexts[b], scale)
            torch.testing.assert_close(out[a:e].double(), want, **TOL[torch.float32],
                                       msg=lambda m: f"{news}, sequence {b}: {m}")
    for b in range(3):  # the cache holds the rounded keys and values at each sequence's slots
        pos = torch.arange(ks[b].shape[0])
        blocks, offsets = tables[b].long()[pos // block_size], pos % block_size
        assert torch.equal(cache[0, blocks, offsets], ks[b].to(cache_dtype))
        assert torch.equal(cache[1, blocks, offsets], vs[b].to(cache_dtype))


def test_a_16bit_cache_is_refused_where_not_declared_and_for_a_16bit_model():
    """Contract 1.15: the request names the class and what it lacks; a 16-bit model's own dtype is "auto"."""
    class Older(CpuSdpaAttention):
        supports_16bit_kv_cache = False

    with pytest.raises(ChituError, match=r"^attention backend 'sdpa' \(test_attention\.test_a_16bit_cache_is_refused.*"
                       r"does not support a float16 KV cache under a float32 model \(it does not set "
                       r"supports_16bit_kv_cache\); use kv_cache_dtype='auto'$"):
        Older(4, 2, 64, 16, torch.float32, torch.device("cpu")).set_kv_cache_dtype("float16")
    bf16 = CpuSdpaAttention(4, 2, 64, 16, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ChituError, match="does not support a float16 KV cache under a bfloat16 model; use"):
        bf16.set_kv_cache_dtype("float16")
    bf16.set_kv_cache_dtype("bfloat16")
    assert bf16.kv_cache_dtype == torch.bfloat16


def test_without_a_compiler_decode_steps_take_the_portable_path(monkeypatch, caplog):
    """No C++ compiler: one warning that names it, then decode steps through SDPA, still exact."""
    from chitu_cpu import decode_kernel

    monkeypatch.setenv("CXX", "no-such-compiler")
    decode_kernel.decode_kernel.cache_clear()
    try:
        attn = CpuSdpaAttention(4, 2, 64, 16, torch.float32, torch.device("cpu"))
        with caplog.at_level("WARNING"):
            cache = attn.allocate_kv_cache(8).fill_(SENTINEL)
        assert not attn.decode_kernel and "no-such-compiler" in caplog.text
        tables, _ = allocate_blocks([5], 16, spare=0)
        _, [(_, k0, v0)] = run_step(attn, cache, tables, [0], [4], 1 / 8)
        meta = metadata(tables, [4], [1], 16)
        assert type(attn.prepare(meta)).__name__ == "CpuStepState"
        out, [(q, k, v)] = run_step(attn, cache, tables, [4], [1], 1 / 8)
        want = dense_attention(q, torch.cat((k0, k)), torch.cat((v0, v)), 4, 1 / 8)
        torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    finally:
        decode_kernel.decode_kernel.cache_clear()
