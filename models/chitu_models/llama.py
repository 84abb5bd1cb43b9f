"""Llama family: Llama 2/3/3.1/3.2 (llama3 RoPE scaling, tied embeddings), SmolLM2, Mistral.

The decoder is parameterised by the few places the family differs (biases,
per-head q/k norm, the MLP of each layer), so Qwen and the MoE models reuse it
(see qwen.py, mixtral.py, qwen_moe.py).
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from chitu_core.errors import ModelLoadError
from chitu_core.layers import (
    Attention,
    BuildContext,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    StepContext,
    VocabEmbedding,
    rope_config,
)
from chitu_core.layers.stage import Absent, build_lm_head, stage_layers
from chitu_core.model import CausalLM, KVGeometry

ACTIVATIONS = {"silu": "silu_and_mul", "gelu": "gelu_and_mul", "gelu_pytorch_tanh": "gelu_and_mul"}
FUSED_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}  # rms_norm_linear's names
FUSED_OPS = ("rms_norm_linear", "linear_add")
# The sizes every in-tree ``conformance_config()`` starts from: small enough that the whole model/*
# conformance run stays cheap, past the case's prompts (30 tokens and 6 decode steps) in positions.
CONFORMANCE_SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def serves_fusions(ops) -> bool:
    """Whether the backend serves the decode-step fusions itself; where the reference would (a fallback),
    the layers keep the backend's own unfused ops."""
    return all(ops.sources[name].kind != "fallback" for name in FUSED_OPS)


def overrides_both(module: nn.Module, base: type) -> bool:
    """False where ``module``'s class overrides ``base.forward`` but not ``base.forward_fused``: the fused
    path would skip what its ``forward`` adds."""
    cls = type(module)
    return cls.forward is base.forward or cls.forward_fused is not base.forward_fused


def unfuse(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's fused projections (Phi-3's "…qkv_proj.weight", Phi-3's and GLM-4's "…gate_up_proj.weight")
    as the separate tensors ``model.stacked_params`` names: the rows are cut at the full sizes of the parts of
    the model's fused layer, so each part is then split for tensor parallelism as a separate tensor is."""
    parts: dict[str, list[tuple[str, object]]] = {}
    for fused, part, shard_id in model.stacked_params:
        parts.setdefault(fused, []).append((part, shard_id))
    for name, tensor in weights:
        fused = next((f for f in parts if f in name), None)
        if fused is None:
            yield name, tensor
            continue
        layer = model.get_submodule(name[:name.index(fused) + len(fused) - 1])
        sizes = [layer.parts[shard_id][2] for _, shard_id in parts[fused]]
        if tensor.shape[0] != sum(sizes):
            raise ModelLoadError(f"tensor {name!r} has {tensor.shape[0]} rows, not the {' + '.join(map(str, sizes))} "
                                 "outputs of the fused projection (a quantized fused tensor does not load; quantize while loading)")
        for (part, _), piece in zip(parts[fused], tensor.split(sizes)):
            yield name.replace(fused, part), piece


class DecoderAttention(nn.Module):
    """``scale``, ``softcap``, ``window``: as ``Attention`` takes them; ``norm_offset``: the q/k norms
    (``qk_norm``) in Gemma's convention."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, ctx: BuildContext,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, scale: float | None = None,
                 softcap: float | None = None, window: int | None = None, norm_offset: bool = False):
        super().__init__()
        hd = head_dim(config)
        n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads, n_kv, ctx, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, ctx, bias=o_bias)
        self.hq, self.hk, self.hd = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, ctx, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, ctx, norm_offset) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.hq, self.hk, hd, layer_idx, ctx, scale, softcap, window)

    def defer_reduce(self) -> None:
        """Return this rank's partial output, unsummed (see ``RowParallelLinear.reduce``)."""
        self.o_proj.reduce = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        return self.o_proj(self._attend(positions, self.qkv_proj(x), step))

    def fuses(self) -> bool:
        """Whether ``forward_fused`` may serve: both projections ``fuses()``, and a subclass that changes
        ``forward`` (a model plugin's multiplier, say) changes ``forward_fused`` too."""
        return (overrides_both(self, DecoderAttention) and self.qkv_proj.fuses() and self.o_proj.fuses())

    def forward_fused(self, positions: torch.Tensor, stream: torch.Tensor, norm: RMSNorm,
                      step: StepContext) -> torch.Tensor:
        """The residual stream after this sublayer: ``stream`` + o_proj(attention(qkv_proj(norm(stream)))),
        the norm in the QKV product's prologue and the add in o_proj's epilogue (contract 1.9)."""
        return self.o_proj(self._attend(positions, self.qkv_proj(stream, norm=norm), step), residual=stream)

    def _attend(self, positions: torch.Tensor, qkv: torch.Tensor, step: StepContext) -> torch.Tensor:
        t = qkv.shape[0]
        q, k, v = qkv.split([self.hq * self.hd, self.hk * self.hd, self.hk * self.hd], dim=-1)
        q, k, v = q.view(t, self.hq, self.hd), k.view(t, self.hk, self.hd), v.view(t, self.hk, self.hd)
        norms = {} if self.q_norm is None else {"qk_norm": (self.q_norm, self.k_norm)}  # the backend may fuse them
        return self.attn(q, k, v, step, self.rotary, positions, **norms)


class DecoderMLP(nn.Module):
    def __init__(self, config, ctx: BuildContext, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], ctx, bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, ctx, bias=bias)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")  # Gemma: the former
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.act = getattr(ctx.ops, ACTIVATIONS[act])
        self.act_kwargs = {"approximate": "tanh"} if act == "gelu_pytorch_tanh" else {}
        self.fused_act = FUSED_ACTIVATIONS[act]

    def defer_reduce(self) -> "DecoderMLP":
        """Return this rank's partial output, unsummed (see ``RowParallelLinear.reduce``)."""
        self.down_proj.reduce = False
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x), **self.act_kwargs))

    def fuses(self) -> bool:
        """As ``DecoderAttention.fuses``."""
        return overrides_both(self, DecoderMLP) and self.gate_up_proj.fuses() and self.down_proj.fuses()

    def forward_fused(self, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``stream`` + down(act(gate_up(norm(stream)))): the norm in the gate/up product's prologue, the
        activation in its epilogue, the add in the down product's epilogue (contract 1.9)."""
        return self.down_proj(self.gate_up_proj(stream, norm=norm, activation=self.fused_act), residual=stream)


def defer_reduce(module: nn.Module) -> bool:
    """Ask a sublayer to return its partial output, unsummed over ranks (its ``defer_reduce()``); False
    where it has no such method and sums its output itself."""
    hook = getattr(module, "defer_reduce", None)
    if hook is None:
        return False
    hook()
    return True


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer around a given attention module (regular or latent) and MLP (dense or MoE).

    Under tensor parallelism the sublayers' outputs are summed over ranks at the norm that follows
    them (``RMSNorm(..., comm)``: one all-reduce + add + norm), where the sublayer can defer its sum
    (``defer_reduce``): then the MLP's output leaves the layer unsummed (``mlp_partial``) and the next
    layer's input norm, or the model's final norm, sums it (``input_partial``, set by DecoderModel).
    A step that takes the decode-step fusions sums in the row-parallel products instead, with the adds
    (``Communicator.linear_all_reduce_add``), and keeps the stream whole."""

    fuse_boundaries: ClassVar[bool] = True  # False where a norm takes a sublayer's whole output (GLM-4)
    norm_offset: ClassVar[bool] = False  # True: Gemma's norms (RMSNorm ``offset``)

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module, ctx: BuildContext):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, self.norm_offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, self.norm_offset)
        self.comm = ctx.comm
        fuse = self.fuse_boundaries and ctx.tp_size > 1
        self.attn_partial = fuse and defer_reduce(self_attn)
        self.mlp_partial = fuse and defer_reduce(mlp)
        self.input_partial = False
        # Under tensor parallelism (contract 1.13) only where the ranks' sums come with the adds in one pass.
        self.fusions = ((ctx.tp_size == 1 or ctx.comm.fuses_linear_all_reduce()) and not self.norm_offset
                        and serves_fusions(ctx.ops) and callable(getattr(self_attn, "forward_fused", None)))
        self.fusion_max_tokens = ctx.fusion_max_tokens

    def takes_fusions(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` takes the decode-step fusions (contract 1.9): the backend serves them
        for that many tokens, and the attention's projections can take them (the MLP's too, or it runs
        on the normed stream as before)."""
        limit = self.fusion_max_tokens
        return self.fusions and self.self_attn.fuses() and (limit is None or tokens <= limit)

    def forward(self, positions, hidden, residual, step):
        """(hidden, residual) -> the same pair for the next layer; a residual of None means hidden is the
        whole residual stream (the embeddings; a layer's output where it fused its adds)."""
        if self.takes_fusions(hidden.shape[0]):
            if residual is not None and self.input_partial:  # the layer before left its MLP's sum to this one
                hidden = self.comm.all_reduce(hidden)
            stream = hidden if residual is None else hidden + residual
            stream = self.self_attn.forward_fused(positions, stream, self.input_layernorm, step)
            if callable(getattr(self.mlp, "forward_fused", None)) and self.mlp.fuses():
                return self.mlp.forward_fused(stream, self.post_attention_layernorm), None
            return self.mlp(self.post_attention_layernorm(stream)), stream
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, self.comm if self.input_partial else None)
        hidden = self.self_attn(positions, hidden, step)
        hidden, residual = self.post_attention_layernorm(hidden, residual, self.comm if self.attn_partial else None)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, ``config.num_hidden_layers`` layers made by ``build_layer(layer_idx)`` around one shared
    rotary table, and the final norm.

    Pipeline stage s of P builds only the layers ``stage_layers(L, P, s)`` (an even split; the first
    ``L % P`` stages take one layer more) and an ``Absent`` at every other index, so layer indices
    and checkpoint names stay the whole model's; the embedding on the first stage only, the final
    norm on the last (which also keeps the embedding table where the LM head is tied to it)."""

    def __init__(self, config, ctx: BuildContext, rotary: RotaryEmbedding, build_layer: Callable[[int], DecoderLayer],
                 norm_offset: bool = False, embed_scale: float | None = None):
        """``norm_offset``: the final norm in Gemma's convention; ``embed_scale``: the embeddings are
        multiplied by it, rounded to the model dtype first (Gemma's sqrt(hidden_size))."""
        super().__init__()
        self.first, self.last = ctx.pp_rank == 0, ctx.pp_rank == ctx.pp_size - 1
        self.local = stage_layers(config.num_hidden_layers, ctx.pp_size, ctx.pp_rank)
        tied = self.last and getattr(config, "tie_word_embeddings", False)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx) if self.first or tied else Absent()
        self.rotary = rotary
        self.layers = nn.ModuleList(build_layer(i) if i in self.local else Absent() for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, norm_offset) if self.last else Absent()
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale, dtype=ctx.dtype).item()
        self.comm, previous = ctx.comm, None
        for i in self.local:  # each layer sums the previous one's deferred output (DecoderLayer)
            self.layers[i].input_partial = previous is not None and previous.mlp_partial
            previous = self.layers[i]
        self.out_partial = previous is not None and previous.mlp_partial

    def forward(self, token_ids, positions, step, intermediate=None):
        """[T, H]: the final hidden states on the last pipeline stage; on the others, the next stage's
        ``intermediate``: hidden states and residual stream stacked, [2, T, H]. ``intermediate``: the
        previous stage's (every stage but the first)."""
        if self.first:
            hidden, residual = self.embed_tokens(token_ids), None
            if self.embed_scale is not None:
                hidden = hidden * self.embed_scale
        else:
            hidden, residual = intermediate[0], intermediate[1]
        for i in self.local:
            hidden, residual = self.layers[i](positions, hidden, residual, step)
        comm = self.comm if self.out_partial else None
        if not self.last:
            if comm is not None and residual is not None:  # a fused step's last layer left the stream whole
                hidden = comm.all_reduce(hidden)
            return torch.stack([hidden, torch.zeros_like(hidden) if residual is None else residual])
        return self.norm(hidden) if residual is None else self.norm(hidden, residual, comm)[0]


class LlamaForCausalLM(CausalLM):
    contract_version = "1.0"
    stacked_params = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )
    ignored_weights = ("rotary_emb.inv_freq",)
    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer  # GLM-4's adds sandwich norms

    def __init__(self, config, ctx: BuildContext):
        super().__init__()
        rotary = self.build_rotary(config, ctx)
        opts = self.attention_options(config)
        self.model = DecoderModel(config, ctx, rotary, lambda i: self.decoder_layer(
            config, DecoderAttention(config, i, rotary, ctx, **opts), self.build_mlp(config, i, ctx), ctx))
        self.lm_head = build_lm_head(config, ctx, self.model.embed_tokens)

    @classmethod
    def build_rotary(cls, config, ctx: BuildContext) -> RotaryEmbedding:
        """The rotary table every layer shares."""
        return RotaryEmbedding(head_dim(config), config.max_position_embeddings, rope_config(config), ctx)

    @classmethod
    def attention_options(cls, config) -> dict:
        bias = getattr(config, "attention_bias", False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    @classmethod
    def build_mlp(cls, config, layer_idx: int, ctx: BuildContext) -> nn.Module:
        """The MLP of layer ``layer_idx``: forward(x [T, H]) -> [T, H], summed over ranks."""
        return DecoderMLP(config, ctx)

    @classmethod
    def kv_geometry(cls, config, tp_size: int) -> KVGeometry:
        n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return KVGeometry(config.num_hidden_layers, config.num_attention_heads // tp_size, max(1, n_kv // tp_size), head_dim(config))

    @classmethod
    def max_model_len(cls, config) -> int:
        return rope_config(config).max_positions(config.max_position_embeddings)

    def forward(self, token_ids, positions, step, intermediate=None):
        return self.model(token_ids, positions, step, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Llama 3 config (llama3 RoPE scaling) for the model conformance case."""
        return dict(CONFORMANCE_SIZES, model_type="llama", rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=64))


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's decoder; a config's ``sliding_window`` gives every layer that window (the
    attention variant of contract 1.6), so the whole context is served."""

    @classmethod
    def attention_options(cls, config) -> dict:
        return {**super().attention_options(config), "window": getattr(config, "sliding_window", None)}

    @classmethod
    def kv_geometry(cls, config, tp_size: int) -> KVGeometry:
        geometry = super().kv_geometry(config, tp_size)
        if getattr(config, "sliding_window", None) is None:
            return geometry
        return replace(geometry, attention_variants=frozenset({"sliding_window"}))

    @classmethod
    def conformance_config(cls) -> dict:
        """A small random Mistral config whose sliding window is shorter than the case's prompts."""
        return dict(CONFORMANCE_SIZES, model_type="mistral", sliding_window=8)
