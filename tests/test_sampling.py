"""The batched Sampler on the CPU backend's ops, and the counter-based noise it draws from.

Exact checks: greedy rows are argmax (of the penalized logits when penalties apply), a seeded
request samples the same token whatever batch it is in and whatever penalties or bans its
neighbours have, excluded and banned tokens never come out, logprobs are the raw logits'
log-softmax, the penalty and ban tables hold exactly the given tokens. Statistical checks, on fixed
seeds so they are deterministic: the noise is Exp(1) and its uniforms are uniform, and the sampled
frequencies follow the softmax of the reference-penalized and reference-filtered logits
(chi-square and total variation with fixed bounds).
"""

import pytest
import torch

from chitu_core.ops import reference
from chitu_core.plugins import backend_ops, get_backend
from chitu_core.sampling import noise
from chitu_core.sampling.noise import exponential_noise
from chitu_core.sampling.params import SamplingParams
from chitu_core.sampling.sampler import Sampler, SamplingBatch

OPS = backend_ops(get_backend("cpu"))
CPU = torch.device("cpu")
sampler = Sampler(OPS)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], counters: list[int],
           prompt_ids: list[list[int]] | None = None, output_ids: list[list[int]] | None = None,
           banned_ids: list[list[int]] | None = None):
    empty = [[] for _ in params]
    batch = SamplingBatch.build(params, seeds, counters, CPU, logits.shape[-1], prompt_ids or empty,
                                output_ids or empty, banned_ids or empty)
    return sampler(logits, batch)


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probabilities (support: expected_probs > 0)."""
    n = counts.sum().double()
    support = expected_probs > 0
    expected = n * expected_probs[support]
    chi2 = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, chi2 / 2))


# ----- the noise -----


def test_noise_is_reproducible_and_depends_only_on_seed_and_counter():
    seeds = torch.tensor([0, 7, 7, -3, 2**40 + 7, 2**62])
    counters = torch.tensor([0, 0, 1, 5, 0, 9])
    a = exponential_noise(seeds, counters, 1000)
    assert a.dtype == torch.float32 and a.shape == (6, 1000)
    assert torch.equal(a, exponential_noise(seeds, counters, 1000))
    for i in range(6):  # each row alone, and inside another batch at another position
        assert torch.equal(a[i : i + 1], exponential_noise(seeds[i : i + 1], counters[i : i + 1], 1000))
        other = torch.stack((seeds.flip(0), counters.flip(0)))
        assert torch.equal(a[i], exponential_noise(other[0], other[1], 1000)[5 - i])
    assert torch.equal(a[:, :10], exponential_noise(seeds, counters, 10))  # token i's draw ignores the vocab size
    # Seeds differ (in their high bits too), counters differ: no two rows agree.
    distinct = {tuple(row[:8].tolist()) for row in a}
    assert len(distinct) == 6


def test_noise_is_exponential_with_uniform_uniforms():
    b, vocab = 128, 1 << 16  # 8.4M draws
    seeds = torch.arange(b) * 7919 + 11
    counters = torch.arange(b) % 13
    e = exponential_noise(seeds, counters, vocab).double()
    n = e.numel()
    assert torch.isfinite(e).all() and (e > 0).all()
    # Mean and variance of Exp(1) are 1; their standard errors here are 3.5e-4 and 1e-3.
    assert abs(float(e.mean()) - 1.0) < 2e-3
    assert abs(float(e.var()) - 1.0) < 6e-3
    u = torch.exp(-e)
    counts = torch.histc(u, bins=256, min=0.0, max=1.0)
    assert chi_square_p_value(counts, torch.full((256,), 1 / 256, dtype=torch.float64)) > 1e-4
    assert float((counts - n / 256).abs().max()) < 6 * (n / 256) ** 0.5


@pytest.mark.parametrize("bits", [0, 0xFFFFFFFF])
def test_noise_at_the_extreme_hash_values_is_positive_and_finite(monkeypatch, bits):
    """The largest and smallest hash outputs map to uniforms strictly inside (0, 1)."""
    monkeypatch.setattr(noise, "_fmix32", lambda x: torch.full_like(x, bits))
    e = exponential_noise(torch.tensor([1]), torch.tensor([0]), 4)
    assert torch.isfinite(e).all() and (e > 0).all()


# ----- the sampler -----


def test_greedy_rows_are_argmax():
    logits = torch.randn(6, 300) * 3
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=3),
              SamplingParams(temperature=0.0, seed=3), SamplingParams(temperature=1.2, min_p=0.1)]
    out = sample(logits, params, [1, 2, 3, 4, 5, 6], [0, 0, 4, 2, 9, 1])
    assert out.tokens.dtype == torch.int64 and out.logprobs is None
    greedy = [0, 2, 4]
    assert torch.equal(out.tokens[greedy], logits[greedy].argmax(-1))
    all_greedy = sample(logits, [SamplingParams(temperature=0.0)] * 6, [0] * 6, [0] * 6)
    assert torch.equal(all_greedy.tokens, logits.argmax(-1))


REQUESTS = {  # name: (params, seed, counter); each request has its own logits row
    "plain": (SamplingParams(temperature=1.0), 7, 3),
    "next-step": (SamplingParams(temperature=1.0), 7, 4),
    "greedy": (SamplingParams(temperature=0.0), 1, 0),
    "top-k": (SamplingParams(temperature=0.8, top_k=5), 123, 0),
    "top-p": (SamplingParams(temperature=1.5, top_p=0.6), 9, 11),
    "min-p": (SamplingParams(temperature=1.0, min_p=0.05), 2**45 + 1, 2),
    "all": (SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01), 42, 1),
}


def sample_requests(names: list[str], logits: dict[str, torch.Tensor]) -> dict[str, int]:
    params, seeds, counters = zip(*(REQUESTS[n] for n in names))
    out = sample(torch.stack([logits[n] for n in names]), list(params), list(seeds), list(counters))
    return dict(zip(names, out.tokens.tolist()))


def test_seeded_rows_sample_the_same_token_in_any_batch():
    logits = {name: torch.randn(64) for name in REQUESTS}
    batches = [list(REQUESTS), ["all", "plain"], ["plain"], ["min-p", "next-step", "top-k", "plain", "greedy"],
               ["top-p", "top-p", "all"], list(reversed(REQUESTS)), ["greedy", "next-step"]]
    alone = {name: sample_requests([name], logits)[name] for name in REQUESTS}
    for names in batches:
        assert sample_requests(names, logits) == {n: alone[n] for n in names}, names


def test_the_token_depends_on_seed_and_counter():
    logits = torch.zeros(1, 64)  # uniform: every draw is the noise's argmin
    params = [SamplingParams(temperature=1.0)]
    by_seed = {sample(logits, params, [s], [0]).tokens.item() for s in range(40)}
    by_counter = {sample(logits, params, [5], [c]).tokens.item() for c in range(40)}
    assert len(by_seed) > 20 and len(by_counter) > 20


STAT_PARAMS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.6, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.85, min_p=0.05),
]


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 [V]: the softmax of the logits filtered by the reference ops."""
    x = reference.apply_temperature(logits[None], torch.tensor([p.temperature]))
    x = reference.apply_top_k_top_p(x, torch.tensor([p.top_k]), torch.tensor([p.top_p]))
    x = reference.apply_min_p(x, torch.tensor([p.min_p]))
    return x[0].double().softmax(-1)


# Spread so that every filter above keeps several tokens and drops several.
STAT_LOGITS = torch.tensor([2.0, 1.6, 1.5, 1.1, 0.8, 0.5, 0.2, 0.0, -0.3, -0.7, -1.2, -2.0])


def test_sampled_frequencies_follow_the_filtered_distribution():
    vocab, draws = len(STAT_LOGITS), 20000
    logits = torch.stack([STAT_LOGITS[torch.randperm(vocab)] for _ in STAT_PARAMS])
    params = [p for p in STAT_PARAMS for _ in range(draws)]
    i = torch.arange(draws)
    seeds = (i % 200 * 1009 + 17).tolist() * len(STAT_PARAMS)  # 200 seeds x 100 counters each
    counters = (i // 200).tolist() * len(STAT_PARAMS)
    tokens = sample(logits.repeat_interleave(draws, 0), params, seeds, counters).tokens.view(len(STAT_PARAMS), draws)
    for row, p in enumerate(STAT_PARAMS):
        want = reference_probs(logits[row], p)
        counts = torch.bincount(tokens[row], minlength=vocab)
        assert 3 <= int((want > 0).sum()) <= vocab - (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) * 3
        assert (counts[want == 0] == 0).all(), f"{p}: sampled an excluded token"
        assert chi_square_p_value(counts, want) > 1e-4, (p, counts.tolist(), (want * draws).tolist())
        assert 0.5 * float((counts / draws - want).abs().sum()) < 0.02, p


def test_a_temperature_change_is_detected():
    """The statistical test has power: frequencies at temperature 1.0 fail against temperature 0.8."""
    vocab, draws = len(STAT_LOGITS), 20000
    logits = STAT_LOGITS[None]
    tokens = sample(logits.expand(draws, -1), [SamplingParams(temperature=1.0)] * draws,
                    list(range(draws)), [0] * draws).tokens
    counts = torch.bincount(tokens, minlength=vocab)
    assert chi_square_p_value(counts, reference_probs(logits[0], SamplingParams(temperature=1.0))) > 1e-4
    assert chi_square_p_value(counts, reference_probs(logits[0], SamplingParams(temperature=0.8))) < 1e-6


def test_excluded_tokens_are_never_sampled_in_a_large_vocabulary():
    vocab, rows = 1 << 16, 48
    logits = torch.randn(rows, vocab) * 2
    seeds = [642] + list(range(rows - 1))  # seed 642, counter 0 hit a 0.0 draw under the old 24-bit noise
    out = sample(logits, [SamplingParams(temperature=1.0, top_k=3)] * rows, seeds, [0] * rows)
    top3 = logits.topk(3, dim=-1).indices
    assert (out.tokens[:, None] == top3).any(-1).all()
    out = sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * rows, seeds, [0] * rows)
    assert torch.equal(out.tokens, logits.argmax(-1))


def test_logprobs_are_the_raw_log_softmax_and_top_ids_the_true_top_k():
    logits = torch.randn(4, 500) * 4
    params = [SamplingParams(temperature=0.5, top_k=10, logprobs=5), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, min_p=0.1, logprobs=0)]
    out = sample(logits, params, [1, 2, 3, 4], [0, 0, 0, 0])
    want = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(out.logprobs.double(), want.gather(1, out.tokens[:, None])[:, 0], rtol=1e-6, atol=1e-5)
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    assert torch.equal(out.top_ids, want.topk(5, dim=-1).indices)
    torch.testing.assert_close(out.top_logprobs.double(), want.topk(5, dim=-1).values, rtol=1e-6, atol=1e-5)
    assert out.tokens[1] == out.top_ids[1, 0]  # the greedy row took the most probable token

    none = sample(logits, [SamplingParams(temperature=0.7)] * 4, [1, 2, 3, 4], [0] * 4)
    assert none.logprobs is none.top_ids is none.top_logprobs is None
    zero = sample(logits, [SamplingParams(temperature=0.7, logprobs=0)] * 4, [1, 2, 3, 4], [0] * 4)
    assert zero.top_ids.shape == (4, 0) and zero.logprobs.shape == (4,)


# ----- penalties and banned tokens -----


def penalized_reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """float64 [V]: one row's logits after the reference penalties, with its tables built by hand."""
    vocab = logits.shape[-1]
    prompt_mask = torch.zeros(1, vocab, dtype=torch.bool)
    prompt_mask[0, prompt] = True
    counts = torch.zeros(1, vocab, dtype=torch.int64)
    for token in output:
        counts[0, token] += 1
    return reference.apply_penalties(logits[None].double(), prompt_mask, counts,
                                     torch.tensor([p.repetition_penalty], dtype=torch.float64),
                                     torch.tensor([p.frequency_penalty], dtype=torch.float64),
                                     torch.tensor([p.presence_penalty], dtype=torch.float64))[0]


def test_build_makes_exact_tables_and_only_when_needed():
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(), SamplingParams(frequency_penalty=0.5)]
    prompt_ids, output_ids = [[3, 1, 3], [0, 2], [9]], [[4, 4, 1, 4], [5], []]
    batch = SamplingBatch.build(params, [1, 2, 3], [0, 0, 0], CPU, 10, prompt_ids, output_ids, [[], [], []])
    want_mask = torch.zeros(3, 10, dtype=torch.bool)
    want_mask[0, [1, 3]] = True
    want_mask[2, 9] = True  # row 1 uses no penalty: its tokens are not read
    assert torch.equal(batch.prompt_mask, want_mask)
    want_counts = torch.zeros(3, 10, dtype=torch.int32)
    want_counts[0, 4], want_counts[0, 1] = 3, 1
    assert batch.output_counts.dtype == torch.int32 and torch.equal(batch.output_counts, want_counts)
    assert batch.repetition.tolist() == [1.2000000476837158, 1.0, 1.0] and batch.frequency.tolist() == [0.0, 0.0, 0.5]
    assert batch.banned is None

    batch = SamplingBatch.build(params[1:2] * 3, [1, 2, 3], [0, 0, 0], CPU, 10, prompt_ids, output_ids,
                                [[7, 2, 7], [], [0]])
    assert batch.prompt_mask is batch.output_counts is batch.repetition is None
    want_banned = torch.zeros(3, 10, dtype=torch.bool)
    want_banned[0, [2, 7]] = True
    want_banned[2, 0] = True
    assert torch.equal(batch.banned, want_banned)
    batch = SamplingBatch.build(params[1:2] * 2, [1, 2], [0, 0], CPU, 10, [[], []], [[], []], [[10, 3, -1], [12]])
    assert batch.banned[0].nonzero().flatten().tolist() == [3] and not batch.banned[1].any()  # outside: never sampled
    with pytest.raises(ValueError, match="output_ids"):
        SamplingBatch.build(params[:1], [1], [0], CPU, 10, [[1]], [[-1]], [[]])
    with pytest.raises(ValueError, match="prompt_ids"):
        SamplingBatch.build(params[:1], [1], [0], CPU, 10, [[10]], [[]], [[]])


PENALTY_ROWS = [  # (params, prompt ids, output ids); STAT_LOGITS is sorted, so token 0 is the most likely
    (SamplingParams(temperature=1.0, repetition_penalty=1.8), [0, 3, 10], [1, 9]),
    (SamplingParams(temperature=0.8, frequency_penalty=0.7), [2, 5], [0, 0, 0, 1, 1, 6]),
    (SamplingParams(temperature=1.2, top_k=6, presence_penalty=1.5), [0, 1], [0, 2, 2, 2, 11]),
    (SamplingParams(temperature=0.9, top_p=0.9, min_p=0.02, repetition_penalty=1.3, frequency_penalty=0.4,
                    presence_penalty=0.6), [4, 0, 8], [0, 1, 1, 3, 10]),
    (SamplingParams(temperature=1.0, repetition_penalty=0.6, frequency_penalty=-0.5, presence_penalty=-1.0),
     [11], [7, 9, 9]),  # encouraging values
]


def test_sampled_frequencies_follow_the_penalized_distribution():
    vocab, draws = len(STAT_LOGITS), 20000
    i = torch.arange(draws)
    seeds = (i % 200 * 1009 + 17).tolist()
    counters = (i // 200).tolist()
    for p, prompt, output in PENALTY_ROWS:
        tokens = sample(STAT_LOGITS.expand(draws, -1), [p] * draws, seeds, counters,
                        [prompt] * draws, [output] * draws).tokens
        counts = torch.bincount(tokens, minlength=vocab)
        want = reference_probs(penalized_reference(STAT_LOGITS, p, prompt, output).float(), p)
        assert (counts[want == 0] == 0).all(), f"{p}: sampled an excluded token"
        assert chi_square_p_value(counts, want) > 1e-4, (p, counts.tolist(), (want * draws).tolist())
        assert 0.5 * float((counts / draws - want).abs().sum()) < 0.02, p
        # The test has power: the same draws reject the distribution without penalties.
        unpenalized = reference_probs(STAT_LOGITS, p)
        assert chi_square_p_value(counts, unpenalized) < 1e-6, p


def test_greedy_rows_take_the_argmax_of_the_penalized_logits():
    rows, vocab = 24, 500
    logits = torch.randn(rows, vocab) * 3
    gen = torch.Generator().manual_seed(5)
    params, prompts, outputs = [], [], []
    for r in range(rows):
        params.append(SamplingParams(temperature=0.0 if r % 3 else 0.9, repetition_penalty=[1.0, 1.5, 0.7, 3.0][r % 4],
                                     frequency_penalty=[0.0, 1.0, -0.5][r % 3], presence_penalty=[0.0, 2.0][r % 2]))
        top = logits[r].topk(6).indices  # make the penalties matter: reuse some of the best tokens
        prompts.append(top[:2].tolist() + torch.randint(0, vocab, (30,), generator=gen).tolist())
        outputs.append(top[2:5].tolist() * 2 + torch.randint(0, vocab, (10,), generator=gen).tolist())
    out = sample(logits, params, list(range(rows)), [3] * rows, prompts, outputs)
    greedy = [r for r in range(rows) if params[r].greedy]
    changed = 0
    for r in greedy:
        want = penalized_reference(logits[r], params[r], prompts[r], outputs[r])
        best2 = want.topk(2).values
        assert best2[0] - best2[1] > 1e-4  # no near tie that float32 rounding could flip
        assert out.tokens[r] == want.argmax(), r
        changed += int(want.argmax() != logits[r].argmax())
    assert changed >= 5  # the penalties changed the greedy choice of many rows


def test_banned_tokens_are_never_chosen_even_as_the_argmax():
    rows, vocab, draws = 4, 64, 4000
    logits = torch.randn(rows, vocab)
    banned = [[5, 9], [0], list(range(0, vocab, 2)), [63]]
    for r, ids in enumerate(banned):
        logits[r, ids] = 8.0 + torch.arange(len(ids), dtype=torch.float32)  # the banned tokens are the best
    # Greedy, with and without penalties: the best allowed token, even where a penalty would revive a
    # banned one (negative frequency and presence on a banned token that was output).
    greedy = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, frequency_penalty=-2.0,
                                                              presence_penalty=-2.0, repetition_penalty=0.5)]
    for p in greedy:
        out = sample(logits, [p] * rows, [0] * rows, [0] * rows, [[]] * rows, banned, banned)
        assert torch.equal(out.tokens, logits.masked_fill(_mask(banned, vocab), float("-inf")).argmax(-1))
    # Sampled, many draws per row: never a banned token, and the rest keeps its renormalized softmax.
    params = [SamplingParams(temperature=1.5), SamplingParams(temperature=1.0, frequency_penalty=-2.0,
                                                              repetition_penalty=0.5)] * (rows * draws // 2)
    row_ids = [r for r in range(rows) for _ in range(draws)]
    out = sample(logits.repeat_interleave(draws, 0), params, list(range(rows * draws)), [1] * (rows * draws),
                 [[]] * (rows * draws), [banned[r] for r in row_ids], [banned[r] for r in row_ids])
    tokens = out.tokens.view(rows, draws)
    for r in range(rows):
        assert not torch.isin(tokens[r], torch.tensor(banned[r])).any(), r
    want = (logits[0].double() / 1.5).masked_fill(_mask(banned[:1], vocab)[0], float("-inf")).softmax(-1)
    assert chi_square_p_value(torch.bincount(tokens[0, ::2], minlength=vocab), want) > 1e-4
    # Logprobs stay those of the raw logits, where the banned tokens are the most likely.
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=1)] * rows, [0] * rows, [0] * rows,
                 banned_ids=banned)
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))
    assert not torch.equal(out.tokens, out.top_ids[:, 0])


def _mask(ids: list[list[int]], vocab: int) -> torch.Tensor:
    mask = torch.zeros(len(ids), vocab, dtype=torch.bool)
    for r, row in enumerate(ids):
        mask[r, row] = True
    return mask


def test_a_rows_token_ignores_the_other_rows_penalties_and_bans():
    vocab = 40
    gen = torch.Generator().manual_seed(11)
    rows = []  # (logits, params, prompt, output, banned)
    for r in range(12):
        ids = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
        params = SamplingParams(temperature=[0.0, 1.0, 0.7][r % 3], top_k=[0, 10][r % 2],
                                repetition_penalty=[1.0, 2.0, 1.0, 0.5][r % 4],
                                frequency_penalty=[0.0, 0.0, 1.5][r % 3], presence_penalty=[0.0, -1.0][r % 2])
        rows.append((torch.randn(vocab, generator=gen) * 2, params, ids(8), ids(6), ids(r % 3)))
    # Rows 0 and 6 use no penalty and no ban; they must not notice their neighbours'.
    assert not rows[0][1].uses_penalties and not rows[6][1].uses_penalties and not rows[0][4] and not rows[6][4]

    def run(indices: list[int], seed: int) -> list[int]:
        logits, params, prompt, output, banned = zip(*(rows[i] for i in indices))
        return sample(torch.stack(logits), list(params), [seed + i for i in indices], [len(o) for o in output],
                      list(prompt), list(output), list(banned)).tokens.tolist()

    for seed in range(0, 500, 25):
        alone = [run([i], seed)[0] for i in range(len(rows))]
        for indices in (list(range(len(rows))), list(reversed(range(len(rows)))), [6, 0], [0, 1, 2, 3], [5, 6, 7]):
            assert run(indices, seed) == [alone[i] for i in indices], (seed, indices)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_sample_as_their_float32_upcast(dtype):
    """The model may hand over logits in its own dtype: greedy picks them as they are, everything
    else upcasts first, so every output equals that of the float32 copy."""
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    logits[1, [7, 90]] = 50.0  # a tie at the top: the first index either way
    greedy = [SamplingParams(temperature=0.0)] * 4
    mixed = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, top_k=20),
             SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05), SamplingParams(temperature=0.0, repetition_penalty=1.5)]
    for params in (greedy, mixed):
        args = (params, [11, 12, 13, 14], [0, 3, 5, 0], [[1, 2]] * 4, [[7, 9]] * 4, [[], [90], [], []])
        got, want = sample(logits, *args), sample(logits.float(), *args)
        assert torch.equal(got.tokens, want.tokens)
        for a, b in ((got.logprobs, want.logprobs), (got.top_logprobs, want.top_logprobs)):
            assert (a is None and b is None) or torch.equal(a, b)
    assert sample(logits, greedy, [0] * 4, [0] * 4).tokens[1] == 7
