"""The NVIDIA attention backends: the portable Triton paged attention and latent (MLA) attention, with
float32 products on the tensor cores in three TF32 passes ("tf32x3", float32 accuracy) instead of the
FMA path of "ieee"."""

from chitu_core.kernels.triton.attention import TritonPagedAttention
from chitu_core.kernels.triton.mla_attention import TritonMLAAttention


class NvidiaTritonAttention(TritonPagedAttention):
    float32_dot_precision = "tf32x3"


class NvidiaTritonMLAAttention(TritonMLAAttention):
    float32_dot_precision = "tf32x3"
