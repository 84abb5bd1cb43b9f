"""Pipeline stages inside a model: which layers this stage builds and what stands in for the others
(the engine carries hidden states between stages: ``chitu_core.distributed.pipeline``).

With ``pipeline_parallel_size`` P, stage s builds the decoder layers ``stage_layers(L, P, s)``, the
embedding only on the first stage and the final norm and LM head only on the last (with tied
embeddings the last stage holds a copy of the table for its head). Every other module is an
``Absent``: it has no parameters, and checkpoint tensors under its name are skipped when loading,
so layer indices and checkpoint names stay those of the whole model.
"""

from torch import nn

from chitu_core.errors import ChituError
from chitu_core.layers.context import BuildContext


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The layer indices of stage ``pp_rank``: an even split, the first ``num_layers % pp_size``
    stages taking one more (the last stage also runs the norm and LM head)."""
    if pp_size > num_layers:
        raise ChituError(f"pipeline_parallel_size {pp_size} is more than the model's {num_layers} layers; "
                         "use at most one stage per layer")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


class Absent(nn.Module):
    """A module another pipeline stage holds. Calling it is a bug."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module is held by another pipeline stage")


def absent_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Checkpoint-name prefixes of every ``Absent`` module of ``model`` ("model.layers.7.")."""
    return tuple(name + "." for name, module in model.named_modules() if isinstance(module, Absent))


def build_lm_head(config, ctx: BuildContext, embed_tokens: nn.Module) -> nn.Module:
    """The LM head on the last stage (tied to ``embed_tokens`` where the config ties them), else Absent."""
    from chitu_core.layers.embedding import LMHead

    if ctx.pp_rank != ctx.pp_size - 1:
        return Absent()
    head = LMHead(config.vocab_size, config.hidden_size, ctx)
    if getattr(config, "tie_word_embeddings", False):
        head.tie(embed_tokens)
    return head
