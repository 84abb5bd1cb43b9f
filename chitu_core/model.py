"""The model contract: what a model plugin's class provides to the engine.

A model plugin registers classes under the entry-point group ``chitu_core.models``,
keyed by the HF ``architectures`` name they implement ("LlamaForCausalLM"). Each
class subclasses ``CausalLM``, sets ``contract_version``, builds itself from
``chitu_core.layers`` and declares how checkpoint names map onto its fused
parameters (``stacked_params``).
"""

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from chitu_core.layers.context import StepContext


@dataclass(frozen=True)
class KVGeometry:
    """The per-rank attention shape the KV cache is sized for."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class CausalLM(nn.Module):
    """Base of model classes. Subclasses set ``contract_version``, take ``(hf_config, ctx:
    BuildContext)`` in their constructor, and implement the abstract methods.

    stacked_params: (fused parameter fragment, checkpoint fragment, shard id) triples, e.g.
        (".qkv_proj.", ".q_proj.", "q"): checkpoint "…q_proj.weight" loads into shard "q" of
        "…qkv_proj.weight".
    ignored_weights: checkpoint name fragments to skip (e.g. stale "rotary_emb.inv_freq").
    """

    stacked_params: ClassVar[tuple[tuple[str, str, object], ...]] = ()
    ignored_weights: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abstractmethod
    def kv_geometry(cls, config, tp_size: int) -> KVGeometry:
        """The attention shape of this config on one of ``tp_size`` ranks."""

    @abstractmethod
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        """token_ids, positions: int64 [T] (the step's packed tokens) -> hidden states [T, H]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, H] (the rows to sample from) -> logits [B, V] in float32 or the model's dtype
        (the sampler upcasts where it computes in float32; a greedy step need not)."""

    @classmethod
    def max_model_len(cls, config) -> int:
        """The longest sequence this config can attend over correctly."""
        return config.max_position_embeddings

    def skip_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor is deliberately not loaded."""
        return any(fragment in name for fragment in self.ignored_weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors (see chitu_core.loader.weights.load_into)."""
        from chitu_core.loader.weights import load_into

        load_into(self, weights)
