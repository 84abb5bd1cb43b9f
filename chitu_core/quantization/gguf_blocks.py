"""GGUF/GGML block types: one small, exact reference dequantizer per type, as ggml-quants.c has them.

A quantized row of K values is K / E consecutive blocks of E elements stored in B bytes (``BLOCK``).
Every multi-byte field is little-endian; d/dmin/m are IEEE half floats. The layouts:

- Q4_0 (32, 18): d, qs[16]. Element j < 16 is the low nibble of qs[j], element 16 + j its high
  nibble; w = (q - 8) * d.
- Q4_1 (32, 20): d, m, qs[16], nibbles as Q4_0; w = q * d + m.
- Q8_0 (32, 34): d, qs[32] (int8); w = q * d.
- Q4_K (256, 144): d, dmin, scales[12], qs[128]. Eight sub-blocks of 32, each with a 6-bit scale sc
  and min m packed in ``scales`` (``scale_min_k4``). Element 64j + 32u + l (j < 4, u < 2, l < 32) is
  nibble u of qs[32j + l] in sub-block 2j + u; w = (d * sc) * q - dmin * m.
- Q5_K (256, 176): d, dmin, scales[12], qh[32], qs[128]: Q4_K's nibble plus a fifth bit, bit 2j + u
  of qh[l], worth 16.
- Q6_K (256, 210): ql[128], qh[64], scales[16] (int8), d. Element 128h + 32t + l (h < 2, t < 4,
  l < 32): low 4 bits are nibble t // 2 of ql[64h + 32 (t % 2) + l], high 2 bits are bits 2t, 2t + 1
  of qh[32h + l]; its scale is scales[e // 16] (e its index in the block); w = (d * sc) * (q - 32).

Every product above is exact in float32 (a half float has 11 significant bits, the integers at most
7 + 5 between them), so the only rounding is Q4_1's and the K-quants' final addition, done in
float32 as ggml does. ``dequantize`` therefore equals ggml's reference bit for bit whatever order a
kernel multiplies in, and whether or not it fuses the last multiply-add.
"""

import torch

QK_K = 256
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14  # gguf.GGMLQuantizationType values
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (QK_K, 144), Q5_K: (QK_K, 176), Q6_K: (QK_K, 210)}
"""qtype -> (E elements, B bytes) of one block."""

Tensor = torch.Tensor


def type_name(qtype: int) -> str:
    return NAMES.get(qtype, f"ggml type {qtype}")


def check_qtype(qtype: int) -> tuple[int, int]:
    """(E, B) of ``qtype``; an error lists the supported types."""
    if qtype not in BLOCK:
        supported = ", ".join(f"{name} ({t})" for t, name in NAMES.items())
        raise ValueError(f"GGUF {type_name(qtype)} is not a supported block type; supported: {supported}")
    return BLOCK[qtype]


# --- fields ------------------------------------------------------------------------------------


def _u8(blocks: Tensor, start: int, stop: int) -> Tensor:
    """Bytes [start, stop) of every block as int32 [n, stop - start]."""
    return blocks[:, start:stop].to(torch.int32)


def _half(blocks: Tensor, at: int) -> Tensor:
    """The little-endian half float at byte ``at`` of every block, as float32 [n, 1]."""
    bits = _u8(blocks, at, at + 1) | (_u8(blocks, at + 1, at + 2) << 8)
    return bits.to(torch.int16).view(torch.float16).to(torch.float32)  # int32 -> int16 wraps: the same 16 bits


def _int8(values: Tensor) -> Tensor:
    """Bytes (int32 in [0, 256)) read as two's-complement int8 values."""
    return values - ((values >> 7) << 8)


def scale_min_k4(scales: Tensor) -> tuple[Tensor, Tensor]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block from its 12 bytes (int32 [n, 12]):
    pair i < 4 is the low 6 bits of bytes i and i + 4; pair i >= 4 takes its low 4 bits from the
    low (scale) or high (min) nibble of byte i + 4 and its top 2 bits from the top 2 bits of byte
    i - 4 (scale) or byte i (min). Returns int32 [n, 8] each."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc, mn


# --- one function per type: blocks uint8 [n, B] -> float32 [n, E] -------------------------------


def _q4_0(b: Tensor) -> Tensor:
    qs = _u8(b, 2, 18)
    q = torch.cat([qs & 0xF, qs >> 4], dim=1) - 8
    return q.to(torch.float32) * _half(b, 0)


def _q4_1(b: Tensor) -> Tensor:
    qs = _u8(b, 4, 20)
    q = torch.cat([qs & 0xF, qs >> 4], dim=1)
    return q.to(torch.float32) * _half(b, 0) + _half(b, 2)


def _q8_0(b: Tensor) -> Tensor:
    return _int8(_u8(b, 2, 34)).to(torch.float32) * _half(b, 0)


def _k_sub_blocks(b: Tensor, q: Tensor) -> Tensor:
    """Q4_K/Q5_K: q int32 [n, 8, 32] by sub-block -> (d * sc) * q - dmin * m, float32 [n, 256]."""
    sc, mn = scale_min_k4(_u8(b, 4, 16))
    scale = _half(b, 0) * sc.to(torch.float32)  # [n, 8]
    low = _half(b, 2) * mn.to(torch.float32)
    return (scale[:, :, None] * q.to(torch.float32) - low[:, :, None]).reshape(-1, QK_K)


def _nibbles_by_sub_block(qs: Tensor) -> Tensor:
    """qs int32 [n, 128] -> [n, 8, 32]: sub-block 2j + u is nibble u of bytes 32j .. 32j + 31."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b: Tensor) -> Tensor:
    return _k_sub_blocks(b, _nibbles_by_sub_block(_u8(b, 16, 144)))


def _q5_k(b: Tensor) -> Tensor:
    qh = _u8(b, 16, 48)  # [n, 32]
    bit = torch.arange(8, dtype=torch.int32, device=b.device)
    high = (qh[:, None, :] >> bit[None, :, None]) & 1  # [n, 8, 32]: bit s of qh[l] for sub-block s
    return _k_sub_blocks(b, _nibbles_by_sub_block(_u8(b, 48, 176)) | (high << 4))


def _q6_k(b: Tensor) -> Tensor:
    ql = _u8(b, 0, 128).reshape(-1, 2, 1, 2, 32)  # [n, h, t // 2, t % 2, l]
    low = torch.cat([ql & 0xF, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # [n, h, t, l]
    qh = _u8(b, 128, 192).reshape(-1, 2, 1, 32)
    shift = 2 * torch.arange(4, dtype=torch.int32, device=b.device)
    high = (qh >> shift[None, None, :, None]) & 3  # [n, h, t, l]
    q = ((low | (high << 4)) - 32).reshape(-1, 16, 16)  # [n, e // 16, e % 16]
    scale = _half(b, 208) * _int8(_u8(b, 192, 208)).to(torch.float32)  # [n, 16]
    return (scale[:, :, None] * q.to(torch.float32)).reshape(-1, QK_K)


_DEQUANTIZE = {Q4_0: _q4_0, Q4_1: _q4_1, Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}


def dequantize(qbytes: Tensor, qtype: int) -> Tensor:
    """uint8 [..., nbytes] (whole blocks of ``qtype``) -> float32 [..., nbytes / B * E], equal bit for
    bit to ggml's reference dequantization. Runs on the tensor's device."""
    e, b = check_qtype(qtype)
    if qbytes.dtype != torch.uint8:
        raise ValueError(f"GGUF {type_name(qtype)} blocks must be uint8 bytes, got {qbytes.dtype}")
    if qbytes.dim() == 0 or qbytes.shape[-1] % b:
        raise ValueError(f"GGUF {type_name(qtype)}: rows of {list(qbytes.shape)[-1:]} bytes are not whole "
                         f"{b}-byte blocks")
    lead, nbytes = qbytes.shape[:-1], qbytes.shape[-1]
    blocks = qbytes.reshape(-1, b)
    return _DEQUANTIZE[qtype](blocks).reshape(*lead, nbytes // b * e)


# --- the same numbers as integers times per-group affine maps ------------------------------------


AFFINE_BITS = {Q4_0: 4, Q4_1: 4, Q8_0: 8, Q4_K: 4, Q5_K: 5}
"""Types whose every group of 32 consecutive elements is an affine map of unsigned integers (``affine_groups``),
and the integers' width. Q6_K is not: its scales change every 16 elements."""


def affine_groups(qbytes: Tensor, qtype: int) -> tuple[Tensor, Tensor, Tensor]:
    """uint8 [N, K / E * B] -> (q int32 [N, K] in [0, 2 ** AFFINE_BITS[qtype]), scale and offset float32
    [N, K / 32]) with w[n, k] = q[n, k] * scale[n, k // 32] + offset[n, k // 32], what ``dequantize``
    gives, for a kernel that wants integers and per-group maps rather than blocks. Q8_0's int8 q becomes
    q + 128 (offset -128 d)."""
    e, b = check_qtype(qtype)
    if qtype not in AFFINE_BITS:
        raise ValueError(f"GGUF {type_name(qtype)} has no groups of 32 with one scale each; types that do: "
                         f"{', '.join(NAMES[t] for t in AFFINE_BITS)}")
    n, nbytes = qbytes.shape
    blocks = qbytes.reshape(-1, b)
    if qtype in (Q4_0, Q4_1):
        qs = _u8(blocks, 2 if qtype == Q4_0 else 4, b)
        q, d = torch.cat([qs & 0xF, qs >> 4], dim=1), _half(blocks, 0)
        scale, offset = d, (-8 * d if qtype == Q4_0 else _half(blocks, 2))
    elif qtype == Q8_0:
        d = _half(blocks, 0)
        q, scale, offset = _int8(_u8(blocks, 2, 34)) + 128, d, -128 * d
    else:  # Q4_K, Q5_K: eight sub-blocks of 32
        q = _nibbles_by_sub_block(_u8(blocks, 16 if qtype == Q4_K else 48, b))
        if qtype == Q5_K:
            bit = torch.arange(8, dtype=torch.int32, device=blocks.device)
            q = q | ((((_u8(blocks, 16, 48)[:, None, :] >> bit[None, :, None]) & 1)) << 4)
        sc, mn = scale_min_k4(_u8(blocks, 4, 16))
        scale, offset = _half(blocks, 0) * sc.to(torch.float32), -(_half(blocks, 2) * mn.to(torch.float32))
    k = nbytes // b * e
    return q.reshape(n, k), scale.reshape(n, k // 32), offset.reshape(n, k // 32)


# --- random blocks for tests and conformance -----------------------------------------------------


def _half_bytes(values: Tensor) -> Tensor:
    """float32 [n] -> uint8 [n, 2]: the little-endian bytes of each value rounded to a half float."""
    bits = values.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([bits & 0xFF, bits >> 8], dim=1).to(torch.uint8)


# qtype -> (byte offsets of d and of dmin/m or None, typical |q| of its quants times typical |scale|,
# and what centres the values: the offset (in units of d) that m/dmin times its 6-bit min removes)
_SIZING = {
    Q4_0: (0, None, 4.6, 0.0), Q4_1: (0, 2, 4.6, 7.5), Q8_0: (0, None, 74.0, 0.0),
    Q4_K: (0, 2, 4.6 * 32, 7.5 * 32 / 31.5), Q5_K: (0, 2, 9.2 * 32, 15.5 * 32 / 31.5),
    Q6_K: (208, None, 18.5 * 74, 0.0),
}


def random_blocks(qtype: int, rows: int, k: int, gen: torch.Generator) -> Tensor:
    """uint8 [rows, k / E * B]: valid ``qtype`` blocks with random quants (every bit pattern) and
    random 6-bit/int8 sub-block scales, and finite half-float scales sized so that each row
    dequantizes to values of magnitude about 1 / sqrt(k) (Q4_1's and the K-quants' mins roughly
    centre them on zero)."""
    e, b = check_qtype(qtype)
    if k % e:
        raise ValueError(f"GGUF {type_name(qtype)}: k={k} is not a whole number of {e}-element blocks")
    n = rows * (k // e)
    blocks = torch.randint(0, 256, (n, b), generator=gen, dtype=torch.uint8)
    d_at, min_at, spread, centre = _SIZING[qtype]
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0) if min_at is None else 1.0
    d = (torch.rand(n, generator=gen) * 0.5 + 0.5) / (spread * k**0.5) * sign
    blocks[:, d_at:d_at + 2] = _half_bytes(d)
    if min_at is not None:
        jitter = 1.0 + (torch.rand(n, generator=gen) - 0.5) * 0.2
        mins = d * centre * jitter
        blocks[:, min_at:min_at + 2] = _half_bytes(-mins if qtype == Q4_1 else mins)  # Q4_1 adds m; K-quants subtract
    return blocks.reshape(rows, k // e * b)
