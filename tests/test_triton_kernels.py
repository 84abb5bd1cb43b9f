"""The portable Triton kernels (``chitu_core.kernels.triton``) against the float64 reference, on the CPU.

They run under Triton's interpreter: TRITON_INTERPRET=1 is set only while this module imports
triton and the kernels (Triton reads it when a kernel is defined) and while its tests run, so other
tests never see it. The cases reuse the op and attention tests' builders: non-contiguous inputs whose
gaps hold NaN, shuffled block tables padded with other sequences' ids, a sentinel-filled cache, mixed
prefill/decode batches.
"""

import contextlib
import importlib.util
import math
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton): the Triton kernel tests need it", allow_module_level=True)

from chitu_core.attention.reference import write_kv as reference_write_kv
from chitu_core.ops import reference
from test_attention import SENTINEL, allocate_blocks, dense_attention, metadata, qkv_views, run_step
from test_ops import LAYOUTS, TOL, assert_unmodified, randn, rotary_inputs, snapshot, strided, upcast


@contextlib.contextmanager
def interpreter():
    """TRITON_INTERPRET=1 for the block, restored after."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before this module without TRITON_INTERPRET=1, so its kernels would compile "
                "for a device; run this file in a process of its own", allow_module_level=True)
with interpreter():  # triton's own library and our kernels are defined as interpreted functions
    import chitu_core.kernels.triton.attention as attention
    import chitu_core.kernels.triton.kv_cache as kv_cache
    import chitu_core.kernels.triton.ops as triton_ops
    import chitu_core.kernels.triton.paged_attention as paged_attention
    import chitu_core.kernels.triton.rotary as rotary


@pytest.fixture(autouse=True)
def _interpret():
    """Triton also reads the variable while kernels run (e.g. when it imports more of itself)."""
    with interpreter():
        yield


# float32 only: triton 3.9's interpreter truncates float32 -> bfloat16 casts (a GPU rounds to nearest)
# and multiplies bfloat16 tl.dot operands as raw 16-bit integers, so bfloat16 accuracy is checked on
# the GPU (plugins/nvidia/scripts/gpu_check.py); here bfloat16 only moves through exact copies.
DTYPE = torch.float32


def check_op(name: str, args: tuple, kwargs: dict, dtype: torch.dtype) -> None:
    """The Triton op leaves its inputs alone and matches the float64 reference within dtype's tolerance."""
    snap = snapshot(args)
    got = triton_ops.TRITON_OPS[name](*args, **kwargs)
    assert_unmodified(snap)
    want = getattr(reference, name)(*[upcast(a) for a in args], **kwargs)
    for g, w in zip(*((got, want) if isinstance(got, tuple) else ((got,), (want,)))):
        assert g.dtype == dtype and g.shape == w.shape
        torch.testing.assert_close(g.double(), w, **TOL[dtype])


def test_rms_norms():
    dtype = DTYPE
    for shape, x_layout, r_layout, scale in [
        ((1, 1), "contiguous", "strided", 3.0), ((7, 96), "strided", "transposed", 3.0),
        ((3, 5, 33), "transposed", "contiguous", 3.0), ((2, 4096), "contiguous", "strided", 1.0),
        ((4, 9), "contiguous", "contiguous", 1e-3),  # eps matters at 1e-3
    ]:
        x = LAYOUTS[x_layout](randn(*shape, dtype=dtype, scale=scale))
        residual = LAYOUTS[r_layout](randn(*shape, dtype=dtype, scale=scale))
        weight = strided(randn(shape[-1], dtype=dtype) + 1.0)
        check_op("rms_norm", (x, weight, 1e-6), {}, dtype)
        check_op("fused_add_rms_norm", (x, residual, weight, 1e-6), {}, dtype)
        check_op("offset_rms_norm", (x, weight - 1.0, 1e-6), {}, dtype)  # contract 1.6
        check_op("fused_add_offset_rms_norm", (x, residual, weight - 1.0, 1e-6), {}, dtype)
        if scale >= 1.0:  # a mean for LayerNorm to take off (float32 cannot centre 1e-3 spreads around 1.5)
            shifted = x + 1.5
            check_op("layer_norm", (shifted, weight, strided(randn(shape[-1], dtype=dtype)), 1e-5), {}, dtype)
            check_op("layer_norm", (shifted, weight, None, 1e-5), {}, dtype)


def test_norms_read_a_head_slice_of_a_fused_projection_in_place():
    """The q/k norms' input: heads of a fused qkv output, [T, heads, D] with the row stride of the whole
    projection. No 2-D view of it exists; the norm reads it through a 3-D one, not a copy."""
    from chitu_core.kernels.triton.common import as_row_grid

    t, hq, hk, d = 5, 4, 2, 24
    qkv = randn(t, (hq + 2 * hk) * d, dtype=DTYPE, scale=3.0)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    for part in (q, k):
        grid = as_row_grid(part)
        assert grid.data_ptr() == part.data_ptr() and grid.shape == (t, part.shape[1], d)
        weight = randn(d, dtype=DTYPE) + 1.0
        check_op("rms_norm", (part, weight, 1e-6), {}, DTYPE)
        check_op("offset_rms_norm", (part, weight - 1.0, 1e-6), {}, DTYPE)
        check_op("fused_add_rms_norm", (part, randn(t, part.shape[1], d, dtype=DTYPE), weight, 1e-6), {}, DTYPE)
    assert as_row_grid(qkv).shape == (t, 1, qkv.shape[1])  # a 2-D view where one exists


def test_greedy_sample_takes_the_first_maximum_across_chunks():
    """Rows longer than a chunk, maxima tied within and across chunks, strided and transposed
    logits, a NaN: the same indices as torch's argmax."""
    from chitu_core.kernels.triton.argmax import CHUNK

    vocab = 2 * CHUNK + 300
    logits = randn(5, vocab, dtype=DTYPE)
    logits[0, [CHUNK - 1, CHUNK + 5]] = 50.0  # tie across chunks: the first chunk's
    logits[1, [CHUNK + 7, CHUNK + 3]] = 50.0  # tie within a chunk: the lower index
    logits[2, 2 * CHUNK + 299] = 50.0  # in the last, partial chunk
    logits[3] = 1.5  # all equal
    logits[4, 17] = float("nan")
    for x in (logits, LAYOUTS["strided"](logits), LAYOUTS["transposed"](logits)):
        got = triton_ops.TRITON_OPS["greedy_sample"](x)
        assert got.dtype == torch.int64 and got.tolist() == x.argmax(-1).tolist() == [CHUNK - 1, CHUNK + 3,
                                                                                      2 * CHUNK + 299, 0, 17]
    small = randn(3, 17, dtype=torch.bfloat16)
    assert torch.equal(triton_ops.TRITON_OPS["greedy_sample"](small), small.argmax(-1))


def test_activations():
    dtype = DTYPE
    for shape, layout in [((1, 2), "contiguous"), ((7, 26), "transposed"), ((2, 3, 14), "strided"),
                          ((3, 2200), "contiguous")]:  # 2200: two column blocks of 1024 and a tail
        x = LAYOUTS[layout](randn(*shape, dtype=dtype, scale=2.0))
        check_op("silu_and_mul", (x,), {}, dtype)
        for approximate in ("none", "tanh"):
            check_op("gelu_and_mul", (x,), dict(approximate=approximate), dtype)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding(is_neox):
    dtype = DTYPE
    for t, hq, hk, d, rot, layout in [(1, 1, 1, 2, 2, "contiguous"), (7, 4, 2, 64, 64, "sliced"),
                                      (5, 3, 1, 40, 24, "sliced"), (4, 8, 2, 64, 32, "contiguous")]:
        check_op("rotary_embedding", rotary_inputs(dtype, t, hq, hk, d, rot, layout), dict(is_neox=is_neox), dtype)


def cache_with_slots(t: int, hk: int, d: int, block_size: int, dtype: torch.dtype):
    """A sentinel-filled [2, 5, block_size, hk, d] cache and t distinct random slots, the last one -1 (padding)."""
    cache = torch.full((2, 5, block_size, hk, d), SENTINEL, dtype=dtype)
    slots = torch.randperm(5 * block_size)[:t]
    slots[-1] = -1
    return cache, slots


def test_write_kv_stores_at_the_slots_and_skips_padding():
    _, k, v = qkv_views(6, 4, 2, 64, torch.float32)
    cache, slots = cache_with_slots(6, 2, 64, 16, torch.float32)
    want = cache.clone()
    reference_write_kv(want, k[:-1], v[:-1], slots[:-1])
    kv_cache.write_kv(cache, k, v, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_fused_with_the_cache_write(is_neox):
    positions, q, k, cos_sin = rotary_inputs(torch.bfloat16, 6, 4, 2, 40, 24, "sliced")
    v = randn(6, 2, 40, dtype=torch.bfloat16)
    cache, slots = cache_with_slots(6, 2, 40, 8, torch.bfloat16)
    got_q, got_k = rotary.rotary_embedding_and_write_kv(positions, q, k, v, cos_sin, is_neox, cache, slots)
    want_q, want_k = rotary.rotary_embedding(positions, q, k, cos_sin, is_neox)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    want = torch.full_like(cache, SENTINEL)
    reference_write_kv(want, want_k[:-1], v[:-1], slots[:-1])
    assert torch.equal(cache, want)


# ----- paged attention: the flow of tests/test_attention.py on a smaller batch (the interpreter is slow) -----

# (context_len, new tokens): prefills, decodes, chunked prefills; lengths leave last blocks partial.
BATCH = [(0, 23), (1, 1), (90, 1), (40, 37), (16, 16), (5, 1), (0, 1), (63, 9)]
CONFIGS = [  # (num_heads, num_kv_heads, head_dim, block_size): GQA 1 and 4, head_dim 64 (and 40, unpadded)
    (4, 4, 64, 16), (8, 2, 64, 16), (4, 1, 40, 8), (8, 2, 64, 1),
]
ATTN_TOL = dict(rtol=1e-5, atol=1e-5)  # float32 accumulation, as tests/test_attention.py


def make_attention(hq, hk, d, block_size, num_splits=None):
    attn = attention.TritonPagedAttention(hq, hk, d, block_size, DTYPE, torch.device("cpu"))
    attn.force_num_splits = num_splits
    return attn


def fill_contexts(attn, cache, tables, contexts, scale):
    """Prefill each sequence's context alone, checking it; returns {sequence: (keys, values)}."""
    written = {}
    for b, c in enumerate(contexts):
        if c:
            out, [(q, k, v)] = run_step(attn, cache, tables[b : b + 1], [0], [c], scale)
            torch.testing.assert_close(out.double(), dense_attention(q, k, v, 0, scale), **ATTN_TOL)
            written[b] = (k, v)
    return written


def check_step(attn, cache, tables, contexts, news, written, scale):
    """Run one step over every sequence and compare each with dense attention over its whole history."""
    out, parts = run_step(attn, cache, tables, contexts, news, scale)
    history = []
    for b, (q, k, v) in enumerate(parts):
        ctx_k, ctx_v = written.get(b, (k[:0], v[:0]))
        history.append((torch.cat((ctx_k, k)), torch.cat((ctx_v, v))))
        want = dense_attention(q, *history[b], contexts[b], scale)
        got = out[sum(news[:b]) : sum(news[: b + 1])]
        torch.testing.assert_close(got.double(), want, **ATTN_TOL, msg=lambda m: f"sequence {b}: {m}")
    return history


@pytest.mark.parametrize("hq,hk,d,block_size", CONFIGS)
def test_paged_attention_mixed_batch(hq, hk, d, block_size):
    attn = make_attention(hq, hk, d, block_size)
    scale = 1 / math.sqrt(d)
    contexts, news = [c for c, _ in BATCH], [n for _, n in BATCH]
    tables, num_blocks = allocate_blocks([c + n for c, n in BATCH], block_size, spare=3)
    cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
    assert cache.shape == attn.kv_cache_shape(num_blocks)
    written = fill_contexts(attn, cache, tables, contexts, scale)
    history = check_step(attn, cache, tables, contexts, news, written, scale)
    expected = torch.full_like(cache, SENTINEL)
    for b, (keys, values) in enumerate(history):
        pos = torch.arange(keys.shape[0])
        blocks, offsets = tables[b].long()[pos // block_size], pos % block_size
        expected[0, blocks, offsets], expected[1, blocks, offsets] = keys, values
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("num_splits", [3, 8])
def test_split_kv_decode(num_splits):
    """A decode step through the split-KV kernels (forced), contexts from 1 to 260 keys in float32 tiles
    of 32: some splits get no keys at all."""
    hq, hk, d, block_size = 8, 2, 64, 16
    scale = 1 / math.sqrt(d)
    contexts = [150, 1, 70, 260]
    tables, num_blocks = allocate_blocks([c + 1 for c in contexts], block_size, spare=2)
    unsplit = make_attention(hq, hk, d, block_size)
    cache = unsplit.allocate_kv_cache(num_blocks).fill_(SENTINEL)
    written = fill_contexts(unsplit, cache, tables, contexts, scale)
    attn = make_attention(hq, hk, d, block_size, num_splits)
    assert attn.prepare(metadata(tables, contexts, [1] * 4, block_size)).plan.num_splits == num_splits
    check_step(attn, cache, tables, contexts, [1] * 4, written, scale)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_grid_equals_the_general_grid(num_splits):
    """A pure decode step's plan takes the decode grid (a program per sequence and kv head, no search, values
    loaded with keys); the general grid on the same step gives the same bits, and both the dense answer."""
    import dataclasses

    hq, hk, d, block_size = 8, 2, 64, 16
    scale = 1 / math.sqrt(d)
    contexts = [150, 1, 70, 260, 0]
    tables, num_blocks = allocate_blocks([c + 1 for c in contexts], block_size, spare=2)
    attn = make_attention(hq, hk, d, block_size, num_splits)
    cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
    # The contexts' prefill without a forced split (the interpreter runs a split prefill's reduction program by
    # program: 20 s); the decode step below takes the forced split.
    written = fill_contexts(make_attention(hq, hk, d, block_size), cache, tables, contexts, scale)
    meta = metadata(tables, contexts, [1] * 5, block_size)
    step = attn.prepare(meta)
    assert step.plan.decode and not attn.prepare(metadata(tables, contexts, [1, 1, 2, 1, 1], block_size)).plan.decode
    q, k, v = qkv_views(5, hq, hk, d, DTYPE)
    attn.forward(q, k, v, cache, meta, scale)  # writes the new keys and values; then attend on both grids
    outs = []
    for plan in (step.plan, dataclasses.replace(step.plan, decode=False)):
        meta.backend_state = dataclasses.replace(step, plan=plan)
        outs.append(attn.attend(q, cache, meta, scale))
    assert torch.equal(outs[0], outs[1])
    for b, c in enumerate(contexts):
        ctx_k, ctx_v = written.get(b, (k[:0], v[:0]))
        want = dense_attention(q[b : b + 1], torch.cat((ctx_k, k[b : b + 1])), torch.cat((ctx_v, v[b : b + 1])), c, scale)
        torch.testing.assert_close(outs[0][b : b + 1].double(), want, **ATTN_TOL)


def test_one_sequence_alone_splits_its_keys_by_the_plan():
    """A sequence decoding alone: the plan itself (nothing forced) splits 300 keys into ranges of at least
    64 (MIN_SPLIT_KEYS_ALONE), and the split step matches dense float64 attention."""
    hq, hk, d, block_size = 8, 2, 64, 16
    scale = 1 / math.sqrt(d)
    contexts = [300]
    tables, num_blocks = allocate_blocks([c + 1 for c in contexts], block_size, spare=2)
    attn = make_attention(hq, hk, d, block_size)
    cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
    written = fill_contexts(attn, cache, tables, contexts, scale)
    assert attn.prepare(metadata(tables, contexts, [1], block_size)).plan.num_splits == 4  # 301 keys // 64
    check_step(attn, cache, tables, contexts, [1], written, scale)


@pytest.mark.parametrize("softcap,window,num_splits", [(2.0, None, None), (None, 8, None), (1.5, 16, None),
                                                       (1.5, 16, 3)])
def test_paged_attention_variants(softcap, window, num_splits):
    """Contract 1.6: the logit cap and the sliding window (narrower than the contexts, so that whole tiles
    fall before it) against dense float64 attention with both, unsplit and split-KV."""
    from chitu_core.conformance.attention_cases import dense_attention as dense_with_variants

    hq, hk, d, block_size = 8, 2, 64, 16
    scale = 1 / math.sqrt(d)
    batch = BATCH if num_splits is None else [(150, 1), (1, 1), (70, 1), (260, 1)]
    contexts, news = [c for c, _ in batch], [n for _, n in batch]
    tables, num_blocks = allocate_blocks([c + n for c, n in batch], block_size, spare=3)
    unsplit = make_attention(hq, hk, d, block_size)
    cache = unsplit.allocate_kv_cache(num_blocks).fill_(SENTINEL)
    written = fill_contexts(unsplit, cache, tables, contexts, scale)
    attn = make_attention(hq, hk, d, block_size, num_splits)
    meta = metadata(tables, contexts, news, block_size)
    meta.backend_state = attn.prepare(meta)
    assert meta.backend_state.plan.num_splits == (num_splits or 1)
    q, k, v = qkv_views(sum(news), hq, hk, d, DTYPE)
    out = attn.forward(q, k, v, cache, meta, scale, softcap=softcap, window=window)
    bounds = meta.query_start_loc.tolist()
    for b in range(len(batch)):
        a, e = bounds[b], bounds[b + 1]
        ctx_k, ctx_v = written.get(b, (k[:0], v[:0]))
        want = dense_with_variants(q[a:e], torch.cat((ctx_k, k[a:e])), torch.cat((ctx_v, v[a:e])), contexts[b], scale,
                                   softcap, window)
        torch.testing.assert_close(out[a:e].double(), want, **ATTN_TOL, msg=lambda m: f"sequence {b}: {m}")


def test_plan_splits_only_underfilled_long_decodes():
    plan = paged_attention.plan  # (num_heads, num_kv_heads, max_query_len, num_seqs, max_seq_len, compute units)
    assert plan(8, 2, 1, 4, 601, 16).num_splits == 2  # 8 programs for 32 slots; 601 keys: two ranges of >= 256
    assert plan(32, 8, 1, 1, 4096, 132).num_splits == 16
    assert plan(32, 8, 1, 64, 4096, 132).num_splits == 1  # 512 programs fill 132 units
    assert plan(32, 8, 1, 2, 300, 132).num_splits == 1  # short contexts of a batch: ranges of >= 256 keys
    assert plan(32, 8, 1, 1, 300, 132).num_splits == 4  # one sequence alone: ranges of >= 64 keys
    assert plan(32, 8, 1, 1, 127, 132).num_splits == 1  # fewer than two ranges of 64
    assert plan(32, 8, 2, 1, 4096, 132).num_splits == 1  # not a pure decode step
    assert (plan(32, 8, 1, 1, 100, 132).block_m, plan(32, 8, 512, 1, 512, 132).block_m) == (16, 64)
    assert (plan(32, 8, 1, 1, 100, 132).block_n, plan(32, 8, 1, 1, 100, 132, dtype_bytes=4).block_n) == (64, 32)
    # Wide rows (head_dim 256 in float32: 1 KB a key) take smaller tiles, to fit shared memory.
    wide = plan(2, 1, 64, 1, 64, 132, dtype_bytes=4, head_dim=256)
    assert (wide.block_m, wide.block_n) == (32, 16)
    # A device's decode_stages apply to decode-sized plans only; prefill keeps Triton's default.
    tiles = paged_attention.TileConfig(decode_stages=2)
    assert plan(32, 8, 1, 64, 300, 132, tiles=tiles).num_stages == 2
    assert plan(32, 8, 512, 1, 512, 132, tiles=tiles).num_stages is None
    assert plan(32, 8, 1, 64, 300, 132).num_stages is None
    # A device's decode_fill bounds the programs per unit a split makes (Qwen3-1.7B, 4 sequences of 8,000
    # tokens: 32 programs, 8 ranges for at most 2 a unit, 12 for 3, 16 for 4; 32 sequences: 2 ranges for 4,
    # not 3); whether to split at all stays "fewer than 2".
    assert plan(16, 8, 1, 4, 8000, 132).num_splits == 8
    assert plan(16, 8, 1, 4, 8000, 132, tiles=paged_attention.TileConfig(decode_fill=3)).num_splits == 12
    assert plan(16, 8, 1, 4, 8000, 132, tiles=paged_attention.TileConfig(decode_fill=4)).num_splits == 16
    assert plan(16, 8, 1, 32, 8000, 132, tiles=paged_attention.TileConfig(decode_fill=4)).num_splits == 2
    assert plan(32, 8, 1, 33, 8000, 132, tiles=paged_attention.TileConfig(decode_fill=3)).num_splits == 1


def test_warmup_runs_every_tile_variant_the_planner_picks(monkeypatch):
    """Prefill tiles, decode tiles and split decode: each runs once, on a stand-in cache."""
    seen = []

    def recording(q, cache, tables, seq_lens, qsl, scale, step, *rest):
        seen.append((step.block_m, step.num_splits > 1))
        return paged_attention.paged_attention(q, cache, tables, seq_lens, qsl, scale, step, *rest)

    monkeypatch.setattr(attention, "paged_attention", recording)
    make_attention(8, 2, 64, 16).warmup()
    planner = {(p.block_m, p.num_splits > 1) for p in (paged_attention.plan(8, 2, 512, 4, 512, 16),
                                                        paged_attention.plan(8, 2, 1, 64, 512, 16),
                                                        paged_attention.plan(8, 2, 1, 1, 4096, 16))}
    assert sorted(seen) == sorted(planner) == [(16, False), (16, True), (64, False)]


def fused_rotary_step(hq=8, hk=2, d=64, block_size=16):
    """Two prefills (20 and 7 tokens) planned on the Triton attention: (attn, meta, num_blocks,
    positions, q, k, v, cos_sin)."""
    tables, num_blocks = allocate_blocks([20, 7], block_size, spare=1)
    meta = metadata(tables, [0, 0], [20, 7], block_size)
    positions, q, k, cos_sin = rotary_inputs(torch.float32, 27, hq, hk, d, d, "sliced")
    v = randn(27, hk, d)
    attn = make_attention(hq, hk, d, block_size)
    meta.backend_state = attn.prepare(meta)
    return attn, meta, num_blocks, positions, q, k, v, cos_sin


def test_fused_rotary_then_attend_equals_rotary_then_forward():
    attn, meta, num_blocks, positions, q, k, v, cos_sin = fused_rotary_step()
    scale = 1 / math.sqrt(q.shape[-1])
    fused_cache, cache = (attn.allocate_kv_cache(num_blocks).fill_(SENTINEL) for _ in range(2))
    fq, _ = attn.rotary_and_write_kv(positions, q, k, v, cos_sin, True, fused_cache, meta)
    got = attn.attend(fq, fused_cache, meta, scale)
    rq, rk = rotary.rotary_embedding(positions, q, k, cos_sin, True)
    want = attn.forward(rq, rk, v, cache, meta, scale)
    assert torch.equal(fused_cache, cache) and torch.equal(got, want)


def test_attention_layer_fuses_rotary_where_the_backend_does(monkeypatch):
    """The model's attention layer hands RoPE to a backend that fuses it with the cache write, and gets
    exactly what the separate rotary op followed by ``forward`` gives."""
    from types import SimpleNamespace

    from chitu_core.layers.attention import Attention
    from chitu_core.layers.context import StepContext

    attn, meta, num_blocks, positions, q, k, v, cos_sin = fused_rotary_step()
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    rope = SimpleNamespace(cos_sin_cache=cos_sin, is_neox=True)
    rope_calls = []

    def apply_rope(pos, q_, k_):
        rope_calls.append(1)
        return rotary.rotary_embedding(pos, q_, k_, cos_sin, True)

    rope.__call__ = apply_rope
    layer = Attention(hq, hk, d, 0, SimpleNamespace(attention=attn))
    outs, caches = [], []
    for fused in (True, False):
        monkeypatch.setattr(type(attn), "fuses_rotary", fused)
        cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
        outs.append(layer(q, k, v, StepContext(meta, [cache]), SimpleNamespace(**vars(rope)) if fused else apply_rope,
                          positions))
        caches.append(cache)
    assert rope_calls == [1]  # only the unfused run used the rotary op
    assert torch.equal(caches[0], caches[1]) and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("is_neox, rot", [(True, 64), (False, 64), (True, 40)])
def test_fused_qk_norm_is_the_norms_then_the_rotary(is_neox, rot):
    """Contract 1.12: ``rotary_and_write_kv(..., qk_norm=...)`` gives what the rms_norm op of each head of q
    and k, then the fused rotary write, give: the returned q and the cache (rotated and pass-through
    channels alike)."""
    attn, meta, num_blocks, _, _, _, v, _ = fused_rotary_step()
    positions, q, k, cos_sin = rotary_inputs(torch.float32, 27, 8, 2, 64, rot, "sliced")
    w_q, w_k, eps = randn(64) + 1.0, randn(64) + 1.0, 1e-5
    fused_cache, cache = (attn.allocate_kv_cache(num_blocks).fill_(SENTINEL) for _ in range(2))
    got, _ = attn.rotary_and_write_kv(positions, q * 3, k / 2, v, cos_sin, is_neox, fused_cache, meta,
                                      qk_norm=(w_q, w_k, eps))
    nq, nk = (torch.nn.functional.rms_norm(x, (64,), w, eps) for x, w in ((q * 3, w_q), (k / 2, w_k)))
    want, _ = attn.rotary_and_write_kv(positions, nq, nk, v, cos_sin, is_neox, cache, meta)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(fused_cache, cache, rtol=2e-6, atol=2e-6)
    assert not torch.allclose(got, attn.rotary_and_write_kv(positions, q * 3, k / 2, v, cos_sin, is_neox, cache,
                                                            meta)[0], atol=1e-2)  # the norms did act


def test_attention_layer_hands_plain_qk_norms_to_a_fusing_backend(monkeypatch):
    """The layer passes Qwen3-style per-head norms to a backend that fuses them (once, in its rotary cache
    write; the norm layers never run) and gets what running them first gives; norms with Gemma's offset
    stay with the layers."""
    from types import SimpleNamespace

    from chitu_core.layers.attention import Attention
    from chitu_core.layers.context import StepContext

    attn, meta, num_blocks, positions, q, k, v, cos_sin = fused_rotary_step()
    rope = SimpleNamespace(cos_sin_cache=cos_sin, is_neox=True)
    layer = Attention(q.shape[1], k.shape[1], q.shape[2], 0, SimpleNamespace(attention=attn))
    runs, weights = [], (randn(q.shape[2]) + 1.0, randn(q.shape[2]) + 1.0)

    class Norm:
        def __init__(self, weight, offset):
            self.weight, self.eps, self.offset = weight, 1e-6, offset

        def __call__(self, x):
            runs.append(self.offset)
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight + self.offset, self.eps)

    outs = []
    for fuses, offset in ((True, False), (False, False), (True, True)):
        monkeypatch.setattr(type(attn), "fuses_qk_norm", fuses)
        cache = attn.allocate_kv_cache(num_blocks).fill_(SENTINEL)
        norms = tuple(Norm(w, offset) for w in weights)
        outs.append((layer(q, k, v, StepContext(meta, [cache]), rope, positions, norms), cache))
    assert runs == [False, False, True, True]  # the unfused run's two norms and the offset ones; the fused none
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=2e-6, atol=2e-6)


def test_fused_rotary_conformance_rows_pass_and_catch_a_skipped_norm():
    """The suite's ``attention/NAME/rotary`` rows (chitu_core/conformance/rotary_attention_cases.py) pass on the
    Triton attention; a backend that declares ``fuses_qk_norm`` but ignores ``qk_norm`` fails the norm rows
    only, and one that writes its keys unrotated fails them all."""
    from chitu_core.conformance.case import Target
    from chitu_core.conformance.runner import Session, build_cases
    from chitu_core.conformance.thresholds import ThresholdBook
    from chitu_core.ops.table import resolve_ops
    from chitu_cpu.backend import CpuBackend

    class SkipsNorm(attention.TritonPagedAttention):
        def rotary_and_write_kv(self, *args, qk_norm=None, **kwargs):
            return super().rotary_and_write_kv(*args, **kwargs)

    class Unrotated(attention.TritonPagedAttention):
        def rotary_and_write_kv(self, positions, q, k, v, cos_sin, is_neox, cache, meta, **kwargs):
            rotated, _ = super().rotary_and_write_kv(positions, q, k, v, cos_sin, is_neox, cache, meta, **kwargs)
            kv_cache.write_kv(k, v, cache, meta.slot_mapping)  # the keys as they came
            return rotated, k

    def statuses(attn_cls):
        backend = CpuBackend()
        backend.attention_backends = lambda: {"triton": attn_cls}
        target = Target(backend, resolve_ops("cpu", backend.native_ops()), torch.device("cpu"), ThresholdBook())
        results = Session(target, build_cases(target, (torch.float32,), "attention/triton/rotary*")).run_all()
        return {r.row: r.status for r in results if r.status != "pass"}, len(results)

    assert statuses(attention.TritonPagedAttention) == ({}, 5)
    assert statuses(SkipsNorm)[0] == {"attention/triton/rotary+qk_norm": "fail"}
    assert set(statuses(Unrotated)[0].values()) == {"fail"} and len(statuses(Unrotated)[0]) == 2


def test_graph_prefill_conformance_rows_pass_and_catch_unfinished_padding():
    """The suite's ``attention/NAME/graph-prefill`` rows (contract 1.16: a prefill graph's layout, bounds for
    maxima, the padding's own sequence, empty sequence slots) pass on the Triton attention, which sets
    ``captures_prefill``; one that leaves the padding's rows unfinished fails them all."""
    from chitu_core.conformance.case import Target
    from chitu_core.conformance.runner import Session, build_cases
    from chitu_core.conformance.thresholds import ThresholdBook
    from chitu_core.ops.table import resolve_ops
    from chitu_cpu.backend import CpuBackend

    class PaddingUnfinished(attention.TritonPagedAttention):
        def attend(self, q, kv_cache, meta, scale, *args, **kwargs):
            out = super().attend(q, kv_cache, meta, scale, *args, **kwargs)
            return out.masked_fill((meta.slot_mapping < 0)[:, None, None], float("nan"))

    def statuses(attn_cls):
        backend = CpuBackend()
        backend.attention_backends = lambda: {"triton": attn_cls}
        target = Target(backend, resolve_ops("cpu", backend.native_ops()), torch.device("cpu"), ThresholdBook())
        results = Session(target, build_cases(target, (torch.float32,), "attention/triton/graph-prefill")).run_all()
        return [r.status for r in results]

    assert attention.TritonPagedAttention.captures_prefill
    assert statuses(attention.TritonPagedAttention) == ["pass"] * 3
    assert statuses(PaddingUnfinished) == ["fail"] * 3
