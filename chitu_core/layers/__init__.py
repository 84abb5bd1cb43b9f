"""Shared model layers. Models build from these; each calls the backend's ops, never torch kernels
directly, so a backend's op set (and its fallbacks) decide how a model runs.

Linear layers split along output (``ColumnParallelLinear``, fused ``QKVParallelLinear`` and
``MergedColumnParallelLinear``) or input (``RowParallelLinear``) for tensor parallelism; with
a world of one they are plain linears. ``FusedMoE`` holds a layer's routed experts as stacked
tensors (one per projection), split over each expert's intermediate dimension; ``Router`` is its
replicated gate.
"""

from chitu_core.layers.attention import Attention
from chitu_core.layers.context import BuildContext, StepContext
from chitu_core.layers.embedding import LMHead, VocabEmbedding
from chitu_core.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from chitu_core.layers.mla import MultiHeadLatentAttention
from chitu_core.layers.moe import ExpertShard, FusedMoE, Router, map_expert_weight
from chitu_core.layers.norm import RMSNorm
from chitu_core.layers.rotary import RotaryEmbedding, rope_config

__all__ = [
    "Attention",
    "BuildContext",
    "StepContext",
    "LMHead",
    "VocabEmbedding",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "ExpertShard",
    "FusedMoE",
    "Router",
    "map_expert_weight",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "rope_config",
]
