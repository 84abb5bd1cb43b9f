"""The Hygon attention classes: the portable Triton paged and latent attention with DCU tiling. A DCU
runs 64-wide wavefronts, so a program gets the threads of the default configuration from half the
warps; float32 products stay on the FMA path ("ieee"); the KV cache stays in the model dtype."""

from chitu_core.kernels.triton.attention import TritonPagedAttention
from chitu_core.kernels.triton.mla_attention import TritonMLAAttention
from chitu_core.kernels.triton.paged_attention import TileConfig

DCU_TILES = TileConfig(key_tile_bytes=16 << 10, warps=2, wide_warps=4)


class HygonTritonAttention(TritonPagedAttention):
    name = "triton-dcu"
    supports_fp8_kv_cache = False
    tiles = DCU_TILES


class HygonTritonMLAAttention(TritonMLAAttention):
    name = "triton-mla-dcu"
    supports_fp8_kv_cache = False
