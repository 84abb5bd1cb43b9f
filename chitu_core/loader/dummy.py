"""Dummy weights (load_format "dummy"): random values drawn in place on the device, from config.json alone.

For benchmarks of full-size configs where no checkpoint can travel and nothing may be downloaded:
the model is built as usual (its parameters already on the device) and every parameter is then
overwritten where it lies. Speed does not depend on the values, but NaNs, overflow to inf, and
logits or router scores that all tie would make a run unrepresentative, hence the scales below.
"""

import math

import torch
from torch import nn

NORM_NOISE = 0.02  # norm weights are 1 +- this
VECTOR_RANGE = 0.02  # biases and other vectors that are not norm weights are +- this
CHUNK_ELEMENTS = 1 << 24  # float32 elements drawn at a time for dtypes that cannot be drawn directly (fp8)
_DRAWABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dummy_range(name: str, param: torch.Tensor) -> tuple[float, float]:
    """The interval a parameter's values are drawn from, uniformly (see ``fill_dummy_weights``)."""
    if name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, q_norm, kv_a_layernorm, norm
        return 1.0 - NORM_NOISE, 1.0 + NORM_NOISE
    if param.dim() >= 2:
        bound = 1.0 / math.sqrt(param.shape[-1])
        return -bound, bound
    return -VECTOR_RANGE, VECTOR_RANGE


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> int:
    """Overwrite every parameter of ``model`` in place, on its device, with random values; returns
    how many elements were drawn. The same seed on the same device gives the same weights.

    Rules, by parameter name and shape:
      - ``...norm.weight`` (every RMSNorm/LayerNorm scale): uniform(1 - 0.02, 1 + 0.02);
      - 2-D and larger ([out, in] linears and embeddings, [E, out, in] stacked experts):
        uniform(-a, a) with a = 1/sqrt(fan_in), fan_in being the last dimension;
      - other floating parameters (biases, router correction biases): uniform(-0.02, 0.02);
      - non-floating parameters (integer or packed quantized weights) are set to zero, not drawn,
        and not counted.
    Floating includes fp8: its values are drawn in float32, a chunk at a time, and cast into place.
    Buffers (rotary tables and the like, computed from the config) are left alone. A tied weight is
    filled once. Afterwards, as after a checkpoint load, the model's ``process_weights_after_loading()``
    runs (quantization transforms; DeepSeek's split of kv_b_proj into the absorbed MLA matrices).

    Why 1/sqrt(fan_in): uniform(-a, a) has standard deviation a/sqrt(3), so a linear layer maps the
    unit-RMS input an RMSNorm with weights near 1 hands it to outputs of std ~0.58, whatever its
    width. A decoder layer's update to the residual stream is smaller still (silu(gate) * up, and
    attention's average over values, shrink it), and the updates add up like a random walk: a
    61-layer Llama of hidden size 1024 in bfloat16 measured a residual RMS of 0.1 after layer 1 and
    2.7 after layer 61, far from bfloat16's range, and each norm rescales it anyway. Attention scores
    q.k/sqrt(head_dim) have std ~1/3 (softmax neither uniform nor one-hot); router logits have std
    ~0.58, so different tokens pick different experts, spreading the MoE's load as a trained model
    does; the final logits have std ~0.58: finite, not tied, the argmax changing with the input.
    vLLM's uniform(-1e-3, 1e-3) makes a linear's output ~1e-3 * sqrt(fan_in / 3) (0.05 at 7168),
    which leaves logits and router scores nearly tied. The embedding table gets the same rule
    (values ~1/sqrt(3 * hidden)); the first norm brings its rows to unit RMS, their mean square
    1/(3 * hidden) staying above the usual eps (1e-6 to 1e-5) at the hidden sizes of these models.

    Memory: ``Tensor.uniform_`` draws into the parameter itself, so nothing is allocated for the
    dtypes it supports; the fp8 path holds one float32 chunk of CHUNK_ELEMENTS (64 MiB) at a time.
    """
    generators: dict[torch.device, torch.Generator] = {}
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            data = param.data
            if not data.is_floating_point():
                data.zero_()
                continue
            if data.device not in generators:
                generators[data.device] = torch.Generator(device=data.device).manual_seed(seed)
            low, high = dummy_range(name, data)
            _fill_uniform(data, low, high, generators[data.device])
            count += data.numel()
        after_loading = getattr(model, "process_weights_after_loading", None)  # CausalLM's, for a model
        if after_loading is not None:
            after_loading()
    return count


def _fill_uniform(t: torch.Tensor, low: float, high: float, generator: torch.Generator) -> None:
    if t.dtype in _DRAWABLE:
        t.uniform_(low, high, generator=generator)
        return
    flat = t.view(-1)  # parameters are created contiguous; this raises rather than fill a copy
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        part = flat[start:start + CHUNK_ELEMENTS]
        part.copy_(torch.empty(part.shape, dtype=torch.float32, device=t.device).uniform_(low, high, generator=generator))
