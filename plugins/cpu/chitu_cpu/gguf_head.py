"""A vocabulary head of GGUF Q8_0 blocks multiplied where the tied embedding keeps them, in one C++ kernel.

y[m, n] = sum_k x[m, k] * W[n, k], W the blocks' exact values: a Q8_0 block is an fp16 scale d and 32 int8
q (34 bytes), W = d * q, exact in float32 (11 + 8 significant bits). x is float32 or bfloat16 [M, K] (a
decode batch, or a prefill's last rows), read in its own dtype; the products are float32 and so is the
sum, and y comes back in x's dtype. Nothing is copied or repacked: the kernel reads the blocks the
embedding looks rows up in, so a tied head costs no memory of its own.

Work: the N rows are cut into chunks of 64 spread over the OpenMP threads (an explicit count: the caller's
``torch.get_num_threads()``). A thread takes its chunk tile by tile, MT rows of x against NT rows of W
held in registers (16 accumulators of 16 lanes at MT = NT = 4), every M tile in turn, so a chunk's blocks
come from memory once and from the core's cache for the other tiles: batch 16 reads the 30 MB head of
SmolLM2 once, not 16 times. Each block's 32 int8 become two float vectors scaled by d once per NT tile and
serve MT rows of x; a single row of x (batch 1) takes 8 rows of W at a time and scales each block's sum by
d instead. The rows two tiles ahead are prefetched while a tile is computed: NT rows of 612 bytes are NT
short streams at once, and the hardware prefetcher alone left batch 1 at a fifth of the memory's speed
(SmolLM2's head on one core of the development machine: 3.0 ms without, 0.74 ms with). Lanes are explicit
(GCC/Clang vector extensions, AVX-512 intrinsics for widening int8), as in ``chitu_cpu.decode_kernel``.

The kernel is compiled once per x dtype and machine (``chitu_cpu.native.build``); ``head_kernel(dtype)`` is
None where it cannot be built (no compiler, logged once), and ``chitu_cpu.packed`` then keeps the int4pack
head. Inside a compiled forward ``q8_0_head_op`` is an opaque operator (a Meta impl gives its shape).
"""

import functools
import logging

import torch

from chitu_cpu.native import build

log = logging.getLogger(__name__)

Q8_0_BYTES = 34  # an fp16 scale and 32 int8

_SOURCE = r"""
typedef SCALAR T;
typedef int8_t VB __attribute__((vector_size(16)));
typedef int16_t VS __attribute__((vector_size(32)));
constexpr int64_t BYTES = 34, CHUNK = 64, AHEAD = 2;  // a chunk's 64 rows of blocks (39 KB at K = 576) stay in L2

static inline V quants(const uint8_t* p) {  // 16 int8 as floats
#ifdef __AVX512F__  // one vpmovsxbd: GCC 12 widens int8 vectors to int32 lane by lane (scalar code)
    return (V)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    VB b; std::memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(b, VS), VI), V);
#endif
}
static inline float half(const uint8_t* p) {  // an IEEE half float, little-endian, at p
    uint16_t h; std::memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) { const float f = float(m) * 5.9604644775390625e-8f; return sign ? -f : f; }  // subnormal: m 2^-24
    const uint32_t u = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f; std::memcpy(&f, &u, 4); return f;
#endif
}
// rows m0 .. m0 + MT of x against rows n0 .. n0 + NT of the blocks
template <int MT, int NT>
static inline void tile(const T* x, const uint8_t* w, T* y, int64_t m0, int64_t n0, int64_t N, int64_t nb,
                        int64_t sx, int64_t sw) {
    V acc[MT][NT] = {};
    // the rows AHEAD tiles on, prefetched a share each block (see the module docstring)
    const char* ahead = reinterpret_cast<const char*>(w + (n0 + AHEAD * NT) * sw);
    const int64_t share = (NT * sw + nb - 1) / nb;
    for (int64_t b = 0; b < nb; ++b) {
        for (int64_t o = b * share; o < (b + 1) * share; o += 64) __builtin_prefetch(ahead + o);
        const uint8_t* blk = w + n0 * sw + b * BYTES;
        if constexpr (MT == 1) {  // one row of x: each block's sum scaled by d once (3 vector ops, not 4)
            const V x0 = load(x + m0 * sx + b * 32), x1 = load(x + m0 * sx + b * 32 + 16);
            for (int j = 0; j < NT; ++j) {
                const uint8_t* p = blk + j * sw;
                V t = x0 * quants(p + 2);
                t += x1 * quants(p + 18);
                acc[0][j] += t * half(p);
            }
        } else {  // the block's values d * q made once (exact: 19 significant bits) for MT rows of x
            V lo[NT], hi[NT];
            for (int j = 0; j < NT; ++j) {
                const uint8_t* p = blk + j * sw;
                const float d = half(p);
                lo[j] = quants(p + 2) * d;
                hi[j] = quants(p + 18) * d;
            }
            for (int i = 0; i < MT; ++i) {
                const T* xr = x + (m0 + i) * sx + b * 32;
                const V x0 = load(xr), x1 = load(xr + 16);
                for (int j = 0; j < NT; ++j) {
                    acc[i][j] += x0 * lo[j];
                    acc[i][j] += x1 * hi[j];
                }
            }
        }
    }
    for (int i = 0; i < MT; ++i) for (int j = 0; j < NT; ++j) put(y + (m0 + i) * N + n0 + j, hsum(acc[i][j]));
}

template <int MT>
static void rows(const T* x, const uint8_t* w, T* y, int64_t m0, int64_t n0, int64_t n1, int64_t N, int64_t nb,
                 int64_t sx, int64_t sw) {
    constexpr int NT = MT == 1 ? 8 : 4;  // at batch 1 more rows of W in flight instead
    int64_t n = n0;
    for (; n + NT <= n1; n += NT) tile<MT, NT>(x, w, y, m0, n, N, nb, sx, sw);
    for (; n < n1; ++n) tile<MT, 1>(x, w, y, m0, n, N, nb, sx, sw);
}

extern "C" void kernel(const T* x, const uint8_t* w, T* y, const int64_t M, const int64_t N, const int64_t K,
                       const int64_t sx, const int64_t sw, const int64_t threads) {
    const int64_t nb = K / 32, chunks = (N + CHUNK - 1) / CHUNK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t n0 = c * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) rows<4>(x, w, y, m, n0, n1, N, nb, sx, sw);
        switch (M - m) {
            case 3: rows<3>(x, w, y, m, n0, n1, N, nb, sx, sw); break;
            case 2: rows<2>(x, w, y, m, n0, n1, N, nb, sx, sw); break;
            case 1: rows<1>(x, w, y, m, n0, n1, N, nb, sx, sw); break;
        }
    }
}
"""

_SCALARS = {torch.float32: "float", torch.bfloat16: "uint16_t"}


@functools.cache
def head_kernel(dtype: torch.dtype):
    """The compiled kernel for x of ``dtype``, or None (no such kernel, or no compiler: logged once)."""
    if dtype not in _SCALARS:
        return None
    t = _SCALARS[dtype]
    try:
        return build(f"chitu_q8_0_head_{t}", _SOURCE.replace("SCALAR", t),
                     [f"const {t}*", "const uint8_t*", f"{t}*"] + ["const int64_t"] * 6)
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, or it failed
        log.warning("the CPU Q8_0 head kernel could not be built (%s); the head takes the int4pack path", e)
        return None


def q8_0_head(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x float32 or bfloat16 [M, K] (K a multiple of 32) times the Q8_0 blocks uint8 [N, K / 32 * 34]
    (rows of unit stride) transposed: [M, N] in x's dtype, float32 arithmetic."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if blocks.stride(-1) != 1:
        blocks = blocks.contiguous()
    (m, k), n = x.shape, blocks.shape[0]
    if k % 32 or blocks.shape[1] != k // 32 * Q8_0_BYTES:
        raise ValueError(f"x [{m}, {k}] against Q8_0 blocks {tuple(blocks.shape)}: K must be whole blocks of 32")
    y = torch.empty(m, n, dtype=x.dtype)
    head_kernel(x.dtype)(x.data_ptr(), blocks.data_ptr(), y.data_ptr(), m, n, k, x.stride(0), blocks.stride(0),
                         torch.get_num_threads())
    return y


# ``q8_0_head`` as an operator for torch.compile (torch.library.Library: the custom_op decorator's wrapper
# costs ~100 us a call). A fragment: chitu_cpu.attention defines the namespace.
_LIBRARY = torch.library.Library("chitu_cpu", "FRAGMENT")
_LIBRARY.define("q8_0_head(Tensor x, Tensor blocks) -> Tensor")
_LIBRARY.impl("q8_0_head", q8_0_head, "CPU")
_LIBRARY.impl("q8_0_head", lambda x, blocks: x.new_empty(x.shape[0], blocks.shape[0]), "Meta")
q8_0_head_op = torch.ops.chitu_cpu.q8_0_head
