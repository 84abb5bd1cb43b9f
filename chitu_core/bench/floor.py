"""The byte floor of a decode step: the bytes it must read over the copy bandwidth measured now.

A decode step of B sequences reads every weight it multiplies with (all parameters except
an untied input-embedding table, of which it reads only B rows) and the keys and values of
every sequence's context. Its floor time is those bytes over the device-to-device copy
bandwidth (bytes read plus bytes written per second) measured in the same process run.
"""

import statistics
import time
from collections.abc import Callable

import torch

COPY_BYTES = 1 << 30


def copy_bandwidth(device: torch.device, synchronize: Callable[[], None], repeats: int = 10, trials: int = 3) -> float:
    """Bytes per second that a large tensor copy moves on ``device`` (read + write): ``repeats``
    back-to-back copies of COPY_BYTES between two synchronizations, the median of ``trials``."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    rates = []
    for _ in range(trials):
        synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        synchronize()
        rates.append(2 * COPY_BYTES * repeats / (time.perf_counter() - start))
    return statistics.median(rates)


def weight_bytes_read(model) -> int:
    """Bytes of the parameters a decode step multiplies with: all of them but an untied input
    embedding (a tied one is read whole as the LM head)."""
    seen, total = set(), 0
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    skip = None
    if embed is not None and (lm_head is None or lm_head.weight is not embed.weight):
        skip = embed.weight
    for p in model.parameters():
        if p is skip or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def decode_kv_bytes(kv_bytes_per_token: int, batch_size: int, input_len: int, output_len: int) -> float:
    """Mean KV bytes a decode step reads: step j (1 <= j < output_len) attends over input_len + j keys
    in each of ``batch_size`` sequences."""
    steps = range(1, output_len)
    if not steps:
        return 0.0
    return kv_bytes_per_token * batch_size * statistics.fmean(input_len + j for j in steps)
