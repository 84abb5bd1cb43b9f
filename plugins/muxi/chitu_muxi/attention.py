"""The MetaX attention classes: the portable Triton paged and latent attention with MACA's tiling
(64-thread waves, as on a DCU, and a smaller key tile for its shared memory); float32 products on the
FMA path ("ieee"); the KV cache in the model dtype. The configuration is untuned on hardware."""

from chitu_core.kernels.triton.attention import TritonPagedAttention
from chitu_core.kernels.triton.mla_attention import TritonMLAAttention
from chitu_core.kernels.triton.paged_attention import TileConfig

MACA_TILES = TileConfig(key_tile_bytes=8 << 10, warps=2, wide_warps=4)


class MuxiTritonAttention(TritonPagedAttention):
    name = "triton-maca"
    supports_fp8_kv_cache = False
    tiles = MACA_TILES


class MuxiTritonMLAAttention(TritonMLAAttention):
    name = "triton-mla-maca"
    supports_fp8_kv_cache = False
