"""Beam search on the engine against transformers' generate(num_beams=4, do_sample=False): the same
hypotheses in the same order, with the same scores, for EOS-free, EOS-heavy and ignore_eos runs."""

import pytest
import torch

from builders import build_model, save_tokenizer
from chitu_core import LLM, SamplingParams
from chitu_core.engine.beam_search import beam_search
from chitu_core.sampling.params import BeamSearchParams

PROMPTS = [[3, 4, 5], [10, 200, 7, 7, 9], [100], [17, 17, 300, 41]]
# Tokens the seed-0 tiny Llama often puts among its best candidates: as EOS ids, they end
# hypotheses early (prompt [10, 200, 7, 7, 9] finishes all four within 5 tokens).
EOS = [498, 11]
N = 10


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free == bm.num_blocks and not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tiny Llama whose EOS (2, the config default) rarely comes up, with a tokenizer."""
    path = tmp_path_factory.mktemp("beam-plain")
    hf = build_model(path, "llama")
    save_tokenizer(path)
    return hf, LLM(path, device="cpu", dtype="float32", load_progress=False)


@pytest.fixture(scope="module")
def eos_heavy(tmp_path_factory):
    """The same weights with two EOS ids that are often among the best candidates."""
    path = tmp_path_factory.mktemp("beam-eos")
    hf = build_model(path, "llama", eos_token_id=EOS)
    return hf, LLM(path, device="cpu", dtype="float32", load_progress=False)


def reference(hf, ids: list[int], params: BeamSearchParams, num_return_sequences: int, **kwargs):
    """transformers' hypotheses (generated part, padding kept) and their scores."""
    out = hf.generate(
        torch.tensor([ids]), num_beams=params.beam_width, do_sample=False, max_new_tokens=params.max_tokens,
        length_penalty=params.length_penalty, num_return_sequences=num_return_sequences,
        return_dict_in_generate=True, output_scores=True, **kwargs,
    )
    return out.sequences[:, len(ids):].tolist(), out.sequences_scores.tolist()


def padded(token_ids: list[int], width: int, fill: int) -> list[int]:
    return token_ids + [fill] * (width - len(token_ids))


def check_against_transformers(hf, llm: LLM, params: BeamSearchParams, fill: int, prompts=PROMPTS, **hf_kwargs):
    """Best sequence == generate(num_beams=W); all W == num_return_sequences=W, scores included.
    All prompts go to beam_search together, and one at a time to transformers (no padding)."""
    width = params.beam_width
    outs = beam_search(llm, [{"prompt_token_ids": ids} for ids in prompts], params)
    assert [o.prompt_token_ids for o in outs] == prompts
    for ids, out in zip(prompts, outs):
        assert len(out.sequences) == width
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
        (best,), _ = reference(hf, ids, params, 1, **hf_kwargs)
        assert padded(out.sequences[0].token_ids, len(best), fill) == best
        all_w, scores = reference(hf, ids, params, width, **hf_kwargs)
        assert [padded(s.token_ids, len(all_w[0]), fill) for s in out.sequences] == all_w
        assert [s.score for s in out.sequences] == pytest.approx(scores, rel=1e-5)
        for s in out.sequences:
            assert s.score == pytest.approx(s.cumulative_logprob / len(s.token_ids) ** params.length_penalty)
    assert all_blocks_free(llm)
    return outs


@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
def test_matches_transformers(plain, length_penalty):
    hf, llm = plain
    params = BeamSearchParams(beam_width=4, max_tokens=N, length_penalty=length_penalty)
    outs = check_against_transformers(hf, llm, params, fill=2)
    assert all(len(s.token_ids) == N and s.finish_reason == "length" for o in outs for s in o.sequences)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_eos_hypotheses_match_transformers(eos_heavy, length_penalty):
    hf, llm = eos_heavy
    params = BeamSearchParams(beam_width=4, max_tokens=N, length_penalty=length_penalty)
    # transformers pads with pad_token_id, or the first EOS id when that is unset or 0.
    outs = check_against_transformers(hf, llm, params, fill=EOS[0], pad_token_id=EOS[0])
    finished = [s for o in outs for s in o.sequences if s.finish_reason == "stop"]
    assert any(len(s.token_ids) < N for s in finished)
    assert all(s.token_ids[-1] in EOS and not set(s.token_ids[:-1]) & set(EOS) for s in finished)
    # Four hypotheses shorter than max_tokens: the search for this prompt stopped early.
    assert all(len(s.token_ids) < N for s in outs[1].sequences)


def test_early_stop_rule_matches_transformers(eos_heavy):
    """Prompts where transformers' early-stop heuristic (early_stopping=False) changes the result:
    searching on to max_tokens would make [132, 389, ..., 11] the best of the first prompt, and give
    the second a 19-token hypothesis."""
    hf, llm = eos_heavy
    params = BeamSearchParams(beam_width=2, max_tokens=20)
    outs = check_against_transformers(hf, llm, params, fill=EOS[0], prompts=[[118, 498, 343, 194, 248], [268, 310, 417, 393]],
                                      pad_token_id=EOS[0])
    assert [len(s.token_ids) for s in outs[0].sequences] == [3, 7]
    assert [len(s.token_ids) for s in outs[1].sequences] == [17, 15]


def test_ignore_eos_makes_eos_an_ordinary_token(eos_heavy):
    hf, llm = eos_heavy
    params = BeamSearchParams(beam_width=4, max_tokens=N, ignore_eos=True)
    outs = check_against_transformers(hf, llm, params, fill=-1, eos_token_id=None)
    assert all(len(s.token_ids) == N and s.finish_reason == "length" for o in outs for s in o.sequences)
    assert any(set(s.token_ids[:-1]) & set(EOS) for o in outs for s in o.sequences)


def test_width_one_is_greedy_and_text_prompts_decode(plain):
    _, llm = plain
    prompts = ["The quick brown fox", "Paris is the capital"]
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=7, ignore_eos=True))
    greedy = llm.generate(prompts, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    for prompt, b, g in zip(prompts, beams, greedy):
        (seq,) = b.sequences
        assert b.prompt == prompt and b.prompt_token_ids == g.prompt_token_ids
        assert seq.token_ids == g.outputs[0].token_ids
        assert seq.text == g.outputs[0].text == llm.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
    assert all_blocks_free(llm)


def test_too_long_is_refused_before_any_step(plain):
    _, llm = plain
    limit = llm.engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        beam_search(llm, [{"prompt_token_ids": [5] * (limit - 3)}], BeamSearchParams(max_tokens=4))
    assert all_blocks_free(llm)
