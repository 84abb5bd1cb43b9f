"""The Sampler end to end on the backend's ops: a statistical test of its draws, greedy rows, logprobs.

One logits row, with penalties, temperature, top-k, top-p and min-p, is sampled ``DRAWS`` times with
seeds 0..DRAWS-1 through ``chitu_core.sampling.sampler.Sampler`` (counter-based noise, so the draws
are fixed). The counts must follow the distribution the reference ops give in float64 (zscore metric);
the filters' boundaries are placed far from rounding. Greedy rows in the same batch must take the
lowest-index argmax of their penalized logits, and the sampled tokens' logprobs must match the
reference log_softmax (the ``logits`` family threshold).
"""

import torch

from chitu_core.conformance.case import Case, Outcome, Target, nbytes, ops_source, raised, randn, time_call
from chitu_core.conformance.compare import Verdict, compare, compare_argmax, compare_draws, worst
from chitu_core.conformance.op_cases import _mid_gaps
from chitu_core.ops import reference
from chitu_core.sampling.sampler import Sampler, SamplingBatch

DRAWS, GREEDY_ROWS, VOCAB, LOGPROBS = 20000, 64, 40, 5


def _reference_distribution(logits, prompt_mask, counts, rep, freq, pres, temperature, top_k, top_p, min_p):
    x = reference.apply_penalties(logits.double(), prompt_mask, counts, rep, freq, pres)
    x = reference.apply_temperature(x, temperature)
    x = reference.apply_top_k_top_p(x, top_k, top_p)
    return reference.apply_min_p(x, min_p).double().softmax(-1)


def run_sampler_case(case: Case, target: Target) -> Outcome:
    gen, device = case.generator(), target.device
    logits = randn(gen, 1, VOCAB, scale=2.0)
    prompt_mask = torch.rand(1, VOCAB, generator=gen) < 0.3
    counts = (torch.randint(1, 4, (1, VOCAB), generator=gen) * (torch.rand(1, VOCAB, generator=gen) < 0.3)).int()
    rep, freq, pres = torch.tensor([1.2]), torch.tensor([0.3]), torch.tensor([0.2])
    temperature, top_k = torch.tensor([0.8]), torch.tensor([30])
    # top_p halfway between two cumulative masses of what top-k keeps; min_p halfway between two ratios after it.
    x = reference.apply_top_k_top_p(reference.apply_temperature(
        reference.apply_penalties(logits, prompt_mask, counts, rep, freq, pres), temperature), top_k, torch.ones(1))
    cum = x.double().softmax(-1).sort(-1, descending=True).values.cumsum(-1)
    top_p = (1.0 - _mid_gaps(1.0 - cum, torch.tensor([12]), 5e-3)).float()
    y = reference.apply_top_k_top_p(x, top_k, top_p).double().softmax(-1)
    ratios = (y / y.max()).sort(-1, descending=True).values
    min_p = _mid_gaps(ratios, torch.tensor([int((ratios > 0).sum()) - 3]), 5e-3).float()
    probs = _reference_distribution(logits, prompt_mask, counts, rep, freq, pres, temperature, top_k, top_p, min_p)[0]

    rows = DRAWS + GREEDY_ROWS

    def per_row(t, greedy_value=None):
        out = t.expand(rows, *t.shape[1:]).clone()
        if greedy_value is not None:
            out[DRAWS:] = greedy_value
        return out.to(device)

    greedy_logits = randn(gen, GREEDY_ROWS, VOCAB, scale=2.0)
    all_logits = torch.cat((logits.expand(DRAWS, VOCAB), greedy_logits)).to(device)
    batch = SamplingBatch(
        temperature=per_row(temperature, 0.0), top_k=per_row(top_k), top_p=per_row(top_p), min_p=per_row(min_p),
        seeds=torch.arange(rows, dtype=torch.int64).to(device), counters=per_row(torch.tensor([3])),
        all_greedy=False, use_top_k_top_p=True, use_min_p=True, max_logprobs=LOGPROBS,
        repetition=per_row(rep), frequency=per_row(freq), presence=per_row(pres),
        prompt_mask=per_row(prompt_mask), output_counts=per_row(counts))
    sampler = Sampler(target.ops)
    try:
        out = sampler(all_logits, batch)
    except Exception as exc:  # the backend's own failure is the case's result
        return raised(exc, "Sampler")
    tokens = out.tokens.cpu()
    if tokens.min() < 0 or tokens.max() >= VOCAB:
        return Outcome(Verdict.fail(f"sampled tokens outside [0, {VOCAB})"))
    verdicts = [compare_draws(torch.bincount(tokens[:DRAWS], minlength=VOCAB), probs, target.threshold(case))]
    penalized = reference.apply_penalties(greedy_logits.double(), per_row(prompt_mask)[DRAWS:].cpu(),
                                          per_row(counts)[DRAWS:].cpu(), rep.expand(GREEDY_ROWS),
                                          freq.expand(GREEDY_ROWS), pres.expand(GREEDY_ROWS))
    verdicts.append(compare_argmax(out.tokens[DRAWS:], penalized, target.book.get("greedy_sample", "argmax",
                                                                                   torch.float32)[0], "greedy rows"))
    want_logprobs = reference.log_softmax(all_logits.cpu().double())
    logprob_threshold = target.book.get("log_softmax", "logits", torch.float32)[0]
    verdicts.append(compare(out.logprobs, want_logprobs.gather(1, tokens[:, None])[:, 0], logprob_threshold,
                            "sampled logprobs"))
    verdicts.append(compare(out.top_logprobs, want_logprobs.topk(LOGPROBS, dim=-1).values, logprob_threshold,
                            "top logprobs"))
    perf = time_call(target, lambda: sampler(all_logits, batch), nbytes(all_logits)) if target.perf else None
    return Outcome(worst(verdicts), _source(target), perf)


def _source(target: Target) -> str:
    return ops_source(target, ("apply_penalties", "greedy_sample", "apply_temperature", "apply_top_k_top_p",
                               "apply_min_p", "random_sample", "log_softmax"))


def sampler_cases(dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    if torch.float32 not in dtypes:
        return []
    return [Case("sampler", "sampler", "sampler", torch.float32, {"vocab": VOCAB, "draws": DRAWS},
                 f"{DRAWS} seeded draws + {GREEDY_ROWS} greedy rows, V={VOCAB}, logprobs={LOGPROBS}", run_sampler_case)]
