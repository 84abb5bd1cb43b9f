"""The engine under load: staggered mixed requests equal their solo runs; the KV pool always drains;
the prefix cache computes only what is new."""

import random

import pytest

from builders import build_model
from chitu_core import LLM, SamplingParams
from chitu_core.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-llama")
    build_model(path, "llama", max_position_embeddings=2048)
    return path


def engine(path, **kw) -> LLMEngine:
    return LLM(path, device="cpu", dtype="float32", load_progress=False, **kw).engine


def assert_pool_full(eng: LLMEngine) -> None:
    bm = eng.block_manager
    assert not eng.scheduler.has_unfinished() and not eng.requests
    assert bm.num_free == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def random_requests(count: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(512) for _ in range(rng.randint(1, 200))]
        max_tokens = rng.randint(1, 40)
        if i % 2:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=rng.choice([0, 20]),
                                    top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(1 << 30), ignore_eos=True)
        out.append((prompt, params))
    return out


def solo(eng: LLMEngine, prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
    request = eng.add_request(rid, prompt, params)
    while not request.finished:
        eng.step()
    return request.seqs[0].output_token_ids


def staggered_run(eng: LLMEngine, reqs, seed: int, abort_every: int = 0):
    """Submit a few requests before each step, at random; optionally abort some midway."""
    rng = random.Random(seed)
    pending = list(enumerate(reqs))
    live, aborted = {}, set()
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if pending:
                i, (prompt, params) = pending.pop(0)
                live[i] = eng.add_request(f"mixed-{i}", prompt, params)
        eng.step()
        if abort_every:
            for i, request in list(live.items()):
                if i % abort_every == 0 and not request.finished and request.seqs[0].output_token_ids and i not in aborted:
                    assert eng.abort_request(request.request_id)
                    aborted.add(i)
    return live, aborted


def test_sixty_four_staggered_requests_equal_their_solo_runs(model_path):
    reqs = random_requests(64, seed=1)
    # A small token budget forces chunked prefills beside decodes.
    mixed = engine(model_path, max_num_batched_tokens=96, max_num_seqs=24)
    live, _ = staggered_run(mixed, reqs, seed=2)
    alone = engine(model_path, enable_prefix_caching=False)
    for i, (prompt, params) in enumerate(reqs):
        want = solo(alone, prompt, params, f"solo-{i}")
        got = live[i].seqs[0].output_token_ids
        assert got == want, f"request {i} ({'greedy' if params.greedy else 'seeded'}) differs from its solo run"
        assert len(got) == params.max_tokens and live[i].seqs[0].finish_reason == "length"
    assert mixed.stats.num_steps > 64 and mixed.stats.num_generated_tokens == sum(p.max_tokens for _, p in reqs)
    assert_pool_full(mixed)
    assert_pool_full(alone)


def test_aborts_free_everything(model_path):
    eng = engine(model_path, max_num_batched_tokens=64)
    live, aborted = staggered_run(eng, random_requests(24, seed=3), seed=4, abort_every=3)
    assert len(aborted) >= 4
    for i in aborted:
        assert all(s.finish_reason == "abort" for s in live[i].seqs)
    assert not eng.abort_request("mixed-0")  # already gone
    assert_pool_full(eng)


def test_preemption_under_a_tight_cache_keeps_outputs_and_drains(model_path):
    reqs = random_requests(16, seed=5)
    reference = engine(model_path)
    want = [solo(reference, p, s, f"ref-{i}") for i, (p, s) in enumerate(reqs)]
    per_block = reference.attention.bytes_per_block() * 2
    tight = engine(model_path, kv_cache_memory=per_block * 20, block_size=16, max_model_len=320)
    live, _ = staggered_run(tight, reqs, seed=6)
    assert tight.scheduler.num_preemptions > 0
    assert [live[i].seqs[0].output_token_ids for i in range(len(reqs))] == want
    assert_pool_full(tight)


def test_prefix_cache_computes_only_the_new_tokens(model_path):
    rng = random.Random(7)
    prefix = [rng.randrange(512) for _ in range(1000)]
    first = prefix + [rng.randrange(512) for _ in range(10)]
    second = prefix + [rng.randrange(512) for _ in range(23)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cached = engine(model_path, block_size=8)  # 1000 tokens are exactly 125 blocks
    solo(cached, first, params, "first")
    request = cached.add_request("second", second, params)
    while not request.finished:
        cached.step()
    assert request.metrics.num_computed_prompt_tokens == 23
    assert cached.stats.prefix_cache_hits == 1000
    uncached = engine(model_path, block_size=8, enable_prefix_caching=False)
    assert request.seqs[0].output_token_ids == solo(uncached, second, params, "second")
    assert_pool_full(cached)


def test_n_samples_share_the_prompt_and_differ(model_path):
    llm = LLM(model_path, device="cpu", dtype="float32", load_progress=False)
    eng = llm.engine
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    result = llm.generate({"prompt_token_ids": list(range(40))}, params)[0]
    assert [o.index for o in result.outputs] == [0, 1, 2, 3]
    samples = [tuple(o.token_ids) for o in result.outputs]
    assert len(set(samples)) == 4 and all(len(s) == 12 for s in samples)
    # The prompt is computed once; each other sample recomputes only its partial last block.
    assert eng.stats.num_prompt_tokens_computed == 40 + 3 * (40 % eng.block_manager.block_size)
    again = llm.generate({"prompt_token_ids": list(range(40))}, params)[0]
    assert [tuple(o.token_ids) for o in again.outputs] == samples  # seeded: reproducible
    assert_pool_full(eng)
