"""The offline API: ``LLM(model=PATH, device=..., dtype=...).generate(prompts, SamplingParams(...))``."""

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from chitu_core.config import EngineConfig
from chitu_core.engine.engine import LLMEngine
from chitu_core.engine.outputs import RequestOutput
from chitu_core.errors import ChituError
from chitu_core.sampling.params import BeamSearchParams, SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    """Load a model once, then generate for batches of prompts. Keyword arguments are the
    fields of ``chitu_core.config.EngineConfig`` (device, dtype, max_model_len, ...)."""

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", **kwargs: Any):
        self.config = EngineConfig(model=str(model), device=device, dtype=dtype, **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _prompt_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"a dict prompt needs the key 'prompt_token_ids'; got keys {sorted(prompt)}")
            return list(prompt["prompt_token_ids"]), prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ChituError(f"{self.config.model} has no tokenizer; pass {{'prompt_token_ids': [...]}} instead of text")
            return self.tokenizer.encode(prompt), prompt
        raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, not {type(prompt).__name__}")

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one, or one per prompt")
        requests = []
        try:
            for prompt, p in zip(prompts, params):
                ids, text = self._prompt_ids(prompt)
                requests.append(self.engine.add_request(f"offline-{next(self._ids)}", ids, p, text))
        except Exception:  # all prompts or none: never leave half a batch queued
            for request in requests:
                self.engine.abort_request(request.request_id)
            raise
        with tqdm(total=len(requests), desc="Generating", disable=not use_tqdm) as bar:
            while not all(r.finished for r in requests):
                bar.update(sum(o.finished for o in self.engine.step()))
        return [self.engine.final_output(r) for r in requests]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ChituError(f"{self.config.model} has no chat template; use generate() with a plain prompt")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams) -> list:
        """Beam search, as transformers' generate(num_beams=..., do_sample=False); one
        ``BeamSearchOutput`` (hypotheses best first) per prompt. See ``engine.beam_search``."""
        from chitu_core.engine.beam_search import beam_search

        return beam_search(self, [prompts] if isinstance(prompts, (str, dict)) else list(prompts), params)

