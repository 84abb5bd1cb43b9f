"""Native ops of the NVIDIA backend: the portable Triton kernels (``chitu_core.kernels.triton``)
where the contract has one, PyTorch's CUDA kernels for the rest that are worth it here.

linear (cuBLAS) and log_softmax are the reference's own PyTorch calls, which on CUDA tensors
already are the vendor kernels: declared native, not copied. greedy_sample is the Triton
two-pass argmax (torch's gives each row to one block: 28 us for 128256 logits on an H200). Sampling
filters and penalties stay reference fallbacks until on-device sampling kernels land.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from chitu_core.ops import reference


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


TORCH_OPS: dict[str, Callable] = {
    "linear": reference.linear,
    "embedding": embedding,
    "log_softmax": reference.log_softmax,
}


def native_ops(with_triton: bool) -> dict[str, Callable]:
    """The op table; without triton installed, only the PyTorch ops (the backend is unavailable then)."""
    if not with_triton:
        return dict(TORCH_OPS)
    from chitu_core.kernels.triton.ops import TRITON_OPS

    return {**TORCH_OPS, **TRITON_OPS}
