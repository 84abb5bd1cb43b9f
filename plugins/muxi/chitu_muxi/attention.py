"""The MetaX attention classes: the portable Triton paged and latent attention with MACA's tiling
(64-thread waves, as on a DCU, and a smaller key tile for its shared memory); float32 products on the
FMA path ("ieee"); the KV cache in the model dtype. The configuration is untuned on hardware."""

from chitu_core.kernels.triton.attention import TritonPagedAttention
from chitu_core.kernels.triton.mla_attention import TritonMLAAttention
from chitu_core.kernels.triton.paged_attention import TileConfig

MACA_TILES = TileConfig(key_tile_bytes=8 << 10, warps=2, wide_warps=4)


class MuxiTritonAttention(TritonPagedAttention):
    """Paged attention: MACA tiling, the cache in the model dtype."""

    name, tiles, supports_fp8_kv_cache = "triton-maca", MACA_TILES, False


class MuxiTritonMLAAttention(TritonMLAAttention):
    """Latent attention: the cache in the model dtype."""

    name, supports_fp8_kv_cache = "triton-mla-maca", False
