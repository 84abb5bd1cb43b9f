"""Beam search on top of the engine, with the results of transformers'
``generate(num_beams=W, do_sample=False)`` (default ``early_stopping=False``).

Each step, every live beam of every prompt is one request (prompt + beam tokens,
max_tokens=1, greedy, ``logprobs`` on the raw logits), and all of them go to the
engine in one ``LLM.generate`` call, as vLLM's ``LLM.beam_search`` does; the
prefix cache makes the shared prefixes cheap, but nothing here depends on it.
Selection and stopping then follow transformers' ``_beam_search``, per prompt:

- the candidates are every beam's next tokens, ranked by cumulative log-probability;
- an EOS candidate among the best W becomes a finished hypothesis scored
  ``cumulative_logprob / generated_len ** length_penalty``, where generated_len
  counts the EOS and not the prompt; at max_tokens every one of the best W does;
- the best W candidates that are not EOS are the next step's beams;
- a prompt is done once it holds W hypotheses and its best live beam, scored at
  its current length, does not beat the worst of them;
- the answer is the W hypotheses, best score first.

With ``ignore_eos`` EOS is an ordinary token and every hypothesis has max_tokens tokens.
"""

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chitu_core.sampling.params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from chitu_core.engine.llm import LLM


@dataclass
class BeamSequence:
    """One finished hypothesis."""

    token_ids: list[int]  # generated tokens; ends with the EOS when finish_reason is "stop"
    text: str
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # beam_width hypotheses, best score first


@dataclass
class _Beam:
    token_ids: list[int]
    cumulative_logprob: float


@dataclass
class _Search:
    """The state of one prompt's search."""

    prompt_token_ids: list[int]
    beams: list[_Beam] = field(default_factory=lambda: [_Beam([], 0.0)])
    hypotheses: list[tuple[float, _Beam]] = field(default_factory=list)  # (score, beam), best first
    done: bool = False

    def advance(self, top_logprobs: list[dict[int, float]], length: int, params: BeamSearchParams,
                eos: set[int]) -> None:
        """One step: ``top_logprobs[i]`` holds the most likely next tokens of beam i; ``length``
        is the number of generated tokens once this step's token is appended."""
        width, last = params.beam_width, length == params.max_tokens
        candidates = [
            (beam.cumulative_logprob + lp, i, token)
            for i, (beam, top) in enumerate(zip(self.beams, top_logprobs))
            for token, lp in top.items()
        ]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        grown = [(_Beam(self.beams[i].token_ids + [token], cum), token) for cum, i, token in candidates]
        penalty = length**params.length_penalty
        for beam, token in grown[:width]:
            if last or token in eos:
                self.hypotheses.append((beam.cumulative_logprob / penalty, beam))
        self.hypotheses.sort(key=lambda h: -h[0])
        del self.hypotheses[width:]
        self.beams = [beam for beam, token in grown if token not in eos][:width]
        # transformers' _check_early_stop_heuristic with early_stopping=False: the best beam at its
        # current length stands for every continuation of every beam.
        self.done = last or (
            len(self.hypotheses) == width and self.beams[0].cumulative_logprob / penalty <= self.hypotheses[-1][0]
        )


def beam_search(llm: "LLM", prompts: Seq[str | dict[str, Any]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt (text, or ``{"prompt_token_ids": [...]}``); one output per
    prompt, in order."""
    engine = llm.engine
    width = params.beam_width
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    # transformers keeps the best max(2, 1 + len(eos)) * W candidates, enough that W of them are not
    # EOS; the best W tokens of each beam that are not EOS are among its W + len(eos) most likely.
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=width + max(width, len(eos)))
    texts, searches = [], []
    for prompt in prompts:
        ids, text = llm._prompt_ids(prompt)  # the same prompt rules as generate()
        if len(ids) + params.max_tokens > engine.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens and max_tokens={params.max_tokens}: together "
                f"{len(ids) + params.max_tokens}, more than max_model_len={engine.max_model_len}"
            )
        texts.append(text)
        searches.append(_Search(ids))

    for length in range(1, params.max_tokens + 1):
        live = [s for s in searches if not s.done]
        if not live:
            break
        requests = [{"prompt_token_ids": s.prompt_token_ids + b.token_ids} for s in live for b in s.beams]
        outputs = iter(llm.generate(requests, step))
        for s in live:
            top = [next(outputs).outputs[0].logprobs[0] for _ in s.beams]
            s.advance(top, length, params, eos)

    return [
        BeamSearchOutput(text, s.prompt_token_ids, [_sequence(llm, score, beam, eos) for score, beam in s.hypotheses])
        for text, s in zip(texts, searches)
    ]


def _sequence(llm: "LLM", score: float, beam: _Beam, eos: set[int]) -> BeamSequence:
    text = llm.tokenizer.decode(beam.token_ids, skip_special_tokens=True) if llm.tokenizer else ""
    reason = "stop" if beam.token_ids[-1] in eos else "length"
    return BeamSequence(beam.token_ids, text, beam.cumulative_logprob, score, reason)
