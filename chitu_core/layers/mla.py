"""Multi-head latent attention (DeepSeek-V2/V3), in the absorbed form the MLA contract runs.

Checkpoint parameters keep their names and shapes. The query comes from ``q_proj``, or from
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` where the config has a q_lora_rank; each head's
query is qk_nope_head_dim channels without position, then qk_rope_head_dim (R) rotated ones.
``kv_a_proj_with_mqa`` makes, per token, the compressed KV (kv_lora_rank L channels, normed by
``kv_a_layernorm``) and one rotary key (R channels) shared by all heads; together they are the latent
the cache holds. ``kv_b_proj`` ([H * (nope + v), L]) holds, per head, the key up-projection W_UK
(its first nope rows) and the value up-projection W_UV (the v after).

Absorption: q_nope . (W_UK c) = (q_nope W_UK) . c, so each head's query is taken into the latent
space (q_latent = q_nope @ W_UK, [H, nope] x [nope, L]) and attends over the cached latents directly;
the output, a mix of latents, is brought back with W_UV ([H, L] x [L, v]) before ``o_proj``. The two
matrices are split out of kv_b_proj once, after loading (``process_weights_after_loading``).

Tensor parallelism splits heads: the query projection and kv_b_proj by output rows, o_proj by input
columns; kv_a_proj_with_mqa and the latent are the same on every rank.

Where the backend serves ``ops.mla_inputs`` itself (contract 1.10), steps of at most
``Backend.fusion_max_tokens`` tokens make the absorbed query and the latent in that one op instead of
the rotary, the product with W_UK, the norm and the two concatenations.

The decode-step fusions of contract 1.9 (``forward_fused``, taken by ``DecoderLayer`` as for regular
attention): on one rank with dense weights, the query's first projection (``q_proj`` or ``q_a_proj``)
and ``kv_a_proj_with_mqa`` read the same normed input, so after loading their weights are made views of
one [q + L + R, hidden] matrix; the layer's input norm runs in that one product's prologue
(``ops.rms_norm_linear``), ``q_a_layernorm`` in ``q_b_proj``'s, and the residual add in ``o_proj``'s
epilogue (``ops.linear_add``).
"""

import torch
from torch import nn

from chitu_core.errors import ModelLoadError
from chitu_core.layers.context import BuildContext, StepContext
from chitu_core.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from chitu_core.layers.norm import RMSNorm
from chitu_core.layers.rotary import RotaryEmbedding
from chitu_core.ops import reference
from chitu_core.quantization.base import UnquantizedMethod


class MultiHeadLatentAttention(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size]; ``rotary`` is R wide (its is_neox the checkpoint's
    pair layout), ``scale`` the softmax scale (qk_head_dim**-0.5, times YaRN's mscale**2 where the
    config says so: the model's business, as transformers computes it)."""

    checkpoint_kv_scales = ()
    """No checkpoint format defines a scale for the latent row (llm-compressor's k_scale/v_scale measure
    keys and values after kv_b_proj's up-projection): checkpoint KV scales are not loaded here, and an fp8
    latent cache keeps 1.0 (``chitu_core.quantization.kv_scales``)."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, scale: float, ctx: BuildContext):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        if heads % ctx.tp_size:
            raise ModelLoadError(f"num_attention_heads={heads} is not divisible by the tensor-parallel size {ctx.tp_size}")
        self.num_heads = heads // ctx.tp_size
        qk_dim, bias = self.nope + self.rope_dim, getattr(config, "attention_bias", False)
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, ctx)
        else:
            self.q_a_proj = LinearBase(hidden, self.q_lora_rank, bias, ctx)  # replicated
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps, ctx)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim, ctx)
        self.kv_a_proj_with_mqa = LinearBase(hidden, self.kv_lora_rank + self.rope_dim, bias, ctx)  # replicated
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps, ctx)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + self.v_dim), ctx)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, ctx, bias=bias)
        self.rotary, self.scale, self.layer_idx, self.attention = rotary, scale, layer_idx, ctx.attention
        self.ops, self.fusion_max_tokens = ctx.ops, ctx.fusion_max_tokens
        self.fused_inputs = ctx.ops.sources["mla_inputs"].kind != "fallback" and not self.kv_a_layernorm.offset
        # An fp8 cache's scale for the whole latent row (contract 1.2); None for a model-dtype cache.
        self.register_buffer("kv_scale", ctx.attention.new_kv_scale(), persistent=False)
        self.register_buffer("w_uk", None, persistent=False)  # [H, nope, L], by process_weights_after_loading
        self.register_buffer("w_uv", None, persistent=False)  # [H, L, v]
        self.register_buffer("input_weight", None, persistent=False)  # [q + L + R, hidden], where merged
        self.register_buffer("input_bias", None, persistent=False)  # [q + L + R], where merged and biased

    def _first_projections(self) -> tuple[LinearBase, LinearBase]:
        return (self.q_proj if self.q_lora_rank is None else self.q_a_proj), self.kv_a_proj_with_mqa

    def _merge_inputs(self) -> None:
        """Make the query's first projection and kv_a_proj_with_mqa views of one weight (``input_weight``,
        and ``input_bias`` where both have biases), where both are dense and whole on this rank
        (``LinearBase.fuses``)."""
        first, kv_a = self._first_projections()
        dense = all(type(p.quant) is UnquantizedMethod for p in (first, kv_a))
        if not (dense and first.fuses() and kv_a.fuses()) or (first.bias is None) != (kv_a.bias is None):
            return
        rows = first.weight.shape[0]
        for name in ("weight", "bias"):
            if getattr(first, name) is not None:
                merged = torch.cat((getattr(first, name).detach(), getattr(kv_a, name).detach()))
                getattr(first, name).data, getattr(kv_a, name).data = merged[:rows], merged[rows:]
                setattr(self, f"input_{name}", merged)

    def fuses(self) -> bool:
        """Whether ``forward_fused`` may serve (``DecoderLayer.takes_fusions``): the input projections were
        merged, the other projections take the fusions, and a subclass that changes ``forward`` changes
        ``forward_fused`` too."""
        cls, base = type(self), MultiHeadLatentAttention
        first, kv_a = self._first_projections()
        return (self.input_weight is not None and first.fuses() and kv_a.fuses() and self.o_proj.fuses()
                and (self.q_lora_rank is None or self.q_b_proj.fuses())
                and (cls.forward is base.forward or cls.forward_fused is not base.forward_fused))

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj's weight into per-head W_UK [H, nope, L] and W_UV [H, L, v], contiguous. A quantized
        kv_b_proj (an FP8 checkpoint, in-situ --quantization) is dequantized exactly by its method first and
        the absorbed matrices kept in the model dtype (kv_b_proj itself is never multiplied by)."""
        quant = self.kv_b_proj.quant
        if isinstance(quant, UnquantizedMethod):
            w = self.kv_b_proj.weight.detach()
        else:
            try:
                w = quant.dequantize(self.kv_b_proj).to(self.kv_b_proj.dtype)
            except NotImplementedError:
                raise ModelLoadError(f"multi-head latent attention needs kv_b_proj's weight to absorb it; the "
                                     f"{quant.name!r} method cannot dequantize it") from None
        w = w.reshape(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope].contiguous()
        self.w_uv = w[:, self.nope :].transpose(1, 2).contiguous()
        self._merge_inputs()

    def _inputs(self, positions: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, nope + R] and kv [T, L + R] -> the absorbed query [T, H, L + R] and the latent [T, L + R]."""
        t, norm = q.shape[0], self.kv_a_layernorm
        if self.fused_inputs and (self.fusion_max_tokens is None or t <= self.fusion_max_tokens):
            return self.ops.mla_inputs(q, kv, self.w_uk, norm.weight, norm.eps, positions, self.rotary.cos_sin_cache,
                                       self.rotary.is_neox)
        # The same composition over this backend's own rotary and norm (the batched products over heads are
        # torch.bmm, which runs on every backend's torch device).
        return reference.mla_inputs(q, kv, self.w_uk, norm.weight, norm.eps, positions, self.rotary.cos_sin_cache,
                                    self.rotary.is_neox, rotary=self.ops.rotary_embedding,
                                    norm=lambda x, _weight, _eps: norm(x))

    def defer_reduce(self) -> None:
        """Return this rank's partial output, unsummed (see ``RowParallelLinear.reduce``)."""
        self.o_proj.reduce = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.o_proj(self._attend(positions, q, self.kv_a_proj_with_mqa(x), step))

    def forward_fused(self, positions: torch.Tensor, stream: torch.Tensor, norm: RMSNorm,
                      step: StepContext) -> torch.Tensor:
        """The residual stream after this sublayer: ``stream`` + forward(norm(stream)), with the norm in the
        merged input product's prologue and the add in o_proj's epilogue (contract 1.9; see the module)."""
        inputs = self.ops.rms_norm_linear(stream, norm.weight, norm.eps, self.input_weight, self.input_bias)
        q, kv = inputs.split([inputs.shape[-1] - self.kv_lora_rank - self.rope_dim, self.kv_lora_rank + self.rope_dim],
                             dim=-1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(q, norm=self.q_a_layernorm)
        return self.o_proj(self._attend(positions, q, kv, step), residual=stream)

    def _attend(self, positions: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, step: StepContext) -> torch.Tensor:
        """q [T, H * (nope + R)] and kv [T, L + R] -> the heads' outputs [T, H * v], before o_proj."""
        if self.w_uk is None:
            raise RuntimeError("MultiHeadLatentAttention ran before its process_weights_after_loading split kv_b_proj; "
                               "call the model's process_weights_after_loading() once its weights are in place")
        t, h, r = q.shape[0], self.num_heads, self.rope_dim
        q_attn, latent = self._inputs(positions, q.view(t, h, self.nope + r), kv)
        fp8 = {} if self.kv_scale is None else {"kv_scale": self.kv_scale}
        out = self.attention.forward(q_attn, latent, step.kv_caches[self.layer_idx], step.meta, self.scale,
                                     **fp8)  # [T, H, L]
        out = torch.bmm(out.transpose(0, 1), self.w_uv).transpose(0, 1)  # [T, H, v]
        return out.reshape(t, h * self.v_dim)
