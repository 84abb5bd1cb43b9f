"""Reference quantized linears (contract 1.2) and FP8 experts (1.3): dequantize exactly, then multiply. See ``spec``."""

import torch

Tensor = torch.Tensor
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _finish(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x @ w.T (+ bias) in the accumulation dtype, returned in x.dtype."""
    acc = _acc(x)
    out = x.to(acc) @ w.to(acc).T
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(x.dtype)


def unpack_int4(qweight: Tensor) -> Tensor:
    """int32 [K/8, N] -> int64 [K, N] of values in [0, 16): nibble j of row i is row 8i + j."""
    shifts = torch.arange(0, 32, 4, device=qweight.device)
    q = (qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return q.reshape(-1, qweight.shape[1])


def int4_linear(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int,
                bias: Tensor | None) -> Tensor:
    acc = _acc(x)
    q = unpack_int4(qweight).to(acc)  # [K, N]
    s = scales.to(acc).repeat_interleave(group_size, dim=0)
    z = zeros.to(acc).repeat_interleave(group_size, dim=0)
    return _finish(x, ((q - z) * s).T, bias)


def quantize_rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 of x (float32 math): (q as float32 [.., K], s float32 [.., 1])."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(xf / s).clamp(-127, 127), s


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor, act_quant: bool, bias: Tensor | None) -> Tensor:
    acc = _acc(x)
    w = weight.to(acc) * scales.to(acc)[:, None]
    if act_quant:
        q, s = quantize_rows_int8(x)
        x_used = (q.to(acc) * s.to(acc)).to(acc)
        out = x_used @ w.T
        if bias is not None:
            out = out + bias.to(acc)
        return out.to(x.dtype)
    return _finish(x, w, bias)


def quantize_groups_fp8(x: Tensor, group: int) -> Tensor:
    """Dynamic FP8 quantization of x in groups of ``group`` along the last dim (float32 math),
    returned dequantized (q * s) in float32, the values the FP8 product sees."""
    k = x.shape[-1]
    pad = (-k) % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, group))
    amax = xf.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / s).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2)[..., :k]


def dequantize_fp8(weight: Tensor, scales: Tensor, block_size: tuple[int, int] | None,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """W [N, K] in ``dtype`` from an FP8 weight and its per-channel or block scales."""
    w = weight.to(dtype)
    if block_size is None:
        return w * scales.to(dtype)[:, None]
    bn, bk = block_size
    n, k = w.shape
    if n % bn == 0 and k % bk == 0:  # whole blocks: one broadcast product, no [N, K] copy of the scales
        return (w.view(n // bn, bn, k // bk, bk) * scales.to(dtype)[:, None, :, None]).view(n, k)
    s = scales.to(dtype).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w * s


def fp8_linear(x: Tensor, weight: Tensor, scales: Tensor, block_size: tuple[int, int] | None,
               act_quant: bool, bias: Tensor | None) -> Tensor:
    acc = _acc(x)
    w = dequantize_fp8(weight, scales, block_size, acc)
    if not act_quant:
        return _finish(x, w, bias)
    group = block_size[1] if block_size is not None else x.shape[-1]
    out = quantize_groups_fp8(x, group).to(acc) @ w.T
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(x.dtype)


def fused_experts_fp8(x: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
                      block_size: tuple[int, int] | None, topk_weights: Tensor, topk_ids: Tensor,
                      activation: str = "silu") -> Tensor:
    """Each expert some slot chose is dequantized (in float32, float64 for float64 x) and run as in the
    unquantized reference; the gate/up product and its activation stay in that dtype until the rounding
    to x.dtype the contract fixes."""
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}.get(activation)
    if act is None:
        raise ValueError(f"fused_experts_fp8: activation {activation!r} is not 'silu' or 'gelu'")
    acc = _acc(x)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=acc, device=x.device)
    for expert in topk_ids[topk_ids >= 0].unique().tolist():  # the reference may loop; backends must not
        rows, slots = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = (x[rows].to(acc) @ dequantize_fp8(w13[expert], w13_scale[expert], block_size, acc).T).chunk(2, -1)
        hidden = (act(gate) * up).to(x.dtype).to(acc)
        y = hidden @ dequantize_fp8(w2[expert], w2_scale[expert], block_size, acc).T
        out.index_add_(0, rows, y * topk_weights[rows, slots, None].to(acc))
    return out.to(x.dtype)


def gguf_linear(x: Tensor, qweight: Tensor, qtype: int, bias: Tensor | None) -> Tensor:
    from chitu_core.quantization.gguf_blocks import dequantize

    n = qweight.shape[0]
    w = dequantize(qweight.cpu(), qtype).reshape(n, -1)  # float32, exact
    return _finish(x, w.to(x.device), bias)
