"""The transformers peer of ``bench offline --peer hf``: the same model, device, dtype and prompts.

Its fastest mode per batch size: at batch 1 a static KV cache, for which ``generate`` compiles the
forward itself (``torch.compile`` fullgraph, mode "reduce-overhead": graph replay) on the devices
transformers compiles for; at larger batches eager ``generate``. Greedy, exactly ``output_len`` tokens. The decode rate excludes
the prefill: B * (O - 1) tokens over the time of generating O tokens less that of generating one.

With ``dummy`` (``--load-format dummy``: config.json alone) transformers builds the model on the device with
its own random initialization: its weights differ from ours, so only the speeds compare (the report says so).
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def run_hf(model_dir, device: torch.device, dtype: torch.dtype, prompts: list[list[int]], output_len: int,
           runs: int, synchronize: Callable[[], None], compile_batch_one: bool = True,
           dummy: bool = False) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    batch = len(prompts)
    static = compile_batch_one and batch == 1
    if static:
        # generate compiles the forward itself for a static cache (fullgraph, reduce-overhead) on the
        # devices transformers supports; compiling it again here would fight that.
        model.generation_config.cache_implementation = "static"
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> float:
        synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=0, eos_token_id=None)
        synchronize()
        assert out.shape[1] == ids.shape[1] + n, "transformers stopped early"
        return time.perf_counter() - start

    # Warm-up: the compiled mode compiles and captures both shapes (the prompt, one token) for the
    # full-length static cache; eager needs only its kernels loaded.
    for n in (output_len, 1) if static else (min(output_len, 4),):
        generate(n)
    compiled = getattr(model, "_compiled_call", None) is not None
    full = [generate(output_len) for _ in range(runs)]
    first = [generate(1) for _ in range(runs)]
    decode_s = statistics.median(full) - statistics.median(first)
    mode = ("static cache + torch.compile (generate's own)" if compiled else "static cache, eager" if static
            else "eager generate, dynamic cache")
    return {
        "mode": mode,
        "weights": "own random" if dummy else "checkpoint",
        "total_s": round(statistics.median(full), 6),
        "output_tok_per_s": round(batch * output_len / statistics.median(full), 3),
        "prefill_s": round(statistics.median(first), 6),
        "decode_tok_per_s": round(batch * (output_len - 1) / decode_s, 3) if output_len > 1 and decode_s > 0 else None,
        "runs_total_s": [round(t, 6) for t in full],
    }
