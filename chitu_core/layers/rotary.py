"""Rotary position embedding: the cos/sin table for a config's RoPE scaling, applied by the op.

Scaling types, as transformers defines them: "default", "linear" (positions
divided by factor), "dynamic" (NTK-aware: the base grows once a position passes
the original context), "llama3" (Llama 3.1's frequency-band interpolation),
"yarn" (YaRN: a linear ramp between interpolated and original frequencies, and an
attention factor multiplied into cos and sin; DeepSeek-V2/V3, Qwen long context),
"longrope" (Phi-3/3.5: each frequency divided by its own factor, from ``long_factor``
where the context the table serves exceeds original_max_position_embeddings, else from
``short_factor``, and an attention factor; see ``inv_freq_table``).
Both config.json spellings are read: ``rope_parameters`` (transformers >= 5)
and ``rope_theta`` + ``rope_scaling`` (earlier releases).
"""

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from chitu_core.errors import ModelLoadError
from chitu_core.layers.context import BuildContext

SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    params: dict = field(default_factory=dict)
    partial_rotary_factor: float = 1.0

    def max_positions(self, max_position_embeddings: int) -> int:
        """Positions the table must cover: dynamic NTK scaling extends the context by its factor."""
        if self.rope_type == "dynamic":
            return int(max_position_embeddings * self.params["factor"])
        return max_position_embeddings

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN's and LongRoPE's attention factor; 1 for the other types)."""
        if self.rope_type not in ("yarn", "longrope"):
            return 1.0
        p = self.params
        if p.get("attention_factor") is not None:
            return float(p["attention_factor"])
        if self.rope_type == "longrope":  # as transformers: for the short factors too
            factor, original = p["factor"], p["original_max_position_embeddings"]
            return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        if p.get("mscale") and p.get("mscale_all_dim"):  # DeepSeek's spelling
            return yarn_mscale(p["factor"], p["mscale"]) / yarn_mscale(p["factor"], p["mscale_all_dim"])
        return yarn_mscale(p["factor"])


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extended ``factor`` times (transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_config(hf_config) -> RopeConfig:
    """Normalize an HF config's RoPE settings, whichever transformers version wrote them."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
    params = {**legacy, **params}
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    partial = params.pop("partial_rotary_factor", None) or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    if rope_type not in SUPPORTED:
        raise ModelLoadError(f"RoPE scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    if rope_type in ("yarn", "longrope"):
        # As transformers: a config-level original_max_position_embeddings wins (Phi-3), the context
        # length is the fallback, and a missing factor is the ratio of the two.
        longest = getattr(hf_config, "max_position_embeddings", None)
        original = getattr(hf_config, "original_max_position_embeddings", None)
        original = original or params.get("original_max_position_embeddings") or longest
        if original is None or (params.get("factor") is None and longest is None):
            raise ModelLoadError(f"RoPE scaling {rope_type!r} needs the context length: the config sets neither "
                                 "max_position_embeddings nor original_max_position_embeddings (and a factor); add them")
        params["original_max_position_embeddings"] = original
        if params.get("factor") is None:
            params["factor"] = longest / original
    return RopeConfig(rope_type, float(theta), params, float(partial))


def inv_freq_table(rope: RopeConfig, rot_dim: int, num_positions: int, max_position_embeddings: int) -> torch.Tensor:
    """float32 [num_positions, rot_dim/2]: the inverse frequency each position uses.

    LongRoPE: transformers picks the long factors for a forward whose sequence is longer than
    original_max_position_embeddings (and recomputes the whole cache when a sequence grows past
    it), the short ones otherwise. A paged cache keeps every key as it was rotated, so here one set
    serves the whole context: the long factors where ``max_position_embeddings`` (the context this
    table is for) exceeds the original one, else the short ones. That agrees with transformers for
    every sequence in the second case, and for sequences longer than the original context in the first."""
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    p = rope.params
    if rope.rope_type == "linear":
        inv_freq = inv_freq / p["factor"]
    elif rope.rope_type == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(rope, rot_dim)
    elif rope.rope_type == "longrope":
        long = max_position_embeddings > p["original_max_position_embeddings"]
        factors = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ModelLoadError(f"longrope's {'long' if long else 'short'}_factor has {factors.numel()} entries; "
                                 f"the rotary dimension {rot_dim} needs {rot_dim // 2}")
        inv_freq = 1.0 / (factors * rope.theta**exponents)
    table = inv_freq.expand(num_positions, -1).clone()
    if rope.rope_type == "dynamic":
        # A position past the original context uses the base transformers computes for a
        # sequence that long; positions inside it are unscaled, exactly as transformers.
        orig = max_position_embeddings  # transformers scales from the config's context, whatever else is set
        seq_len = torch.arange(orig, num_positions, dtype=torch.float64) + 1
        base = rope.theta * ((p["factor"] * seq_len / orig) - (p["factor"] - 1)) ** (rot_dim / (rot_dim - 2))
        table[orig:] = 1.0 / (base.float()[:, None] ** exponents[None])  # float32 powers, as transformers
    return table


def _yarn_inv_freq(rope: RopeConfig, rot_dim: int) -> torch.Tensor:
    """YaRN: original frequencies for dimensions that turn more than beta_fast times over the original
    context, interpolated ones (divided by factor) for those turning fewer than beta_slow times, and a
    linear ramp between; float32 in transformers' order of operations."""
    p = rope.params
    factor, original = p["factor"], p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rot_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # weight of the original frequency
    pos_freqs = rope.theta ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    """Holds the float32 [max_positions, rot_dim] cos|sin table (times the rope's attention factor) and
    applies ``ops.rotary_embedding``; ``is_neox`` False rotates interleaved pairs (2i, 2i+1)."""

    def __init__(self, head_dim: int, max_position_embeddings: int, rope: RopeConfig, ctx: BuildContext, is_neox: bool = True):
        super().__init__()
        self.ops, self.is_neox = ctx.ops, is_neox
        rot_dim = int(head_dim * rope.partial_rotary_factor)
        positions = rope.max_positions(max_position_embeddings)
        inv_freq = inv_freq_table(rope, rot_dim, positions, max_position_embeddings)
        freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * rope.attention_factor
        self.register_buffer("cos_sin_cache", cache.to(ctx.device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox)
