"""The CPU backend's resolved ops against the reference run in float64, op by op (RoPE tables against
transformers: test_rope_tables.py).

Every op in ``OP_NAMES`` has a case in ``CASES``: fresh random inputs (never zeros), sizes of 1 and
odd sizes, and non-contiguous views whose gaps hold NaN so that an op reading outside its view
shows. The reference runs on float64 copies; tolerances are per output dtype. The sampling ops
are also checked against independent oracles for their exact mask and tie semantics.
"""

import pytest
import torch

from chitu_core.ops import OP_NAMES, reference
from chitu_core.plugins import backend_ops, get_backend

OPS = backend_ops(get_backend("cpu"))
DTYPES = (torch.float32, torch.bfloat16)
# float32 output: rounding of a few float32 operations; bfloat16 output: a few roundings to 8 bits.
TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}
NINF = float("-inf")


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values as every other element of a wider buffer whose gaps hold NaN (or -1 for ints)."""
    gap = float("nan") if t.is_floating_point() else -1
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), gap, dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def transposed(t: torch.Tensor) -> torch.Tensor:
    """t's values stored with its last two dimensions swapped in memory."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


LAYOUTS = {"contiguous": lambda t: t.contiguous(), "strided": strided, "transposed": transposed}


def upcast(a):
    return a.to(torch.float64) if torch.is_tensor(a) and a.is_floating_point() else a


def snapshot(args) -> list:
    """Copies of every tensor argument and of the whole buffer behind it."""
    out = []
    for a in args:
        if torch.is_tensor(a):
            base = a if a._base is None else a._base
            out.append((a, a.clone(), base, base.clone()))
    return out


def assert_unmodified(snap) -> None:
    for view, view_before, base, base_before in snap:
        torch.testing.assert_close(view, view_before, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(base, base_before, rtol=0, atol=0, equal_nan=True)


def run_op(name: str, *args, **kwargs):
    """(CPU backend result, float64 reference result); asserts the inputs were left untouched."""
    snap = snapshot(args)
    got = getattr(OPS, name)(*args, **kwargs)
    assert_unmodified(snap)
    want = getattr(reference, name)(*[upcast(a) for a in args], **kwargs)
    return got, want


def assert_matches(got, want, dtype: torch.dtype) -> None:
    """got has ``dtype`` and matches the float64 want within that dtype's tolerance (ints exactly)."""
    got_t, want_t = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got_t) == len(want_t)
    for g, w in zip(got_t, want_t):
        assert g.dtype == dtype, (g.dtype, dtype)
        assert g.shape == w.shape
        if dtype.is_floating_point:
            torch.testing.assert_close(g.to(torch.float64), w.to(torch.float64), **TOL[dtype])
        else:
            assert torch.equal(g, w.to(dtype))


# ----- cases: (args, kwargs, output dtype) per op and input dtype, for the generic comparison -----


def rms_norm_cases(dtype):
    for shape, layout, scale in [((1, 1), "contiguous", 3.0), ((7, 96), "strided", 3.0),
                                 ((3, 5, 33), "transposed", 3.0), ((1, 4096), "contiguous", 3.0),
                                 ((4, 9), "contiguous", 1e-3)]:  # eps matters at 1e-3
        x = LAYOUTS[layout](randn(*shape, dtype=dtype, scale=scale))
        w = strided(randn(shape[-1], dtype=dtype) + 1.0)
        yield (x, w, 1e-6), {}, dtype


def fused_add_rms_norm_cases(dtype):
    for shape, x_layout, r_layout in [((1, 1), "contiguous", "strided"), ((7, 96), "strided", "transposed"),
                                      ((3, 5, 33), "transposed", "strided")]:
        x = LAYOUTS[x_layout](randn(*shape, dtype=dtype))
        residual = LAYOUTS[r_layout](randn(*shape, dtype=dtype, scale=2.0))
        yield (x, residual, randn(shape[-1], dtype=dtype) + 1.0, 1e-5), {}, dtype


def offset_rms_norm_cases(dtype):  # contract 1.6: Gemma's weight is the offset from one
    for args, kwargs, out in rms_norm_cases(dtype):
        yield (args[0], args[1] - 1.0, args[2]), kwargs, out


def fused_add_offset_rms_norm_cases(dtype):
    for args, kwargs, out in fused_add_rms_norm_cases(dtype):
        yield (args[0], args[1], args[2] - 1.0, args[3]), kwargs, out


def layer_norm_cases(dtype):
    for shape, layout, bias in [((1, 1), "contiguous", True), ((7, 96), "strided", False),
                                ((3, 5, 33), "transposed", True), ((2, 4096), "contiguous", True)]:
        x = LAYOUTS[layout](randn(*shape, dtype=dtype, scale=2.0) + 1.5)
        b = strided(randn(shape[-1], dtype=dtype)) if bias else None
        yield (x, strided(randn(shape[-1], dtype=dtype) + 1.0), b, 1e-5), {}, dtype


def cos_sin_cache(positions: int, rot: int) -> torch.Tensor:
    angles = torch.rand(positions, rot // 2, dtype=torch.float64) * 100.0
    return torch.cat((angles.cos(), angles.sin()), -1).float()


def rotary_inputs(dtype, t, hq, hk, d, rot, layout):
    """positions [T], q [T, Hq, D], k [T, Hk, D] (slices of one packed qkv row when not contiguous)."""
    cache = cos_sin_cache(50, rot)
    positions = torch.randint(0, 50, (t,))
    qkv = randn(t, hq + 2 * hk, d, dtype=dtype)
    if layout == "contiguous":
        q, k = qkv[:, :hq].contiguous(), qkv[:, hq : hq + hk].contiguous()
    else:
        q, k, positions = qkv[:, :hq], qkv[:, hq : hq + hk], strided(positions)
    return positions, q, k, cache


def rotary_embedding_cases(dtype):
    for is_neox in (True, False):
        for t, hq, hk, d, rot, layout in [(1, 1, 1, 2, 2, "contiguous"), (7, 4, 2, 64, 64, "sliced"),
                                          (5, 3, 1, 40, 24, "sliced")]:
            yield rotary_inputs(dtype, t, hq, hk, d, rot, layout), dict(is_neox=is_neox), dtype


def silu_and_mul_cases(dtype):
    for shape, layout in [((1, 2), "contiguous"), ((7, 26), "transposed"), ((2, 3, 14), "strided")]:
        yield (LAYOUTS[layout](randn(*shape, dtype=dtype, scale=2.0)),), {}, dtype


def gelu_and_mul_cases(dtype):
    for approximate in ("none", "tanh"):
        for shape, layout in [((1, 2), "contiguous"), ((7, 26), "transposed"), ((2, 3, 14), "strided")]:
            yield (LAYOUTS[layout](randn(*shape, dtype=dtype, scale=2.0)),), dict(approximate=approximate), dtype


def linear_cases(dtype):
    for x_shape, n, layout, with_bias in [((1, 1), 1, "contiguous", True), ((7, 33), 5, "transposed", True),
                                          ((2, 3, 64), 17, "strided", False), ((5, 31), 129, "contiguous", False)]:
        x = LAYOUTS[layout](randn(*x_shape, dtype=dtype))
        weight = transposed(randn(n, x_shape[-1], dtype=dtype, scale=0.2))
        bias = strided(randn(n, dtype=dtype)) if with_bias else None
        yield (x, weight, bias), {}, dtype


def linear_float32_cases(dtype):  # contract 1.11: x in dtype, the weight float32, the output float32
    for x_shape, n, layout in [((1, 64), 8, "contiguous"), ((7, 33), 5, "transposed"), ((2, 3, 16), 17, "strided")]:
        x = LAYOUTS[layout](randn(*x_shape, dtype=dtype))
        yield (x, transposed(randn(n, x_shape[-1], scale=0.2))), {}, torch.float32


def rms_norm_linear_cases(dtype):  # contract 1.9
    for x_shape, n, layout, with_bias, act in [((1, 1), 2, "contiguous", True, None), ((7, 33), 6, "transposed", False, "silu"),
                                               ((2, 3, 16), 10, "strided", True, "gelu_tanh"), ((5, 31), 4, "contiguous", False, "gelu")]:
        x = LAYOUTS[layout](randn(*x_shape, dtype=dtype, scale=3.0))
        norm_w = strided((1 + randn(x_shape[-1], scale=0.3)).to(dtype))
        weight = transposed(randn(n, x_shape[-1], dtype=dtype, scale=0.2))
        bias = strided(randn(n, dtype=dtype)) if with_bias else None
        yield (x, norm_w, 1e-6, weight, bias), ({} if act is None else {"activation": act}), dtype


def linear_add_cases(dtype):  # contract 1.9
    for x_shape, n, layout, with_bias in [((1, 1), 1, "contiguous", True), ((7, 33), 5, "transposed", False),
                                          ((2, 3, 16), 17, "strided", True)]:
        x = LAYOUTS[layout](randn(*x_shape, dtype=dtype))
        weight = transposed(randn(n, x_shape[-1], dtype=dtype, scale=0.2))
        residual = LAYOUTS[layout](randn(*x_shape[:-1], n, dtype=dtype, scale=2.0))
        yield (x, weight, strided(randn(n, dtype=dtype)) if with_bias else None, residual), {}, dtype


def mla_inputs_cases(dtype):  # contract 1.10
    for t, h, n, r, lora, is_neox in [(1, 2, 8, 4, 16, False), (3, 3, 12, 6, 20, True)]:
        cache = cos_sin_cache(50, r)
        q = randn(t, h * (n + r), dtype=dtype).view(t, h, n + r)
        kv = strided(randn(t, lora + r, dtype=dtype, scale=3.0))
        w_uk, norm_w = randn(h, n, lora, dtype=dtype, scale=0.3), (1 + randn(lora, scale=0.3)).to(dtype)
        yield (q, kv, w_uk, norm_w, 1e-6, torch.randint(0, 50, (t,)), cache, is_neox), {}, dtype


def embedding_cases(dtype):
    weight = transposed(randn(11, 6, dtype=dtype))
    yield (torch.randint(0, 11, (1,)), weight), {}, dtype
    yield (strided(torch.randint(0, 11, (3, 5))), weight), {}, dtype
    yield (torch.tensor([10, 0, 10, 3]), strided(randn(11, 1, dtype=dtype))), {}, dtype


def greedy_sample_cases(dtype):
    yield (randn(1, 1, dtype=dtype),), {}, torch.int64
    yield (transposed(randn(5, 1000, dtype=dtype)),), {}, torch.int64  # bfloat16: ties at the max are likely
    yield (strided(randn(3, 17, dtype=dtype)),), {}, torch.int64


def apply_temperature_cases(dtype):
    t = torch.tensor([0.5, 0.0, 1.0, 1.7, 1e-3])
    yield (transposed(randn(5, 33, dtype=dtype, scale=3.0)), t), {}, torch.float32
    yield (randn(1, 1, dtype=dtype), torch.tensor([0.3])), {}, torch.float32


def apply_top_k_top_p_cases(dtype):
    logits = transposed(randn(6, 101, scale=3.0))
    top_k = torch.tensor([0, 1, 5, 100, 101, 40])
    top_p = strided(torch.tensor([1.0, 0.5, 0.9, 0.3, 0.95, 1.0]))
    yield (logits, top_k, top_p), {}, torch.float32
    yield (randn(1, 1), torch.tensor([1]), torch.tensor([0.5])), {}, torch.float32


def apply_min_p_cases(dtype):
    yield (transposed(randn(4, 101, scale=3.0)), torch.tensor([0.0, 0.05, 0.3, 1.0])), {}, torch.float32
    yield (randn(1, 1), torch.tensor([0.5])), {}, torch.float32


def apply_penalties_cases(dtype):
    b, vocab = 6, 101
    logits = randn(b, vocab, scale=3.0)
    logits[:, ::17] = NINF  # banned tokens stay banned
    prompt_mask = torch.rand(b, vocab) < 0.3
    counts = torch.randint(1, 5, (b, vocab)) * (torch.rand(b, vocab) < 0.4)
    repetition = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0, 1.1])  # row 4: no penalty at all
    frequency = torch.tensor([0.0, 0.5, -0.4, 2.0, 0.0, -2.0])
    presence = torch.tensor([0.0, 0.0, 1.5, -2.0, 0.0, 0.3])
    for count_dtype, layout in [(torch.int32, strided), (torch.int64, transposed)]:
        yield (transposed(logits), strided(prompt_mask), layout(counts.to(count_dtype)), strided(repetition),
               frequency, strided(presence)), {}, torch.float32
    yield (randn(1, 1), torch.tensor([[True]]), torch.tensor([[2]]), torch.tensor([1.5]), torch.tensor([0.5]),
           torch.tensor([0.25])), {}, torch.float32


def random_sample_cases(dtype):
    for b, v in [(1, 1), (8, 257)]:
        probs = transposed(randn(b, v, scale=2.0).softmax(-1))
        exponentials = strided(torch.empty(b, v).exponential_())
        yield (probs, exponentials), {}, torch.int64


def log_softmax_cases(dtype):
    yield (transposed(randn(5, 33, dtype=dtype, scale=4.0)),), {}, torch.float32
    yield (strided(randn(1, 1, dtype=dtype)),), {}, torch.float32


CASES = {name: globals()[f"{name}_cases"] for name in OP_NAMES if f"{name}_cases" in globals()}
MOE_OPS = {"moe_route", "fused_experts", "fused_experts_fp8"}  # test_moe_ops.py, test_quant_moe.py: ids as sets, sums by NMSE
QUANT_OPS = {"int4_linear", "int8_linear", "fp8_linear", "gguf_linear",  # tests/test_quant_*.py, test_triton_*.py
             "int4_rms_norm_linear", "int4_linear_add"}  # (contract 1.18) test_nvidia_pairs_gemv.py, conformance
FLOAT32_ONLY = {"apply_top_k_top_p", "apply_min_p", "apply_penalties", "random_sample"}  # the contract takes float32 there
SUMMED = {"rms_norm_linear", "linear_add", "mla_inputs"}  # bfloat16: a sum rounded two or three ways, judged by NMSE in conformance


def test_every_op_has_a_case():
    assert set(CASES) | MOE_OPS | QUANT_OPS == set(OP_NAMES)


@pytest.mark.parametrize(
    "name,dtype",
    [(n, d) for n in CASES for d in DTYPES if d == torch.float32 or n not in FLOAT32_ONLY | SUMMED],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_op_matches_float64_reference(name, dtype):
    for args, kwargs, out_dtype in CASES[name](dtype):
        got, want = run_op(name, *args, **kwargs)
        assert_matches(got, want, out_dtype)


# ----- semantics against independent oracles -----


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32])
def test_rotary_embedding_is_a_complex_rotation(is_neox, rot):
    """Rotating pair (a, b) by angle t is (a + ib) * e^{it}; channels past the rotary dim pass through."""
    positions, q, k, cache = rotary_inputs(torch.float32, 9, 4, 2, 64, rot, "sliced")
    got_q, got_k = OPS.rotary_embedding(positions, q, k, cache, is_neox)
    cos, sin = cache[positions].double().chunk(2, -1)
    rotation = torch.complex(cos, sin)[:, None, :]
    for x, got in ((q, got_q), (k, got_k)):
        x = x.double()
        first, second = (x[..., : rot // 2], x[..., rot // 2 : rot]) if is_neox else (x[..., 0:rot:2], x[..., 1:rot:2])
        z = torch.complex(first, second) * rotation
        want = x.clone()
        if is_neox:
            want[..., : rot // 2], want[..., rot // 2 : rot] = z.real, z.imag
        else:
            want[..., 0:rot:2], want[..., 1:rot:2] = z.real, z.imag
        torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
        assert torch.equal(got[..., rot:], x[..., rot:].float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_is_exact(dtype):
    weight = randn(13, 7, dtype=dtype)
    ids = torch.randint(0, 13, (4, 9))
    assert torch.equal(OPS.embedding(ids, weight), weight[ids])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_sample_ties_take_the_lowest_index(dtype):
    logits = randn(4, 10, dtype=dtype)
    logits[0, [2, 7]] = 9.0
    logits[1, [0, 9]] = 9.0
    logits[2, [9, 3, 5]] = 9.0
    logits[3] = 1.5  # every entry ties
    assert OPS.greedy_sample(logits).tolist() == [2, 0, 3, 0]
    assert OPS.greedy_sample(transposed(logits)).tolist() == [2, 0, 3, 0]


def test_apply_temperature_divides_and_leaves_zero_temperature_rows_unscaled():
    logits = randn(3, 8, scale=3.0)
    got = OPS.apply_temperature(logits, torch.tensor([2.0, 0.0, 0.25]))
    assert torch.equal(got, torch.stack((logits[0] / 2.0, logits[1], logits[2] * 4.0)))


def kept(x: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row != NINF).flatten().tolist() for row in x]


def test_top_k_keeps_every_tie_at_the_kth_value():
    # Row 0: values 5,4,4,4,3,...: k=2 and k=4 both keep the three 4s.
    logits = torch.tensor([[4.0, 3.0, 4.0, 5.0, 1.0, 4.0, 2.0]] * 2 + [[2.0] * 7])
    got = OPS.apply_top_k_top_p(logits, torch.tensor([2, 4, 1]), torch.ones(3))
    assert kept(got) == [[0, 2, 3, 5], [0, 2, 3, 5], list(range(7))]
    assert torch.equal(got[got != NINF], logits[got != NINF])
    assert torch.equal(got, reference.apply_top_k_top_p(logits, torch.tensor([2, 4, 1]), torch.ones(3)))


def test_top_k_random_ties_match_the_oracle():
    logits = torch.randint(-3, 4, (16, 40)).float()  # many ties
    top_k = torch.randint(1, 40, (16,))
    got = OPS.apply_top_k_top_p(logits, top_k, torch.ones(16))
    kth = logits.sort(-1, descending=True).values.gather(1, (top_k - 1)[:, None])
    assert torch.equal(got, logits.masked_fill(logits < kth, NINF))


def test_top_k_and_top_p_disabled_values_keep_everything():
    vocab = 50
    logits = randn(5, vocab, scale=3.0)
    for k in (0, -1, vocab, vocab + 7):
        assert torch.equal(OPS.apply_top_k_top_p(logits, torch.full((5,), k), torch.ones(5)), logits)


def test_top_p_one_keeps_even_negligible_tokens():
    """top_p = 1 disables top-p, even where the float cumulative sum reaches 1 before the last token."""
    logits = randn(8, 32000, scale=5.0)
    for ops in (OPS, reference):
        assert torch.equal(ops.apply_top_k_top_p(logits, torch.zeros(8, dtype=torch.int64), torch.ones(8)), logits)
        got = ops.apply_top_k_top_p(logits, torch.full((8,), 10), torch.ones(8))
        kth = logits.topk(10, dim=-1).values[:, -1:]
        assert torch.equal(got, logits.masked_fill(logits < kth, NINF))


def top_p_oracle(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest most-probable prefix whose probability reaches top_p (float64, row by row)."""
    out = logits.clone()
    for row, p in zip(out, top_p.tolist()):
        probs = row.double().softmax(-1)
        order = probs.argsort(descending=True)
        n = int((probs[order].cumsum(-1) < p).sum()) + 1  # tokens needed to reach p
        row[order[n:]] = NINF
    return out


def test_top_p_keeps_the_smallest_set_reaching_p():
    b, vocab = 12, 64
    logits = randn(b, vocab, scale=2.0)
    sorted_probs = logits.double().softmax(-1).sort(-1, descending=True).values
    cum = sorted_probs.cumsum(-1)
    # p halfway between two cumulative sums, so the boundary is far from any rounding.
    j = torch.randint(0, vocab - 1, (b,))
    j[0] = 0  # p below the top token's probability: only the argmax remains
    top_p = ((cum.gather(1, j[:, None]) + cum.gather(1, j[:, None] + 1)) / 2)[:, 0].float()
    top_p[0] = float(sorted_probs[0, 0]) / 2
    got = OPS.apply_top_k_top_p(logits, torch.zeros(b, dtype=torch.int64), top_p)
    assert torch.equal(got, top_p_oracle(logits, top_p))
    assert kept(got)[0] == [int(logits[0].argmax())]
    assert [len(r) for r in kept(got)] == [1] + (j[1:] + 2).tolist()


def test_top_p_applies_to_what_top_k_kept():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    # After top-k=3 the probabilities are softmax([3, 2, 1]) = 0.665, 0.245, 0.090.
    got = OPS.apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.8]))
    assert kept(got) == [[0, 1]]
    got = OPS.apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.95]))
    assert kept(got) == [[0, 1, 2]]
    got = OPS.apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1e-6]))
    assert kept(got) == [[0]]


def test_top_k_top_p_random_batch_matches_the_oracle():
    b, vocab = 16, 97
    logits = randn(b, vocab, scale=3.0)
    top_k = torch.randint(0, vocab + 3, (b,))
    top_p = torch.rand(b) * 0.98 + 0.01
    top_p[::4] = 1.0
    got = OPS.apply_top_k_top_p(logits, top_k, top_p)
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    kth = logits.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
    want = top_p_oracle(logits.masked_fill(logits < kth, NINF), top_p)
    assert torch.equal(got, want)


def test_min_p_removes_tokens_below_a_fraction_of_the_top_probability():
    logits = randn(6, 80, scale=3.0)
    min_p = torch.tensor([0.0, 0.02, 0.1, 0.5, 1.0, 0.3])
    logits[5, [4, 9]] = 20.0  # two tied top tokens: min_p keeps both
    got = OPS.apply_min_p(logits, min_p)
    probs = logits.double().softmax(-1)
    ratio = probs / probs.amax(-1, keepdim=True)
    margin = (ratio - min_p.double()[:, None]).abs()[1:]
    assert (margin[ratio[1:] < 1] > 2e-6).all()  # no ratio within float32 rounding of its min_p
    assert torch.equal(got, logits.masked_fill(ratio < min_p.double()[:, None], NINF))
    assert kept(got)[5] == [4, 9]
    assert kept(got)[0] == list(range(80))
    extreme = torch.tensor([[0.0, -200.0, -1e4]])  # probabilities that underflow are kept when min_p = 0
    assert torch.equal(OPS.apply_min_p(extreme, torch.tensor([0.0])), extreme)


def test_apply_penalties_on_a_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.0, 3.0, -4.0, 1.0], [2.0, -1.0, NINF, 3.0, -4.0, 1.0]])
    prompt_mask = torch.tensor([[True, True, True, False, False, False]] * 2)
    counts = torch.tensor([[0, 0, 2, 1, 3, 0]] * 2, dtype=torch.int32)
    # Row 0: repetition 2 divides positive / multiplies negative seen logits, then - 0.5 * count - 0.25.
    # Row 1: repetition 0.5 encourages, frequency -1 rewards each occurrence, no presence term.
    want = torch.tensor([[1.0, -2.0, 0.0 * 2 - 0.5 * 2 - 0.25, 3.0 / 2 - 0.5 - 0.25, -4.0 * 2 - 1.5 - 0.25, 1.0],
                         [4.0, -0.5, NINF, 3.0 / 0.5 + 1.0, -4.0 * 0.5 + 3.0, 1.0]])
    assert want[0].tolist() == [1.0, -2.0, -1.25, 0.75, -9.75, 1.0]
    args = (torch.tensor([2.0, 0.5]), torch.tensor([0.5, -1.0]), torch.tensor([0.25, 0.0]))
    for ops in (OPS, reference):
        for c in (counts, counts.long()):
            got = ops.apply_penalties(logits, prompt_mask, c, *args)
            assert got.dtype == torch.float32 and torch.equal(got, want), (ops, got)


def test_neutral_penalties_leave_logits_exactly_unchanged():
    b, vocab = 8, 1000
    logits = randn(b, vocab, scale=5.0)
    logits[:, ::7] = NINF
    prompt_mask = torch.rand(b, vocab) < 0.5
    counts = torch.randint(0, 50, (b, vocab))
    repetition, frequency, presence = torch.ones(b), torch.zeros(b), torch.zeros(b)
    for ops in (OPS, reference):
        assert torch.equal(ops.apply_penalties(logits, prompt_mask, counts, repetition, frequency, presence), logits)
    # Neutral rows stay exact beside penalized ones; a penalized row changes only where a token was seen.
    repetition[3], frequency[5], presence[6] = 1.7, 0.3, -0.8
    got = OPS.apply_penalties(logits, prompt_mask, counts, repetition, frequency, presence)
    neutral = [0, 1, 2, 4, 7]
    assert torch.equal(got[neutral], logits[neutral])
    seen = prompt_mask | (counts > 0)
    assert torch.equal(got[3][~seen[3]], logits[3][~seen[3]]) and not torch.equal(got[3], logits[3])
    assert torch.equal(got[5][counts[5] == 0], logits[5][counts[5] == 0])
    assert torch.equal(got[6], torch.where(counts[6] > 0, logits[6] + 0.8, logits[6]))


def test_random_sample_is_argmax_of_probs_over_exponentials():
    b, vocab = 64, 33
    probs = randn(b, vocab, scale=2.0).softmax(-1)
    probs[:, ::3] = 0.0  # excluded tokens
    probs /= probs.sum(-1, keepdim=True)
    exponentials = torch.empty(b, vocab).exponential_()
    got = OPS.random_sample(probs, exponentials)
    assert torch.equal(got, (probs.double() / exponentials.double()).argmax(-1))
    assert (got % 3 != 0).all()


def test_log_softmax_rows_are_normalized_log_probabilities():
    logits = randn(4, 1000, scale=10.0)
    got = OPS.log_softmax(logits)
    torch.testing.assert_close(got.double().exp().sum(-1), torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-5)
    want = logits.double() - logits.double().logsumexp(-1, keepdim=True)
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
