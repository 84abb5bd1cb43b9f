"""A decode step's paged attention in one C++ kernel: each sequence's keys and values read where they lie in the
cache (no gather), the new token's key and value stored first and read back with the rest.

Work is cut into units of (sequence, chunk of positions), spread over the OpenMP threads: a unit reads each
cache row of its chunk once (all kv heads: whole rows, in the order they lie), scoring each key against its G
= Hq / Hk query heads, then each value row once for them (softmax partials: the chunk's maximum, sum and
weighted values); a second loop over (sequence, query head) combines the chunks. Chunks are cut so that there
are about four units a thread (at batch 1 a thread would else hold the whole context), at most 512 positions
each, and the rows a few positions ahead are prefetched (a block boundary is a jump). Lanes are explicit
(GCC/Clang vector extensions), the exponential a polynomial. Measured on the 2-core development machine,
SmolLM2's layer (9 query heads, 3 kv heads of 64) at 512 positions: 39-42 us against 78-96 us for the compiled
``decode_attention``; at 1,024, 70 against 174-201 (scratch bench, 30 layers in one compiled graph). float32
arithmetic for float32 and bfloat16 models with caches of their dtype, and for float32 models with float16 or
bfloat16 caches (contract 1.15); a window hides positions before seq_len - window.

The kernel is compiled once per dtype pair and machine (``chitu_cpu.native.build``: the C++ compiler, OpenMP, kept
on disk) and called with the tensors' data pointers. ``decode_kernel(dtype, cache_dtype)`` is None where it cannot be built
(no compiler); the attention then takes its portable path.
"""

import functools
import logging
from dataclasses import dataclass

import torch

from chitu_core.attention.contract import AttentionMetadata
from chitu_cpu.native import build

log = logging.getLogger(__name__)

MAX_CHUNK = 512
MAX_HEAD_DIM = 1024

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <limits>
#include <omp.h>

typedef SCALAR T;  // q, k, v and the output: the model dtype
typedef CACHE C;   // the cache's elements: T, or (contract 1.15) a float32 model's float16 or bfloat16
typedef _Float16 VF16 __attribute__((vector_size(32)));
constexpr int W = 16;
constexpr int64_t AHEAD = 8;  // positions prefetched ahead: a sequence's blocks lie anywhere in the cache

static inline V splat(float x) { return V{} + x; }
static inline V load(const _Float16* p) {  // float16
#ifdef __AVX512F__  // one vcvtph2ps: GCC 12 converts a _Float16 vector in quarters, with shuffles between
    return (V)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
    VF16 h; std::memcpy(&h, p, sizeof h); return __builtin_convertvector(h, V);
#endif
}
static inline void store(float* p, V x) { std::memcpy(p, &x, sizeof x); }
static inline float scalar(float x) { return x; }
static inline float scalar(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline float hmax(V x) { float s = x[0]; for (int i = 1; i < W; ++i) s = std::max(s, x[i]); return s; }
static inline V vmax(V a, V b) { return a > b ? a : b; }
template <typename P> static inline void prefetch(const P* p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + i);
}
static inline V vexp(V x) {  // e^x for x <= 0: 2^n e^r, |r| <= ln2 / 2, degree-6 Taylor (relative error ~2e-7)
    const V t = x * 1.44269504f;
    VI n = __builtin_convertvector(t - 0.5f, VI);  // round to nearest: t <= 0
    const V nf = __builtin_convertvector(n, V);
    const V r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;
    V p = splat(1.f / 720);
    for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + c;
    VI bits = (n + 127) << 23;
    V scale; std::memcpy(&scale, &bits, sizeof scale);
    return x < -87.f ? splat(0.f) : p * scale;
}
static inline void put(_Float16* p, float x) { *p = _Float16(x); }  // to nearest even, as torch rounds

extern "C" void kernel(const T* q, const T* k, const T* v, C* cache, const int32_t* tables, const int32_t* seq_lens,
                       const int64_t* slots, T* out, float* work, const int64_t B, const int64_t Hq, const int64_t Hk,
                       const int64_t D, const int64_t BS, const int64_t table_stride, const int64_t half,
                       const int64_t window, const int64_t* plan, const int64_t sq0, const int64_t sq1,
                       const int64_t sk0, const int64_t sk1, const int64_t sv0, const int64_t sv1, const float scale) {
    const int64_t G = Hq / Hk, row = Hk * D, Dv = D / W;  // D a multiple of W (``fits`` checks)
    const int64_t chunk = plan[0], nchunks = plan[1], threads = plan[2];
    const int64_t per_unit = Hq * D + 2 * Hq;  // a unit's partials, kept for the combination
    const float neg = -std::numeric_limits<float>::infinity();
    for (int64_t b = 0; b < B; ++b) {  // the new keys and values stored first, as the cache rounds them
        if (slots[b] < 0) continue;
        for (int64_t h = 0; h < Hk; ++h)
            for (int64_t d = 0; d < D; ++d) {
                put(cache + slots[b] * row + h * D + d, scalar(k[b * sk0 + h * sk1 + d]));
                put(cache + half + slots[b] * row + h * D + d, scalar(v[b * sv0 + h * sv1 + d]));
            }
    }
    #pragma omp parallel num_threads(threads)
    {
    float* qf = work + B * nchunks * per_unit + omp_get_thread_num() * (Hq * D + Hq * chunk);  // [Hq, D], scaled
    float* sc = qf + Hq * D;  // [Hq, chunk]: scores, then their exponentials
    #pragma omp for schedule(static)
    for (int64_t u = 0; u < B * nchunks; ++u) {
        const int64_t b = u / nchunks, c = u % nchunks;
        float* m = work + u * per_unit;  // [Hq]: the chunk's largest score (-inf where it is empty)
        float* l = m + Hq;               // [Hq]: the sum of the exponentials
        float* acc = l + Hq;             // [Hq, D]: the exponentials' weighted values
        for (int64_t i = 0; i < Hq; ++i) { m[i] = neg; l[i] = 0.f; }
        std::fill(acc, acc + Hq * D, 0.f);
        const int64_t L = seq_lens[b];
        const int64_t lo = window > 0 ? std::max<int64_t>(0, L - window) : 0;
        const int64_t t0 = lo + c * chunk, t1 = std::min(L, t0 + chunk), n = t1 - t0;
        if (n <= 0) continue;
        for (int64_t i = 0; i < Hq; ++i)
            for (int64_t d = 0; d < D; d += W) store(qf + i * D + d, load(q + b * sq0 + i * sq1 + d) * scale);
        const int32_t* table = tables + b * table_stride;
        auto at = [&](const C* base, int64_t t) { return base + (int64_t(table[t / BS]) * BS + t % BS) * row; };
        for (int64_t i = 0; i < n; ++i) {  // scores: each key row read once, for its G query heads
            const int64_t t = t0 + i;
            if (t + AHEAD < L) prefetch(at(cache, t + AHEAD), row * sizeof(C));
            for (int64_t h = 0; h < Hk; ++h) {
                const C* key = at(cache, t) + h * D;
                for (int64_t g = h * G; g < (h + 1) * G; ++g) {
                    V s = V{};
                    for (int64_t j = 0; j < Dv; ++j) s += load(qf + g * D + j * W) * load(key + j * W);
                    sc[g * chunk + i] = hsum(s);
                }
            }
        }
        for (int64_t g = 0; g < Hq; ++g) {  // the chunk's softmax partials
            float* row_g = sc + g * chunk;
            int64_t i = 0;
            V vt = splat(neg);
            for (; i + W <= n; i += W) vt = vmax(vt, load(row_g + i));
            float top = hmax(vt);
            for (; i < n; ++i) top = std::max(top, row_g[i]);
            m[g] = top;
            V vs = V{};
            float sum = 0.f;
            for (i = 0; i + W <= n; i += W) {
                const V e = vexp(load(row_g + i) - top);
                store(row_g + i, e);
                vs += e;
            }
            for (; i < n; ++i) { row_g[i] = std::exp(row_g[i] - top); sum += row_g[i]; }
            l[g] = sum + hsum(vs);
        }
        for (int64_t i = 0; i < n; ++i) {  // values: each row read once, for its G query heads
            const int64_t t = t0 + i;
            if (t + AHEAD < L) prefetch(at(cache + half, t + AHEAD), row * sizeof(C));
            for (int64_t h = 0; h < Hk; ++h) {
                const C* val = at(cache + half, t) + h * D;
                for (int64_t g = h * G; g < (h + 1) * G; ++g) {
                    const V p = splat(sc[g * chunk + i]);
                    float* a = acc + g * D;
                    for (int64_t j = 0; j < Dv; ++j) store(a + j * W, load(a + j * W) + p * load(val + j * W));
                }
            }
        }
    }
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < B * Hq; ++r) {  // the chunks combined
        const int64_t b = r / Hq, g = r % Hq;
        float o[MAX_HEAD_DIM];
        std::fill(o, o + D, 0.f);
        const float* first = work + b * nchunks * per_unit;  // chunk 0's m
        float top = neg, den = 0.f;
        for (int64_t c = 0; c < nchunks; ++c) top = std::max(top, first[c * per_unit + g]);
        if (top != neg) {
            for (int64_t c = 0; c < nchunks; ++c) {
                const float* base = first + c * per_unit;
                if (base[g] == neg) continue;
                const float w = std::exp(base[g] - top);
                den += w * base[Hq + g];
                const float* a = base + 2 * Hq + g * D;
                for (int64_t d = 0; d < D; d += W) store(o + d, load(o + d) + w * load(a + d));
            }
            for (int64_t d = 0; d < D; d += W) store(o + d, load(o + d) / den);
        }
        T* dst = out + r * D;
        for (int64_t d = 0; d < D; ++d) put(dst + d, o[d]);
    }
    }  // omp parallel
}
"""

_SCALARS = {torch.float32: "float", torch.bfloat16: "uint16_t", torch.float16: "_Float16"}
KINDS = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
         (torch.float32, torch.bfloat16)}
"""(model dtype, cache dtype) pairs the kernel is built for."""


def _argtypes(t: str, c: str) -> list[str]:
    return [f"const {t}*", f"const {t}*", f"const {t}*", f"{c}*", "const int32_t*", "const int32_t*", "const int64_t*",
            f"{t}*", "float*"] + ["const int64_t"] * 8 + ["const int64_t*"] + ["const int64_t"] * 6 + ["const float"]


@functools.cache
def decode_kernel(dtype: torch.dtype, cache_dtype: torch.dtype | None = None):
    """The compiled kernel for a model of ``dtype`` and a cache of ``cache_dtype`` (default: the same), or
    None (no such kernel, or no compiler: logged once)."""
    cache_dtype = cache_dtype or dtype
    if (dtype, cache_dtype) not in KINDS:
        return None
    t, c = _SCALARS[dtype], _SCALARS[cache_dtype]
    try:
        source = _SOURCE.replace("SCALAR", t).replace("CACHE", c).replace("MAX_HEAD_DIM", str(MAX_HEAD_DIM))
        return build(f"chitu_decode_{t}_{c}".replace("_Float16", "half"), source, _argtypes(t, c))
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, or it failed
        log.warning("the CPU decode-attention kernel could not be built (%s); decode steps take the portable path", e)
        return None


def chunking(max_len: int, units: int, threads: int) -> tuple[int, int]:
    """(chunk, number of chunks) for ``units`` sequences and contexts up to ``max_len``:
    about four units a thread, chunks of at least 16 positions and at most MAX_CHUNK."""
    n = max(1, min(-(-max_len // 16), -(-4 * threads // units)), -(-max_len // MAX_CHUNK))
    chunk = -(-max_len // n)
    return chunk, -(-max_len // chunk)


@dataclass
class DecodePlan:
    """A decode step's split for ``paged_decode``, made once a step and shared by its layers."""
    slots: torch.Tensor  # int64 [B]: where each sequence's new key and value go
    plan: torch.Tensor  # int64 [3]: positions a chunk, chunks a sequence, threads
    work: torch.Tensor  # float32: each unit's partials, then each thread's scratch; reused layer after layer

    @classmethod
    def of(cls, meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int) -> "DecodePlan":
        b, threads = meta.num_seqs, torch.get_num_threads()
        chunk, n = chunking(max(meta.max_seq_len, 1), b, threads)
        work = torch.empty(num_heads * (b * n * (head_dim + 2) + threads * (head_dim + chunk)), dtype=torch.float32)
        return cls(meta.slot_mapping, torch.tensor([chunk, n, threads]), work)


def fits(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decode steps of this model dtype, cache dtype and head size can take the kernel (building it here)."""
    return head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and decode_kernel(dtype, cache_dtype) is not None


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, slots: torch.Tensor, plan: torch.Tensor, work: torch.Tensor, scale: float,
                 window: int) -> torch.Tensor:
    """q [B, Hq, D], k and v [B, Hk, D] (one new token a sequence, the model dtype, unit stride along D); the
    cache [2, blocks, block_size, Hk, D] (one of ``KINDS`` with q's dtype); block_tables int32 [B, n] and seq_lens int32 [B] (the new token
    included) as the metadata has them; slots, plan and work a ``DecodePlan``'s; window 0 for none.
    Returns [B, Hq, D]. k and v are stored at ``slots`` first (rounded to the cache dtype), and every position read
    from the cache; a negative slot is not stored (its sequence then reads what its slot held: padding only)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernel steps along D by 1
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    b, hq, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype)
    pointers = (t.data_ptr() for t in (q, k, v, kv_cache, block_tables, seq_lens, slots, out, work))
    kernel = decode_kernel(q.dtype, kv_cache.dtype)
    kernel(*pointers, b, hq, kv_cache.shape[3], d, kv_cache.shape[2], block_tables.stride(0), kv_cache.numel() // 2,
           window, plan.data_ptr(), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), scale)
    return out
