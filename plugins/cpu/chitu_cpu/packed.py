"""4-bit weights in PyTorch's CPU int4pack layout (contract 1.7's ``Backend.pack_linear``).

``torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, G, sz)`` multiplies x [M, K] by a weight packed
from 4-bit values q [N, K] (``_convert_weight_to_int4pack_for_cpu``) with one scale s and one zero z
per group of G consecutive k: W[n, k] = (q[n, k] - 8) * s + z, where sz [K / G, N, 2] holds (s, z) in
x's dtype. It reads half a byte per weight and dequantizes in registers (AVX-512 where present).

Any weight that is an affine map of unsigned b-bit integers per group, w = q * scale + offset, fits:
q is cut into ceil(b / 4) hex digits, digit i a part of its own with scale 16^i * scale, and the parts
are laid side by side along K, so one call on x repeated once per part ([x, x] for 8 bits) sums them;
each part's zero returns the 8 it subtracts, and the offset joins one part's zero per group. That covers GGUF's Q4_0,
Q4_1, Q4_K (one part), Q5_K and Q8_0 (two), and the int4 layout AWQ and GPTQ repack to (W = (q - z) s).
The scales and zeros are rounded to bfloat16: PyTorch's kernel is vectorized for bfloat16
only (float32 and float16 take a scalar path some 30x slower), so a float32 or float16 model multiplies
in bfloat16: x is rounded to it and the product cast back. That costs float32 its usual precision (the
backend declares the wider quant_matmul threshold this needs; the suite shows it).

A tied vocabulary head of Q8_0 blocks (SmolLM2's) is not packed at all (``Q8_0Head``): a C++ kernel
(``chitu_cpu.gguf_head``) multiplies x, float32 or bfloat16 as it comes, by the blocks where the embedding
keeps them, in float32, so the head costs no memory of its own and its logits are the exact weights'. A
tied head of another 32-group type, or any tied head where that kernel cannot be built (no compiler), is
packed and recomputes each row's largest logits in float32 from the blocks (``ExactTopHead``): bfloat16
logits tie where they are close, and the greedy choice among ties would fall to token order (4 of 12 chat
continuations equal to llama.cpp's without, 7 with).

GGUF weights that do not fit (Q6_K, whose scales change every 16 elements, or N not a multiple of 16)
are dequantized once into the model dtype (``DenseLinear``) rather than at every call. Declined (the
method's own ops run instead): int4 group sizes other than 32, 64, 128 or 256, N not a multiple of 16,
an act-order permutation, other methods.
"""

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from chitu_core.backend import PackedLinear, return_free_host_memory
from chitu_core.quantization.gguf_blocks import AFFINE_BITS, BLOCK, Q8_0, affine_groups, dequantize
from chitu_cpu.gguf_head import head_kernel, q8_0_head, q8_0_head_op

GROUP_SIZES = (32, 64, 128, 256)
INNER_K_TILES = 2
CHUNK_ROWS = 4096


class Int4PackLinear(PackedLinear):
    """W [N, K] as ``parts`` int4pack parts side by side along K (see the module docstring)."""

    def __init__(self, rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], n: int, k: int,
                 bits: int, group: int):
        """``rows(start, stop)``: (q int32 [stop - start, K] in [0, 2 ** bits), scale, offset float32
        [stop - start, K / group]) with W = q * scale + offset, asked for CHUNK_ROWS rows at a time so
        that the int32 values of a large matrix (a vocabulary head) never sit in memory whole."""
        self.parts, self.group, self.n, self.k = -(-bits // 4), group, n, k
        self.compute_dtype = torch.bfloat16  # see the module docstring
        chunk = CHUNK_ROWS if n % 64 == 0 else n  # int4pack tiles 64 rows: chunks of whole tiles pack alike
        packed = []
        for start in range(0, n, chunk):
            packed.append(self._pack(*rows(start, min(start + chunk, n))))
            if chunk < n:  # a head: give back each chunk's int32 values and float groups (tens of MB)
                return_free_host_memory()
        self.weight = torch.cat([w for w, _ in packed])
        self.scales_zeros = torch.cat([sz for _, sz in packed], dim=1)

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.compute_dtype
        digits = [(q >> (4 * i)) & 0xF for i in range(self.parts)]
        scales = [(scale * 16**i).to(dtype).float() for i in range(self.parts)]  # rounded first: 8 s is then exact
        # Each part computes (digit - 8) * s + z: its z gives its own 8 s back, and in each group the offset
        # joins the part where the sum is smallest, so that rounding z to the dtype costs least.
        zeros = torch.stack([8 * s for s in scales])
        with_offset = zeros + offset
        pick = with_offset.abs().argmin(0, keepdim=True)
        zeros = zeros.scatter(0, pick, with_offset.gather(0, pick))
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat(digits, 1).contiguous(), INNER_K_TILES)
        sz = torch.stack([torch.cat(scales, 1), torch.cat(list(zeros), 1)], -1).transpose(0, 1).to(dtype).contiguous()
        return weight, sz

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {"weight": self.weight, "scales_zeros": self.scales_zeros}

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        x = x.reshape(-1, self.k).to(self.compute_dtype)
        if self.parts > 1:
            x = x.repeat(1, self.parts)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.weight, self.group, self.scales_zeros)
        y = y.to(dtype)
        if bias is not None:
            y += bias
        return y.reshape(*lead, self.n)


def gguf_groups(qweight: torch.Tensor, qtype: int):
    """``Int4PackLinear``'s source of groups for GGUF blocks: rows start..stop as affine groups of 32."""
    return lambda start, stop: affine_groups(qweight[start:stop], qtype)


class ExactTopHead(Int4PackLinear):
    """A vocabulary head of GGUF blocks: the int4pack product's logits are bfloat16 values, close logits
    round to the same one, and the largest would be chosen by token order. The TOP largest of each row
    are recomputed in float32 from the file's own blocks (the tied embedding keeps them), so that the
    choice among them, and their log-probabilities, are the exact weights' (the unpacked path's)."""

    TOP = 16

    def __init__(self, qweight: torch.Tensor, qtype: int, n: int, k: int):
        super().__init__(gguf_groups(qweight, qtype), n, k, AFFINE_BITS[qtype], 32)
        self.qweight, self.qtype = qweight, qtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = super().__call__(x, bias)
        rows, top = y.view(-1, self.n), min(self.TOP, self.n)  # a view: the scatter below writes into y
        idx = rows.topk(top, dim=-1).indices  # [M, top]
        weights = dequantize(self.qweight[idx.flatten()], self.qtype).view(*idx.shape, self.k)
        exact = torch.einsum("mtk,mk->mt", weights, x.reshape(-1, self.k).float())
        if bias is not None:
            exact += bias.float()[idx]
        rows.scatter_(-1, idx, exact.to(rows.dtype))
        return y


class Q8_0Head(PackedLinear):
    """A tied vocabulary head of Q8_0 blocks uint8 [N, K / 32 * 34], multiplied where the embedding keeps them
    (``chitu_cpu.gguf_head``): the exact weights, float32 sums, no copy. x float16 is multiplied in float32."""

    def __init__(self, qweight: torch.Tensor, n: int, k: int):
        self.qweight, self.n, self.k = qweight.detach(), n, k  # the embedding's own tensor, not a copy

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {"qweight": self.qweight}  # read every step: it counts as the head's (bench.floor)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        x = x.reshape(-1, self.k)
        if dtype != torch.bfloat16:
            x = x.float()
        call = q8_0_head_op if torch.compiler.is_compiling() else q8_0_head  # the op: opaque to a compiled step
        y = call(x, self.qweight).to(dtype)
        if bias is not None:
            y += bias
        return y.reshape(*lead, self.n)


class DenseLinear(PackedLinear):
    """W dequantized once into the model dtype."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {"weight": self.weight}

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


def pack_linear(method, layer, dtype: torch.dtype) -> PackedLinear | None:
    """``Backend.pack_linear`` for the CPU: GGUF blocks of a 32-group type, and the int4 layout."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if method.name == "gguf":
        qweight, qtype = layer.qweight, method.options["qtype"]
        tied = getattr(layer, "tied", None) is not None  # a head whose blocks the embedding keeps anyway
        if tied and qtype == Q8_0 and head_kernel(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32):
            return Q8_0Head(qweight, qweight.shape[0], qweight.shape[1] // BLOCK[Q8_0][1] * BLOCK[Q8_0][0])
        if qtype not in AFFINE_BITS or qweight.shape[0] % 16:
            return DenseLinear(dequantize(qweight, qtype).to(dtype))
        n, k = qweight.shape[0], qweight.shape[1] // BLOCK[qtype][1] * BLOCK[qtype][0]
        if tied:
            return ExactTopHead(qweight, qtype, n, k)
        return Int4PackLinear(gguf_groups(qweight, qtype), n, k, AFFINE_BITS[qtype], 32)
    if "int4_linear" in getattr(method, "kernels", ()) and getattr(layer, "perm", None) is None \
            and {"qweight", "scales", "zeros"} <= {n for n, _ in layer.named_parameters()} | {n for n, _ in layer.named_buffers()}:
        return _pack_int4(layer)
    return None


def _pack_int4(layer) -> Int4PackLinear | None:
    """The int4 op's layout (qweight int32 [K/8, N], scales/zeros [K/G, N]; W = (q - z) * s)."""
    qweight, scales, zeros = layer.qweight, layer.scales.float(), layer.zeros.float()
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k // scales.shape[0]
    if n % 16 or group not in GROUP_SIZES:
        return None
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)

    def rows(start: int, stop: int):
        q = ((qweight[:, None, start:stop] >> shifts[None, :, None]) & 0xF).reshape(k, stop - start).t().contiguous()
        s, z = scales[:, start:stop], zeros[:, start:stop]
        return q, s.t().contiguous(), (-z * s).t().contiguous()

    return Int4PackLinear(rows, n, k, 4, group)
