"""Counter-based random noise for sampling, identical on every device and in every batch.

Each (seed, counter, vocabulary index) hashes to its own 23-bit uniform, so a
request's draw at output step ``counter`` depends on nothing but its seed: not
on the batch it shares, the device, or the order of requests. The hash uses
only int64 adds, shifts, xors and 16-bit-split multiplies, so it never
overflows and every backend computes the same bits.
"""

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32, without int64 overflow."""
    lo = (x * (c & 0xFFFF)) & _MASK32
    hi = (((x * (c >> 16)) & 0xFFFF) << 16) & _MASK32
    return (lo + hi) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, vocab_size] of Exp(1) draws, all > 0. seeds, counters: int64 [B] (all 64 seed bits
    count; counters are taken mod 2**32)."""
    dev = seeds.device
    key = _fmix32((seeds & _MASK32) ^ _mul32(counters & _MASK32, 0x9E3779B1))
    key = _fmix32(key ^ ((seeds >> 32) & _MASK32))
    idx = torch.arange(vocab_size, device=dev, dtype=torch.int64)
    bits = _fmix32(key[:, None] ^ _mul32(idx, 0x27D4EB2F)[None, :])
    # (j + 0.5) / 2**23 is exact in float32, so in (0, 1): with 24 bits the largest rounds to 1.0,
    # whose Exp(1) draw is 0, and a token of probability 0 then wins argmax(0 / 0 = nan).
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(uniform)
