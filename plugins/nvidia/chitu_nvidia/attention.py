"""The NVIDIA attention backends: the portable Triton paged attention and latent (MLA) attention, with
float32 products on the tensor cores in three TF32 passes ("tf32x3", float32 accuracy) instead of the
FMA path of "ieee". Both keep an fp8 KV cache (contract 1.2) on GPUs of compute capability 8.9 and
newer (Ada, Hopper, Blackwell), where Triton converts float8_e4m3fn."""

import os

import torch

from chitu_core.errors import ChituError
from chitu_core.kernels.triton.attention import TritonPagedAttention
from chitu_core.kernels.triton.mla_attention import TritonMLAAttention
from chitu_core.kernels.triton.paged_attention import TileConfig
from chitu_nvidia.ops import FP8_CAPABILITY


class FP8OnAdaAndNewer:
    """Declares the fp8 KV cache, and refuses it, naming the GPU, below compute capability 8.9, where
    Triton has no float8_e4m3fn (fp8e4nv) and would fail in the first kernel instead."""

    supports_fp8_kv_cache = True

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        capability = torch.cuda.get_device_capability(self.device) if kv_cache_dtype == "fp8" else FP8_CAPABILITY
        if capability < FP8_CAPABILITY:
            raise ChituError(f"an fp8 KV cache needs an NVIDIA GPU of compute capability 8.9 or newer (Triton reads "
                             f"float8_e4m3fn only there); {torch.cuda.get_device_name(self.device)} is "
                             f"{capability[0]}.{capability[1]}: use kv_cache_dtype='auto'")
        super().set_kv_cache_dtype(kv_cache_dtype)


class NvidiaTritonAttention(FP8OnAdaAndNewer, TritonPagedAttention):
    float32_dot_precision = "tf32x3"
    # Two pipeline stages in the key loop: on an H100 (scripts/attention_sweep.py, 256-token contexts)
    # decode at batch 64 took 30.6 us against 32.9 with Triton's default, batch 1 8.6 against 9.5;
    # 8,000-token contexts alike. A split decode keeps at most 4 programs per SM (CHITU_DECODE_FILL sets another):
    # Qwen3-1.7B's 4 sequences x 8 kv heads split 16 ways, not 13 (the earlier rule: at least 3 a unit). On an
    # H200 the kernel took 130-132 us against 139-140 at 32,000 tokens and 41.5-42.1 against 43.6-46.1 at
    # 8,000; batch 4 decoded 753.0 tok/s against 728.0 at 32,000 tokens (0.816 of the byte floor against
    # 0.781), 1438.5 against 1436.1 at 8,000; batch 8 at 8,000 tokens 8 ranges 71.0-71.7 us against 7 at
    # 73.0-79.2; batches 16 and 32 as before (docs/benchmarks/nvidia-h200-decode-fill.md).
    tiles = TileConfig(decode_stages=2, decode_fill=int(os.environ.get("CHITU_DECODE_FILL", 4)))
    fuses_qk_norm = os.environ.get("CHITU_QK_NORM_FUSION", "1") != "0"  # 0: the separate norms (to compare)


class NvidiaTritonMLAAttention(FP8OnAdaAndNewer, TritonMLAAttention):
    float32_dot_precision = "tf32x3"
