"""Weight layouts a backend asks for, applied once after loading.

Transposed: dense linear weights stored as the transpose of a contiguous [in, out] tensor. The ops
still see each weight as [out_features, in_features]; only its strides change. A backend asks for it
(``Backend.transposed_linear_weights``) where its GEMMs pick faster kernels for that layout.
Embeddings keep their rows contiguous: an LM head tied to one is left as it is.

Packed (contract 1.7): a backend takes a linear layer over with weights in a layout of its own
(``Backend.pack_linear``), e.g. repacked 4-bit blocks its kernel reads directly.
"""

from torch import nn

from chitu_core.layers.embedding import LMHead, VocabEmbedding
from chitu_core.layers.linear import LinearBase
from chitu_core.quantization.base import UnquantizedMethod


def store_linear_weights_transposed(model: nn.Module) -> int:
    """Re-store the dense weights of ``model``'s linear layers and untied LM head; returns how many."""
    embedding_weights = {id(m.weight) for m in model.modules()
                         if isinstance(m, VocabEmbedding) and not isinstance(m, LMHead) and m.quant is None}
    count = 0
    for module in model.modules():
        dense = isinstance(module, LinearBase) and isinstance(module.quant, UnquantizedMethod)
        head = isinstance(module, LMHead) and module.quant is None and id(module.weight) not in embedding_weights
        if (dense or head) and module.weight.dim() == 2:
            module.weight.data = module.weight.data.t().contiguous().t()
            count += 1
    return count


def pack_linear_layers(model: nn.Module, backend) -> int:
    """Offer each linear layer and quantized LM head to ``backend.pack_linear`` (contract 1.7); where the backend takes one, the
    layer's method tensors are dropped and the packed object's tensors become its buffers (``packed_*``).
    Returns how many layers were taken."""
    count = 0
    for module in model.modules():
        linear = isinstance(module, LinearBase) or (isinstance(module, LMHead) and module.quant is not None)
        if not linear or module.packed is not None:
            continue
        packed = backend.pack_linear(module.quant, module, module.dtype)
        if packed is None:
            continue
        for name, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if name != "bias":
                delattr(module, name)
        for name, tensor in packed.tensors().items():
            module.register_buffer(f"packed_{name}", tensor, persistent=False)
        module.packed = packed
        count += 1
    return count
