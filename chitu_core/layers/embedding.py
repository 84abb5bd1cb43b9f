"""Vocabulary embedding and LM head, split over the vocabulary for tensor parallelism.

A table is dense (``weight`` [rows, H] in the model dtype) unless the checkpoint stores it quantized
(``QuantMethod.table_options``: a GGUF's Q8_0 token embedding): then ``set_quant_method`` gives it the
method's tensors, the embedding dequantizes the rows it looks up (``QuantMethod.lookup``), and the LM
head multiplies through the method (or the backend's packed weight, contract 1.7) like a linear layer.
A tied head shares the embedding's tensors and method.
"""

import torch
from torch import nn

from chitu_core.layers.context import BuildContext
from chitu_core.layers.weights import check_shape, set_loader


class VocabEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r*n, (r+1)*n); out-of-shard ids contribute zeros, summed over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: BuildContext):
        super().__init__()
        self.ops, self.comm, self.vocab_size = ctx.ops, ctx.comm, vocab_size
        self.shard = -(-vocab_size // ctx.tp_size)
        self.start = ctx.tp_rank * self.shard
        self.hidden_size, self.dtype, self.device = hidden_size, ctx.dtype, ctx.device
        self.quant, self.packed = None, None  # dense until set_quant_method
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size, dtype=ctx.dtype, device=ctx.device), requires_grad=False)
        set_loader(self.weight, self.load_weight, local_part=self.local_part, load_local=self.load_rows)

    def set_quant_method(self, method) -> None:
        """Hold the table in ``method``'s checkpoint tensors (a [rows, H] linear's) instead of ``weight``."""
        for name, _ in list(self.named_parameters(recurse=False)):
            delattr(self, name)
        self.quant = method
        method.create_weights(self, self.hidden_size, self.shard, self.dtype, self.device)
        for param in self.parameters(recurse=False):
            set_loader(param, self.load_weight, local_part=self.local_part, load_local=self.load_rows)

    def local_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> torch.Tensor:
        """This rank's rows of the whole table (fewer than ``shard`` on the last rank when they do not divide)."""
        check_shape(loaded.shape, (self.vocab_size, param.shape[1]), "vocabulary embedding")
        return loaded[self.start : self.start + self.shard]

    def load_rows(self, param: nn.Parameter, part: torch.Tensor, shard_id=None) -> None:
        rows = max(0, min(self.shard, self.vocab_size - self.start))
        check_shape(part.shape, (rows, param.shape[1]), "this rank's rows of the vocabulary embedding")
        param.data.zero_()
        param.data[:rows].copy_(part)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self.load_rows(param, self.local_part(param, loaded))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return self.ops.embedding(ids, self.weight)
        return self.quant.lookup(self, ids).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self.rows(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        out = self.rows(torch.where(inside, local, 0))
        return self.comm.all_reduce(out * inside[:, None].to(out.dtype))


class LMHead(VocabEmbedding):
    """Hidden states -> logits over the vocabulary; shares its weight with the embedding when tied."""

    tied = None

    def tie(self, embedding: VocabEmbedding) -> None:
        """Share ``embedding``'s table: its weight now, its quantized tensors and method if it gets some."""
        self.weight = embedding.weight
        object.__setattr__(self, "tied", embedding)  # a reference, not a submodule (its tensors stay the embedding's)

    def share_quantized_table(self) -> None:
        """After the tied embedding's ``set_quant_method``: take its tensors and method."""
        for name, _ in list(self.named_parameters(recurse=False)):
            delattr(self, name)
        self.quant = self.tied.quant
        for name, param in self.tied.named_parameters(recurse=False):
            setattr(self, name, param)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            logits = self.packed(hidden, None)
        elif self.quant is not None:
            logits = self.quant.apply(self, hidden, None, self.ops)
        else:
            logits = self.ops.linear(hidden, self.weight, None)
        if self.comm.world_size > 1:
            logits = self.comm.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
