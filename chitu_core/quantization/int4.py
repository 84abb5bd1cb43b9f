"""4-bit weights in groups along the input features: packing, round-to-nearest, and what AWQ and GPTQ share.

Three bit layouts of the same numbers q[k, n] in [0, 16) (k along the K input features, n along the
N output features), each with one scale s and one zero z per group of G consecutive k:

* canonical (``ops.int4_linear``; GPTQ's qweight already): int32 [K/8, N], nibble j (bits 4j..4j+3)
  of word [i, n] holds q[8i + j, n];
* GPTQ's qzeros: int32 [K/G, N/8], nibble j of word [g, c] holds z[g, 8c + j];
* AWQ (qweight [K, N/8] and qzeros [K/G, N/8]): nibble i of word [r, c] holds column 8c + AWQ_ORDER[i].

W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]. After ``repack`` a layer holds the canonical
``qweight`` int32 [K/8, N], ``scales`` and ``zeros`` float16 [K/G, N] and, where the checkpoint's
act-order permuted K, a ``perm`` int64 [K] buffer: x.index_select(-1, perm) is multiplied.
"""

from collections.abc import Sequence

import torch
from torch import nn

from chitu_core.errors import ChituError
from chitu_core.ops.table import Ops
from chitu_core.quantization.base import QuantMethod

Tensor = torch.Tensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i holds column 8c + AWQ_ORDER[i]


# ----- packing -----


def pack_int4(q: Tensor, dim: int, order: Sequence[int] | None = None) -> Tensor:
    """Values in [0, 16) -> int32 with eight along ``dim`` per element (that dimension shrinks 8x):
    nibble i of element c holds value 8c + order[i] (order None: 8c + i)."""
    q = q.movedim(dim, -1)
    if q.shape[-1] % 8:
        raise ChituError(f"cannot pack {q.shape[-1]} 4-bit values into int32 words of eight")
    q = q.to(torch.int32).unflatten(-1, (-1, 8))
    order = order or range(8)
    words = torch.zeros(q.shape[:-1], dtype=torch.int32, device=q.device)
    for i, j in enumerate(order):
        words |= q[..., j] << (4 * i)  # int32 shifts wrap into the sign bit: the word's bits are exact
    return words.movedim(-1, dim).contiguous()


def unpack_int4(packed: Tensor, dim: int, order: Sequence[int] | None = None) -> Tensor:
    """The inverse of ``pack_int4``: int32 words -> int32 values in [0, 16), ``dim`` growing 8x."""
    words = packed.movedim(dim, -1).to(torch.int32)
    order = order or range(8)
    q = torch.empty((*words.shape, 8), dtype=torch.int32, device=packed.device)
    for i, j in enumerate(order):
        q[..., j] = (words >> (4 * i)) & 0xF
    return q.flatten(-2).movedim(-1, dim)


# ----- round to nearest -----


def quantize_groups(w: Tensor, group_size: int, symmetric: bool, min_zero: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Round-to-nearest 4-bit quantization of w [N, K] in groups of ``group_size`` along K.

    Returns q int32 [N, K] in [0, 16), scales float16 [N, K/G] and zeros int32 [N, K/G] with
    w ~ (q - z) * s to within half a step s / 2. Asymmetric: the group's range with 0 in it spans 15
    steps, z = round(-min / s) (at least ``min_zero``: GPTQ v1 cannot store a zero of 0). Symmetric:
    z = 8 and s = max|w| / 7.5. Scales are rounded up to float16 before q is computed, so that the
    float16 scale, not a float32 one, is the one within half a step."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        step = groups.abs().amax(-1) / 7.5
        zero = torch.full_like(step, 8.0)
    else:
        lo = groups.amin(-1).clamp(max=0)
        hi = groups.amax(-1).clamp(min=0)
        if min_zero:  # widen the range below 0 so that round(-lo / s) >= min_zero
            lo = torch.minimum(lo, -hi * min_zero / (15 - min_zero))
        step = (hi - lo) / 15
    step = torch.where(step > 0, step, torch.ones_like(step))  # an all-zero group: any scale
    # Round up to float16: multiply by 1 + 2^-10 (more than float16's half-ulp), then round.
    scales = (step * (1 + 2**-10)).to(torch.float16)
    s = scales.float()
    if not symmetric:
        zero = torch.round(-lo / s).clamp(min_zero, 15)
    q = torch.clamp(torch.round(groups / s[..., None]) + zero[..., None], 0, 15)
    return q.reshape(n, k).to(torch.int32), scales, zero.to(torch.int32)


def dequantize_canonical(qweight: Tensor, scales: Tensor, zeros: Tensor, perm: Tensor | None = None) -> Tensor:
    """W float32 [N, K] from the canonical layout (and the act-order ``perm``: column perm[i] of W is
    column i of the stored weight)."""
    q = unpack_int4(qweight, 0).float()  # [K, N]
    group = q.shape[0] // scales.shape[0]
    w = ((q - zeros.float().repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)).T
    if perm is None:
        return w.contiguous()
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


# ----- what AWQ and GPTQ share -----


def check_group_size(group_size, what: str) -> int:
    """A checkpoint's group size: -1 (one group over all input features) or a positive multiple of 8."""
    if group_size is None or isinstance(group_size, bool) or not isinstance(group_size, int) or \
            (group_size != -1 and (group_size <= 0 or group_size % 8)):
        raise ChituError(f"{what}: group_size {group_size!r} is not -1 or a positive multiple of 8")
    return group_size


def check_bits(quantization_config, what: str) -> None:
    bits = quantization_config.get("bits", quantization_config.get("w_bit"))
    if bits != 4:
        raise ChituError(f"{what}: bits {bits!r} is not supported; only 4-bit weights are")


class Int4Method(QuantMethod):
    """Base of the 4-bit group methods: the canonical layout after ``repack``, ``apply``, ``dequantize``."""

    kernels = ("int4_linear",)
    defaults = {"group_size": 128}

    def group_size(self, in_features: int) -> int:
        """This layer's G: the option (-1: all of in_features); an error unless it divides in_features."""
        g = check_group_size(self.options["group_size"], f"quantization method {self.name!r}")
        g = in_features if g == -1 else g
        if in_features % g:
            raise ChituError(f"quantization method {self.name!r}: a layer with {in_features} input features (on "
                             f"this rank) does not split into groups of {g}; use a tensor-parallel size that "
                             "keeps whole groups on each rank, or another group size")
        return g

    def check_shape(self, in_features: int, out_features: int) -> int:
        if out_features % 8:
            raise ChituError(f"quantization method {self.name!r}: {out_features} output features (on this rank) "
                             "are not a multiple of 8, which its packed zeros need")
        return self.group_size(in_features)

    def create_weights(self, layer, in_features, out_features, dtype, device):
        self.check_shape(in_features, out_features)
        super().create_weights(layer, in_features, out_features, dtype, device)

    @staticmethod
    def set_canonical(layer: nn.Module, qweight: Tensor, scales: Tensor, zeros: Tensor, perm: Tensor | None,
                      drop: Sequence[str]) -> None:
        """Replace the checkpoint tensors ``drop`` with the canonical ones: qweight int32 [K/8, N], scales
        and zeros [K/G, N] (stored as float16), and ``perm`` (if any) as a buffer."""
        for name in drop:
            delattr(layer, name)
        tensors = {"qweight": qweight.contiguous(), "scales": scales.to(torch.float16).contiguous(),
                   "zeros": zeros.to(torch.float16).contiguous()}
        for name, value in tensors.items():
            layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
        if perm is not None:
            layer.register_buffer("perm", perm.to(torch.int64).contiguous(), persistent=False)

    def dequantize(self, layer):
        return dequantize_canonical(layer.qweight, layer.scales, layer.zeros, getattr(layer, "perm", None))

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None, ops: Ops) -> Tensor:
        perm = getattr(layer, "perm", None)
        if perm is not None:
            x = x.index_select(-1, perm)
        group_size = layer.qweight.shape[0] * 8 // layer.scales.shape[0]
        return ops.int4_linear(x, layer.qweight, layer.scales, layer.zeros, group_size, bias)

    fusion_kernels = ("int4_rms_norm_linear", "int4_linear_add")

    def fuses(self, layer: nn.Module, ops: Ops) -> bool:
        """Not where GPTQ's act-order permutes x first (the norm would need its weight permuted too)."""
        return getattr(layer, "perm", None) is None and super().fuses(layer, ops)

    def apply_fused(self, layer, x, norm_weight, eps, activation, residual, bias, ops):
        group_size = layer.qweight.shape[0] * 8 // layer.scales.shape[0]
        weight = (layer.qweight, layer.scales, layer.zeros, group_size)
        if norm_weight is not None:
            return ops.int4_rms_norm_linear(x, norm_weight, eps, *weight, bias, activation)
        return ops.int4_linear_add(x, *weight, bias, residual)
