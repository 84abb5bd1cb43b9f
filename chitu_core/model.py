"""The model contract: what a model plugin's class provides to the engine.

A model plugin registers classes under the entry-point group ``chitu_core.models``,
keyed by the HF ``architectures`` name they implement ("LlamaForCausalLM"). Each
class subclasses ``CausalLM``, sets ``contract_version``, builds itself from
``chitu_core.layers`` and declares how checkpoint names map onto its fused
parameters (``stacked_params``, or ``map_weight_name`` where a fragment cannot say it).
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
    """The per-rank attention shape the KV cache is sized for.

    Multi-head latent attention (contract 1.1) sets kv_lora_rank and rope_dim: the cache then holds
    one latent of kv_lora_rank + rope_dim channels per token (num_kv_heads 1, head_dim the latent's
    width), and the engine builds the backend's MLA attention instead of the regular one."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int = 0
    rope_dim: int = 0
    attention_variants: frozenset[str] = frozenset()
    """Contract 1.6: the attention variants some layer uses ("softcap", "sliding_window"); the engine
    takes the core's reference attention where the backend's attention lacks one."""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0


class CausalLM(nn.Module):
    """Base of model classes. Subclasses set ``contract_version``, take ``(hf_config, ctx:
    BuildContext)`` in their constructor, and implement the abstract methods.

    stacked_params: (fused parameter fragment, checkpoint fragment, shard id) triples, e.g.
        (".qkv_proj.", ".q_proj.", "q"): checkpoint "…q_proj.weight" loads into shard "q" of
        "…qkv_proj.weight".
    ignored_weights: checkpoint name fragments to skip (e.g. stale "rotary_emb.inv_freq").
    map_weight_name: checkpoint name -> (parameter name, shard id); applies stacked_params unless a
        model overrides it (MoE models map "…experts.{e}.gate_proj.weight" into a stacked tensor).
    conformance_config: optional classmethod, () -> a small random HF config dict of the class's own
        family, with its ``model_type`` (vocab 512, two layers, the family's distinctive features
        active). The conformance suite runs the model case (``model/ARCH/*``) only for a class that
        declares it on itself, an inherited one being the parent's family; any other architecture is
        listed as skipped (docs/writing-a-model.md).
    """

    stacked_params: ClassVar[tuple[tuple[str, str, object], ...]] = ()
    ignored_weights: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abstractmethod
    def kv_geometry(cls, config, tp_size: int) -> KVGeometry:
        """The attention shape of this config on one of ``tp_size`` ranks."""

    @abstractmethod
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, step: StepContext,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids, positions: int64 [T] (the step's packed tokens) -> hidden states [T, H].

        Under pipeline parallelism (``BuildContext.pp_size`` > 1) a stage runs its own layers only
        (``chitu_core.layers.stage``): every stage but the first takes ``intermediate``, the previous
        stage's output, instead of embedding ``token_ids``, and every stage but the last returns
        what the next one takes: hidden states and residual stream stacked, [2, T, H]. The engine
        carries it between stages; the model never communicates across stages itself. A model class
        that is never split may keep the three-argument form."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, H] (the rows to sample from) -> logits [B, V] in float32 or the model's dtype
        (the sampler upcasts where it computes in float32; a greedy step need not)."""

    @classmethod
    def max_model_len(cls, config) -> int:
        """The longest sequence this config can attend over correctly."""
        return config.max_position_embeddings

    def map_weight_name(self, name: str) -> tuple[str, object]:
        """The parameter a checkpoint tensor loads into, and its shard id (None: the whole tensor).
        The default applies ``stacked_params``; contract 1.1."""
        for fused, part, shard_id in self.stacked_params:
            if part in name:
                return name.replace(part, fused), shard_id
        return name, None

    def skip_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor is deliberately not loaded: an ignored fragment, or a module
        another pipeline stage holds (``chitu_core.layers.stage.Absent``)."""
        if any(fragment in name for fragment in self.ignored_weights):
            return True
        if not hasattr(self, "_absent_prefixes"):
            from chitu_core.layers.stage import absent_prefixes

            self._absent_prefixes = absent_prefixes(self)
        return name.startswith(self._absent_prefixes) if self._absent_prefixes else False

    def process_weights_after_loading(self) -> None:
        """Once every weight is in place (from a checkpoint or ``load_format="dummy"``): each layer's
        quantization method runs its load-time transform, then each submodule that defines
        ``process_weights_after_loading()`` derives what it keeps from its weights (e.g. the MLA
        layer's absorbed matrices). Override to add model-wide steps, calling this first."""
        for module in self.modules():
            quant = getattr(module, "quant", None)
            if quant is not None:
                quant.process_weights_after_loading(module)
        for module in self.modules():
            if module is not self and callable(getattr(module, "process_weights_after_loading", None)):
                module.process_weights_after_loading()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], presharded: bool = False) -> None:
        """Load checkpoint tensors (see chitu_core.loader.weights.load_into); ``presharded``: they are
        this rank's parts already (a checkpoint written by ``python -m chitu_core.convert --tp``)."""
        from chitu_core.loader.weights import load_into

        load_into(self, weights, presharded)
