"""The transformers peer of ``bench offline --peer hf``: the same model, device, dtype and prompts.

Its fastest mode per batch size: at batch 1 a static KV cache, for which ``generate`` compiles the
forward itself (``torch.compile`` fullgraph, mode "reduce-overhead": graph replay) on the devices
transformers compiles for; at larger batches eager ``generate``. Greedy, exactly ``output_len`` tokens. The decode rate excludes
the prefill: B * (O - 1) tokens over the time of generating O tokens less that of generating one.

With ``dummy`` (``--load-format dummy``: config.json alone) transformers builds the model on the device with
its own random initialization: its weights differ from ours, so only the speeds compare (the report says so).

Quantized runs (``choose_peer``): transformers loads a quantized checkpoint directory itself where it can
read the format on that device, and the peer's ``mode`` says what it then computes, which need not be
what ours does: compressed-tensors checkpoints (int8 W8A8, FP8) are decompressed to the model dtype at
the first forward and run dense, activations quantized and dequantized on the fly; fine-grained FP8
(``quant_method: fp8``) runs on transformers' FP8 kernels on GPUs of compute capability 8.9+ or XPU, and
is dequantized to the model dtype at load elsewhere; AWQ and GPTQ need gptqmodel. Where a package is
missing there is no peer, and a one-line reason instead. In situ (``--quantization``) transformers has
no path of ours: fp8 becomes its own ``FineGrainedFP8Config`` (the same weight format) where its FP8
kernels run, and otherwise the peer is the unquantized model, labelled so.
"""

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Peer:
    """How transformers loads the peer: ``quantization_config`` for ``from_pretrained`` (transformers'
    own quantizer config, or None), and ``label``, what transformers then holds and computes (None: the
    same unquantized model as ours)."""

    label: str | None = None
    quantization_config: Any = None


def _fp8_kernels_run_on(device: torch.device) -> bool:
    """Whether transformers runs its FP8 kernels for a model on ``device``: never on the CPU; elsewhere its
    own rule decides (``FineGrainedFP8HfQuantizer.validate_environment``: a GPU of compute capability 8.9+,
    or XPU; otherwise it dequantizes an FP8 checkpoint at load). Without accelerate it cannot tell: False."""
    if device.type == "cpu":
        return False
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(), pre_quantized=True)
    try:
        quantizer.validate_environment()
    except (ImportError, RuntimeError):
        return False
    return not quantizer.quantization_config.dequantize


def _missing(*packages: str) -> list[str]:
    """Which of ``packages`` transformers finds missing (or at a version it refuses), as pip requirements."""
    from transformers import utils
    from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION

    versions = {"kernels": f"'kernels>={KERNELS_MIN_VERSION},<{KERNELS_MAX_VERSION}'"}
    return [versions.get(p, p) for p in packages if not getattr(utils, f"is_{p.replace('-', '_')}_available")()]


def _install(packages: list[str]) -> str:
    return "pip install " + " ".join(packages)


FP8_KERNELS = "a GPU of compute capability 8.9+ or an XPU"


def _in_situ_peer(quantization: str, device: torch.device, dtype: str, dummy: bool) -> Peer:
    """``--quantization`` on a 16-bit or dummy model: transformers' own FP8 quantization where it runs,
    else the unquantized model, labelled with why."""
    if quantization == "fp8":
        if dummy:
            why = "transformers quantizes to FP8 only while loading a checkpoint, not with --load-format dummy"
        elif not _fp8_kernels_run_on(device):
            why = f"transformers quantizes to FP8 in situ only on {FP8_KERNELS}, not on {device.type}"
        elif missing := _missing("accelerate", "kernels"):
            why = f"transformers' FineGrainedFP8Config needs {_install(missing)}"
        else:
            from transformers import FineGrainedFP8Config

            return Peer("16-bit checkpoint quantized to FP8 at load by transformers' FineGrainedFP8Config "
                        "(e4m3 weights, 128x128 block scales; activations quantized to FP8 per 1x128 block)",
                        FineGrainedFP8Config(weight_block_size=(128, 128)))
    elif quantization == "int8":
        why = "transformers has no in-situ int8 W8A8 (compressed-tensors checkpoints come quantized)"
    else:
        why = "transformers has no in-situ AWQ (AWQ checkpoints come calibrated)"
    return Peer(f"unquantized {dtype} model, not {quantization}: {why}")


def _checkpoint_peer(qc: Mapping[str, Any], device: torch.device, dtype: str) -> Peer | str:
    """A quantized checkpoint's own directory, as transformers loads it on ``device``; or why it cannot."""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        if missing := _missing("compressed-tensors"):
            return f"transformers reads compressed-tensors checkpoints through that package: {_install(missing)}"
        groups = (qc.get("config_groups") or {}).values()
        activations = any(isinstance(g, Mapping) and g.get("input_activations") for g in groups)
        return Peer(f"compressed-tensors {qc.get('format', 'dense')} checkpoint, decompressed to {dtype} at the "
                    "first forward: dense matmuls" + (", activations quantized and dequantized on the fly"
                                                      if activations else ""))
    if method == "fp8":
        if missing := _missing("accelerate"):
            return f"transformers loads fine-grained FP8 (quant_method fp8) only with accelerate: {_install(missing)}"
        if not _fp8_kernels_run_on(device):
            from transformers import FineGrainedFP8Config

            return Peer(f"fine-grained FP8 checkpoint dequantized to {dtype} at load: dense matmuls (transformers' "
                        f"FP8 kernels need {FP8_KERNELS})",
                        FineGrainedFP8Config(dequantize=True, modules_to_not_convert=qc.get("modules_to_not_convert")))
        if missing := _missing("kernels"):
            return f"transformers' FP8 kernels come from the kernels package (and the Hub): {_install(missing)}"
        return Peer("fine-grained FP8 checkpoint on transformers' FP8 kernels (e4m3 weights, block scales; "
                    "activations quantized to FP8 per 1x128 block)")
    if method in ("awq", "gptq"):
        if missing := _missing(*(("gptqmodel", "accelerate") if method == "awq" else ("optimum", "gptqmodel"))):
            return f"transformers loads {method.upper()} checkpoints through gptqmodel: {_install(missing)}"
        return Peer(f"{method.upper()} 4-bit checkpoint on gptqmodel's kernels")
    return f"no transformers path known to the peer for quant_method {method!r}"


def choose_peer(quantization_config: Mapping[str, Any] | None, quantization: str | None, device: torch.device,
                dtype: torch.dtype, dummy: bool = False) -> Peer | str:
    """How transformers runs the peer of a run of ours: ``quantization_config`` is config.json's,
    ``quantization`` the in-situ ``--quantization`` (or None). A string is why there is no peer: a
    missing package (and what to install), or a quantized format transformers has no path for here."""
    name = str(dtype).removeprefix("torch.")
    if quantization is not None:
        return _in_situ_peer(quantization, device, name, dummy)
    if quantization_config is None:
        return Peer()
    if dummy:
        return "transformers draws no random weights in a quantized checkpoint's format (--load-format dummy)"
    return _checkpoint_peer(quantization_config, device, name)


def run_hf(model_dir, device: torch.device, dtype: torch.dtype, prompts: list[list[int]], output_len: int,
           runs: int, synchronize: Callable[[], None], compile_batch_one: bool = True,
           dummy: bool = False, peer: Peer = Peer()) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    else:
        quantization = {} if peer.quantization_config is None else {"quantization_config": peer.quantization_config}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **quantization).to(device).eval()
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
        "mode": f"{peer.label}; {mode}" if peer.label else mode,
        "weights": "own random" if dummy else "checkpoint",
        "total_s": round(statistics.median(full), 6),
        "output_tok_per_s": round(batch * output_len / statistics.median(full), 3),
        "prefill_s": round(statistics.median(first), 6),
        "decode_tok_per_s": round(batch * (output_len - 1) / decode_s, 3) if output_len > 1 and decode_s > 0 else None,
        "runs_total_s": [round(t, 6) for t in full],
    }
