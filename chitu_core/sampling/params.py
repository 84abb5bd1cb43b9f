"""SamplingParams and BeamSearchParams: how one request is decoded. Validated on construction,
with messages naming the field."""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # seeds and token ids travel to the device as int64
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


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

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
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
