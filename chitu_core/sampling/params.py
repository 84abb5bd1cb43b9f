"""SamplingParams and BeamSearchParams: how one request is decoded. Validated on construction,
with messages naming the field."""

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # seeds and token ids travel to the device as int64
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class StructuredOutput(BaseModel):
    """A constraint on a request's output, enforced while decoding: exactly one of
    ``json_object`` (any JSON object), ``json_schema`` (JSON valid under the schema, strictly:
    no properties or items the schema does not allow), ``regex`` (output that fullmatches it) or
    ``grammar`` (EBNF, in the GBNF dialect of llama.cpp and xgrammar, with ``root`` as start).

    Server code may attach one itself (say, the schema of a tool call). Whether the library can
    compile it is ``chitu_core.sampling.grammar.check``'s to say; the output ends ("stop") when
    the grammar is complete."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_object: bool = False
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutput":
        given = [k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_object, json_schema, regex, grammar (got {', '.join(given) or 'none'})")
        return self

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached under (a schema's key order matters:
        it is the order of the output's properties)."""
        if self.json_object:
            return ("json_object", "")
        if self.json_schema is not None:
            return ("json_schema", json.dumps(self.json_schema, ensure_ascii=False))
        if self.regex is not None:
            return ("regex", self.regex)
        return ("grammar", self.grammar)


class SamplingParams(BaseModel):
    """Decoding parameters of one request (vLLM's names and defaults).

    temperature 0 means greedy. top_k = -1 or 0, top_p = 1 and min_p = 0 disable those filters.
    repetition_penalty (> 1 discourages) divides positive / multiplies negative logits of
    every token seen in the prompt or output; frequency_penalty subtracts penalty * count and
    presence_penalty subtracts penalty once, for each token seen in the output.
    seed makes sampling reproducible whatever else is in the batch; without one, a random
    seed is drawn when the request is added. n > 1 returns n independent samples of one prompt.
    stop strings end the output (they are cut from it and never streamed); stop_token_ids end
    it with the token kept; EOS ends it unless ignore_eos; min_tokens forbids EOS and stop
    tokens until that many tokens are out. logprobs=N returns the sampled token's
    log-probability and the N most likely tokens' at each step (computed on the raw logits).
    logit_bias (token id -> bias in [-100, 100], as OpenAI's) is added to the logits before
    anything else; its ids must be in the model's vocabulary, which the engine checks.
    structured_output constrains the output to a grammar (``StructuredOutput``); the request
    ends ("stop") when the grammar is complete.

    Whatever passes validation can be batched without error: integers fit int64, floats are
    finite. A value that could make an engine step raise is refused here, naming its field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = Field(1, ge=1, le=128)
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(0, ge=-1, le=INT64_MAX)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    skip_special_tokens: bool = True
    logit_bias: dict[TokenId, Bias] = Field(default_factory=dict)
    structured_output: StructuredOutput | None = None

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.structured_output is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_output: the grammar decides where the output ends")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class BeamSearchParams(BaseModel):
    """Beam search as transformers' ``generate(num_beams=beam_width, do_sample=False)``.

    Hypotheses are ranked by sum of token log-probabilities / (generated length ** length_penalty).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    beam_width: int = Field(4, ge=1, le=10)
    max_tokens: int = Field(16, ge=1)
    length_penalty: float = 1.0
    ignore_eos: bool = False
