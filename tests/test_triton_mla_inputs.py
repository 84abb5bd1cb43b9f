"""The Triton ``mla_inputs`` (contract 1.10, ``chitu_core.kernels.triton.mla_inputs``) on the CPU, under
Triton's interpreter (see test_triton_kernels.py), in float32: against the float64 reference for both
rotary pair layouts, latent widths past and below one program's columns, heads and widths off the
powers of two, a padded query, positions at both ends of the table and no tokens; inputs untouched."""

import pytest
import torch

from test_triton_kernels import interpreter  # skips this module where that one is skipped

from chitu_core.ops import reference
from test_ops import assert_unmodified, snapshot

with interpreter():
    from chitu_core.kernels.triton.mla_inputs import mla_inputs


@pytest.fixture(autouse=True)
def _interpret():
    with interpreter():
        yield


def operands(t, h, n, r, lora, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, n + r, generator=gen)
    kv = torch.randn(t, lora + r, generator=gen) * 3
    w_uk = torch.randn(h, n, lora, generator=gen) / n**0.5
    norm_w = 1 + 0.3 * torch.randn(lora, generator=gen)
    angles = torch.rand(64, r // 2, generator=gen, dtype=torch.float64) * 100
    cache = torch.cat((angles.cos(), angles.sin()), -1).float()
    positions = torch.randint(0, 64, (t,), generator=gen)
    if t:
        positions[0], positions[-1] = 0, 63
    return q, kv, w_uk, norm_w, positions, cache


def nmse(got, want):
    return ((got.double() - want).square().sum() / want.square().sum().clamp_min(1e-300)).item()


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("t,h,n,r,lora", [(1, 2, 16, 8, 128), (3, 3, 24, 16, 40), (2, 1, 8, 2, 64), (4, 2, 12, 6, 100)])
def test_matches_the_float64_reference(t, h, n, r, lora, is_neox):
    q, kv, w_uk, norm_w, positions, cache = operands(t, h, n, r, lora, seed=t * 7 + h)
    q_padded = torch.zeros(t, h, n + r + 3)[..., : n + r]  # a gap after each head's channels
    q_padded.copy_(q)
    args = (q_padded, kv, w_uk, norm_w, 1e-6, positions, cache, is_neox)
    snap = snapshot(args)
    got_q, got_latent = mla_inputs(*args)
    assert_unmodified(snap)
    want_q, want_latent = reference.mla_inputs(q.double(), kv.double(), w_uk.double(), norm_w.double(), 1e-6,
                                               positions, cache.double(), is_neox)
    assert got_q.shape == (t, h, lora + r) and got_latent.shape == (t, lora + r)
    assert got_q.dtype == got_latent.dtype == torch.float32
    assert nmse(got_q, want_q) < 1e-12 and nmse(got_latent, want_latent) < 1e-12
    rot = reference.rotary_embedding(positions, q[..., n:].double(), kv[:, None, lora:].double(), cache.double(), is_neox)
    torch.testing.assert_close(got_q[..., lora:].double(), rot[0], rtol=1e-5, atol=1e-5)  # the rotary parts in place
    torch.testing.assert_close(got_latent[:, lora:].double(), rot[1][:, 0], rtol=1e-5, atol=1e-5)


def test_no_tokens_and_operands_that_do_not_fit():
    q, kv, w_uk, norm_w, positions, cache = operands(0, 2, 16, 8, 64)
    got_q, got_latent = mla_inputs(q, kv, w_uk, norm_w, 1e-6, positions, cache, True)
    assert got_q.shape == (0, 2, 72) and got_latent.shape == (0, 72)
    q, kv, w_uk, norm_w, positions, cache = operands(2, 2, 16, 8, 64)
    with pytest.raises(ValueError, match=r"mla_inputs: q \[2, 2, 24\], kv \[2, 71\].* do not fit"):
        mla_inputs(q, kv[:, :-1], w_uk, norm_w, 1e-6, positions, cache, True)
