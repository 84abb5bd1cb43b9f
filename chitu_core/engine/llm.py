"""The offline API: ``LLM(model=PATH, device=..., dtype=...).generate(prompts, SamplingParams(...))``."""

from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from chitu_core.config import EngineConfig
from chitu_core.engine.engine import LLMEngine
from chitu_core.engine.outputs import CompletionOutput, RequestOutput
from chitu_core.engine.sequence import Sequence
from chitu_core.errors import ChituError
from chitu_core.sampling.params import SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    """Load a model once, then generate for batches of prompts. Keyword arguments are the
    fields of ``chitu_core.config.EngineConfig`` (device, dtype, max_model_len, ...)."""

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", **kwargs: Any):
        self.config = EngineConfig(model=str(model), device=device, dtype=dtype, **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

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
        seqs = []
        for prompt, p in zip(prompts, params):
            ids, text = self._prompt_ids(prompt)
            seqs.append(self.engine.add_request(ids, p, text))
        with tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                bar.update(len(self.engine.step()))
        return [self._output(seq) for seq in seqs]

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

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if self.tokenizer else ""
        logprobs = seq.output_logprobs if seq.params.logprobs is not None else None
        cumulative = sum(lp[t] for lp, t in zip(logprobs, seq.output_token_ids)) if logprobs else None
        completion = CompletionOutput(0, text, list(seq.output_token_ids), seq.finish_reason, logprobs, cumulative)
        return RequestOutput(str(seq.seq_id), seq.prompt, list(seq.prompt_token_ids), [completion])
