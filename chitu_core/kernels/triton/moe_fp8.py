"""``fused_experts_fp8`` of the op contract (``chitu_core.ops.spec``, 1.3): FP8 (e4m3) experts, 16-bit activations.

``moe.run_experts``, the two paths of ``fused_experts`` (grouped GEMMs over expert-sorted slots, or
per-slot matrix-vector products for decode), with the weight tile read as FP8 and converted to x's
dtype in registers ("soft FP8"): block scales [E, ceil(N/bn), ceil(K/bk)] multiply each K tile's
product (BLOCK_K divides bk), channel scales [E, N] the sum after the K loop (``moe.ExpertWeights``).

Two entry points, as ``fp8_linear``: ``fused_experts_fp8`` loads the weight as float8_e4m3fn (Triton
targets with FP8 types: NVIDIA compute capability 8.9 and newer), ``fused_experts_fp8_bytes`` loads its
bytes and decodes them exactly in registers (``act_quant.decode_e4m3_bytes``: float16 values of 1/256
of the weight's, the 256 folded into the scales) for targets without them. A backend registers the
one that suits its device.
"""

import torch

from chitu_core.kernels.triton.act_quant import FP8_BYTES_FACTOR
from chitu_core.kernels.triton.moe import ExpertWeights, GemmConfig, run_experts


def _check(w13, w13_scale, w2, w2_scale, block_size) -> None:
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fused_experts_fp8: w13 and w2 must be float8_e4m3fn, got {w13.dtype} and {w2.dtype}")
    for name, w, s in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
        e, n, k = w.shape
        want = (e, n) if block_size is None else (e, -(-n // block_size[0]), -(-k // block_size[1]))
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"fused_experts_fp8: {name} must be float32 {list(want)} for weights {list(w.shape)} with "
                             f"block_size {block_size}, got {s.dtype} {list(s.shape)}")
    if block_size is not None and block_size[1] % 16:
        raise ValueError(f"fused_experts_fp8: the Triton kernels need block columns of a multiple of 16, got "
                         f"block_size {block_size}")


def _fused_experts_fp8(x, w13, w13_scale, w2, w2_scale, block_size, topk_weights, topk_ids, activation, w_kind,
                       path, config):
    block_size = tuple(block_size) if block_size is not None else None
    _check(w13, w13_scale, w2, w2_scale, block_size)
    bn, bk = block_size or (1, 1)
    weights = ExpertWeights(w_kind, "block" if block_size is not None else "channel", bn, bk,
                            FP8_BYTES_FACTOR if w_kind == "fp8_bytes" else 1.0)
    if w_kind == "fp8_bytes":
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    return run_experts(x, w13, w13_scale, w2, w2_scale, weights, topk_weights, topk_ids, activation, path, config)


def fused_experts_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, block_size: tuple[int, int] | None, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: str = "silu", path: str | None = None,
                      config: GemmConfig | None = None) -> torch.Tensor:
    """x [T, H]; w13 float8_e4m3fn [E, 2I, H]; w2 [E, H, I]; scales as the spec says -> [T, H] in x.dtype.
    ``path`` ("grouped" or "slots") and ``config`` override the choices by shape (tests, tuning)."""
    return _fused_experts_fp8(x, w13, w13_scale, w2, w2_scale, block_size, topk_weights, topk_ids, activation,
                              "fp8", path, config)


def fused_experts_fp8_bytes(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                            w2_scale: torch.Tensor, block_size: tuple[int, int] | None, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, activation: str = "silu", path: str | None = None,
                            config: GemmConfig | None = None) -> torch.Tensor:
    """``fused_experts_fp8`` for Triton targets without FP8 types: the weights' bytes decoded in registers."""
    return _fused_experts_fp8(x, w13, w13_scale, w2, w2_scale, block_size, topk_weights, topk_ids, activation,
                              "fp8_bytes", path, config)
