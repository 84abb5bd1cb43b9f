"""SamplingParams: how one request is decoded. Validated on construction, with messages naming the field."""

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """Decoding parameters of one request (vLLM's names and defaults).

    temperature 0 means greedy. top_k <= 0, top_p = 1 and min_p = 0 disable those filters.
    seed makes sampling reproducible whatever else is in the batch; without one, a random
    seed is drawn when the request is added. logprobs=N returns the sampled token's
    log-probability and the N most likely tokens' at each step (computed on the raw logits).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = 0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
