"""Weight layout: dense linear weights stored as the transpose of a contiguous [in, out] tensor.

The ops still see each weight as [out_features, in_features]; only its strides change. A backend
asks for it (``Backend.transposed_linear_weights``) where its GEMMs pick faster kernels for that
layout. Embeddings keep their rows contiguous: an LM head tied to one is left as it is.
"""

from torch import nn

from chitu_core.layers.embedding import LMHead, VocabEmbedding
from chitu_core.layers.linear import LinearBase
from chitu_core.quantization.base import UnquantizedMethod


def store_linear_weights_transposed(model: nn.Module) -> int:
    """Re-store the dense weights of ``model``'s linear layers and untied LM head; returns how many."""
    embedding_weights = {id(m.weight) for m in model.modules()
                         if isinstance(m, VocabEmbedding) and not isinstance(m, LMHead)}
    count = 0
    for module in model.modules():
        dense = isinstance(module, LinearBase) and isinstance(module.quant, UnquantizedMethod)
        head = isinstance(module, LMHead) and id(module.weight) not in embedding_weights
        if (dense or head) and module.weight.dim() == 2:
            module.weight.data = module.weight.data.t().contiguous().t()
            count += 1
    return count
