"""RMSNorm over the last dimension, optionally fused with the residual add: Llama's convention, or
with ``offset`` Gemma's (its weight stored as the offset from one, the product rounded once)."""

import torch
from torch import nn

from chitu_core.layers.context import BuildContext
from chitu_core.layers.weights import default_loader, set_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ctx: BuildContext, offset: bool = False):
        super().__init__()
        self.ops, self.eps, self.offset = ctx.ops, eps, offset
        init = torch.zeros if offset else torch.ones  # the identity norm either way
        self.weight = nn.Parameter(init(hidden_size, dtype=ctx.dtype, device=ctx.device), requires_grad=False)
        set_loader(self.weight, default_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, comm=None):
        """Without residual: the normed x. With it: (normed x + residual, x + residual). With ``comm``
        too, x is this rank's partial sum (a sublayer whose reduction was deferred), summed over the
        ranks first: ``Communicator.all_reduce_add_rms_norm``, in one pass where the backend can."""
        if self.offset:
            if residual is None:
                return self.ops.offset_rms_norm(x, self.weight, self.eps)
            if comm is not None:
                x = comm.all_reduce(x)
            return self.ops.fused_add_offset_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if comm is not None:
            return comm.all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.ops)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
