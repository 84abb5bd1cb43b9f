"""Vocabulary embedding and LM head, split over the vocabulary for tensor parallelism."""

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
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size, dtype=ctx.dtype, device=ctx.device), requires_grad=False)
        set_loader(self.weight, self.load_weight, local_part=self.local_part, load_local=self.load_rows)

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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self.ops.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        out = self.ops.embedding(torch.where(inside, local, 0), self.weight)
        return self.comm.all_reduce(out * inside[:, None].to(out.dtype))


class LMHead(VocabEmbedding):
    """Hidden states -> logits over the vocabulary; shares its weight with the embedding when tied."""

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden, self.weight, None)
        if self.comm.world_size > 1:
            logits = self.comm.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
