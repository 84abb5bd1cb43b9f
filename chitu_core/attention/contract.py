"""Paged attention: what the engine gives a backend each step, and what the backend returns.

The engine's block manager hands out block ids only; what a block holds and
how the per-layer cache tensor is laid out is the backend's choice
(``kv_cache_shape``). Each step the model runner builds one
``AttentionMetadata`` for the whole batch, the backend may derive its own
per-step state from it once (``prepare``), and every layer then calls
``forward``, which writes the step's new keys and values into the cache and
attends over each sequence's cached context plus its new tokens, causally.

A batch mixes sequences freely: a prefill is a sequence with several new
tokens and no context, a decode one new token after a context, a chunked
prefill several new tokens after a context. Tokens of all sequences are
packed along one dimension T in sequence order.

FP8 cache (contract 1.2): a backend class that sets ``supports_fp8_kv_cache``
can keep its cache in float8_e4m3fn (``kv_cache_dtype="fp8"``; the format is
``chitu_core.attention.fp8``'s). The engine then calls ``set_kv_cache_dtype("fp8")``
right after construction, and every layer passes its float32 scales as the
keyword ``kv_scale`` of ``forward`` (and ``rotary_and_write_kv``, ``attend``).
Layers pass it only then, so a backend written for contract 1.0 or 1.1 keeps
its signatures; asked for an fp8 cache, it is a one-line error naming it.

16-bit cache (contract 1.15): a backend class that sets ``supports_16bit_kv_cache`` can keep the cache
of a float32 model in float16 or bfloat16 (``kv_cache_dtype="float16"`` / ``"bfloat16"``), half the
bytes a block. ``forward`` is called as for a cache of the model dtype; the backend stores keys and
values rounded to the cache dtype (to nearest even, as ``Tensor.to`` rounds) and attends over what it
stored, the new tokens included, in float32. A 16-bit model's own dtype is always accepted (it is "auto").

Variants (contract 1.6): a layer may cap its attention logits (``softcap``: scores become
softcap * tanh(scores / softcap), after the scale and before the mask; Gemma 2) or see only
the last ``window`` positions (a sliding window: query position i sees key positions j with
i - window < j <= i; Gemma 2 and 3, every layer its own). A backend class lists those it
implements in ``variants``; layers pass ``softcap=`` / ``window=`` to ``forward`` (or ``attend``)
only where they use them, and the engine takes the core's
reference attention for a model that needs a variant the backend's attention lacks.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from chitu_core.attention.fp8 import FP8_DTYPE, KV_CACHE_DTYPES
from chitu_core.errors import ChituError

Tensor = torch.Tensor
_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
VARIANTS = frozenset({"softcap", "sliding_window"})


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer. B sequences, T new tokens in all.

    slot_mapping:    int64 [T]; cache slot of each new token, block_id * block_size + offset;
                     a negative slot marks a padding row (graph buckets): its keys are not written.
    block_tables:    int32 [B, max_blocks]; the block ids of each sequence in order; entries
                     past a sequence's last block are padding and must not be read.
    seq_lens:        int32 [B]; tokens in the cache for each sequence after this step.
    context_lens:    int32 [B]; tokens already cached before this step (seq_len - query_len).
    query_start_loc: int32 [B + 1]; sequence b's new tokens are rows
                     query_start_loc[b]:query_start_loc[b+1] of q, k and v.
    max_query_len, max_seq_len: host ints, the maxima of the above.
    block_size:      tokens per block.
    backend_state:   whatever the attention backend's ``prepare`` derived for this step.
    """

    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    context_lens: Tensor
    query_start_loc: Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    backend_state: Any = field(default=None)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class PagedKVBackend(ABC):
    """What every attention variant shares: a paged cache of ``block_size``-token blocks, laid out as
    the backend chooses (``kv_cache_shape``), and per-step state derived once for all layers."""

    name: ClassVar[str] = "attention"
    block_sizes: ClassVar[tuple[int, ...]] = (16,)
    """Block sizes (tokens per block) this backend supports; the first is its default."""
    supports_fp8_kv_cache: ClassVar[bool] = False
    """Contract 1.2: whether this backend can keep its cache in float8_e4m3fn with per-layer scales
    (see the module). A subclass whose support depends on the device also overrides
    ``set_kv_cache_dtype`` to refuse where it cannot."""
    supports_16bit_kv_cache: ClassVar[bool] = False
    """Contract 1.15: whether this backend can keep a float32 model's cache in float16 or bfloat16 (see the
    module). Default False: such a request is a one-line error naming the class."""
    captures_prefill: ClassVar[bool] = False
    """Contract 1.16: True where a step of prompts may be recorded in the engine's device graphs (the
    backend's ``GraphRunner``) and replayed for other steps of as many tokens or fewer: ``prepare`` plans
    from ``max_query_len`` and ``max_seq_len`` as upper bounds (the graph's token count and the model's
    context; the block tables are as wide as that bound's blocks), and the attention reads everything
    else from the metadata's tensors on the device, never the host (no ``.item()``, no host lists).
    Sequences with no new tokens may follow the real ones; padding rows form a sequence of their own
    (nothing cached, slots -1), whose outputs must be finite.
    Default False: such steps run eagerly, as before."""
    num_kv_scales: ClassVar[int] = 2
    """Scales of one layer's fp8 cache: keys and values (latent attention: 1)."""
    commits_on_write: ClassVar[bool] = False
    """Contract 1.14: True where ``allocate_kv_cache``'s memory becomes resident only as blocks are first
    written (anonymous zero pages, as host memory gives them). The block manager then reuses released
    blocks, dropping the cached prefixes they hold oldest first, before it takes a block never written,
    so that the cache's resident memory follows the most blocks in use at once rather than the whole
    budget. Default False: the cache is resident from the start, and unwritten blocks go first (the
    prefix cache keeps the most)."""
    variants: ClassVar[frozenset[str]] = frozenset()
    """Contract 1.6: the attention variants this backend implements, of ``VARIANTS`` (see the module).
    Read through ``supported_variants()``: a subclass that overrides ``forward`` inherits none."""

    @classmethod
    def supported_variants(cls) -> frozenset[str]:
        """``variants`` as declared by the class whose ``forward`` runs: a subclass written for an older
        contract that overrides ``forward`` (without the new keywords) does not inherit its base's."""
        for klass in cls.__mro__:
            if "forward" in klass.__dict__:
                return frozenset(klass.__dict__.get("variants", frozenset()))
        return frozenset()

    def __init__(self, block_size: int, dtype: torch.dtype, device: torch.device):
        if block_size not in self.block_sizes:
            raise ValueError(
                f"attention backend {self.name!r} supports block sizes {self.block_sizes}, not {block_size}"
            )
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.kv_cache_dtype: torch.dtype = dtype
        """The cache's element dtype: the model dtype, float8_e4m3fn after ``set_kv_cache_dtype("fp8")``, or a
        float32 model's 16-bit cache dtype (contract 1.15)."""

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Choose the cache's elements before any cache is allocated: "auto" (the model dtype), "fp8"
        (float8_e4m3fn), or "float16" / "bfloat16". Raises ChituError for one ``accepts_kv_cache_dtype``
        refuses, naming the class and what it lacks."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is none of {KV_CACHE_DTYPES}")
        if not self.accepts_kv_cache_dtype(kv_cache_dtype):
            cls = type(self)
            what = ("an fp8 KV cache (it does not set supports_fp8_kv_cache)" if kv_cache_dtype == "fp8" else
                    f"a {kv_cache_dtype} KV cache under a {str(self.dtype).removeprefix('torch.')} model"
                    + (" (it does not set supports_16bit_kv_cache)" if self.dtype == torch.float32 else ""))
            raise ChituError(f"attention backend {self.name!r} ({cls.__module__}.{cls.__qualname__}) does not support "
                             f"{what}; use kv_cache_dtype='auto'")
        self.kv_cache_dtype = FP8_DTYPE if kv_cache_dtype == "fp8" else _HALF.get(kv_cache_dtype, self.dtype)

    def accepts_kv_cache_dtype(self, kv_cache_dtype: str) -> bool:
        """Whether ``set_kv_cache_dtype(kv_cache_dtype)`` is within what the class declares: "auto" always,
        "fp8" with ``supports_fp8_kv_cache``, a 16-bit dtype that is the model's own, or with
        ``supports_16bit_kv_cache`` under a float32 model."""
        if kv_cache_dtype == "fp8":
            return self.supports_fp8_kv_cache
        half = _HALF.get(kv_cache_dtype)
        return half is None or half == self.dtype or (self.dtype == torch.float32 and self.supports_16bit_kv_cache)

    def new_kv_scale(self) -> Tensor | None:
        """One layer's scales for its fp8 cache: float32 [num_kv_scales] of ones (the default where a
        checkpoint gives none), on the device; None for a cache of the model dtype. Layers keep it
        and pass it to every call as ``kv_scale``."""
        if self.kv_cache_dtype != FP8_DTYPE:
            return None
        return torch.ones(self.num_kv_scales, dtype=torch.float32, device=self.device)

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor holding ``num_blocks`` blocks."""

    def allocate_kv_cache(self, num_blocks: int) -> Tensor:
        """One layer's cache tensor of ``kv_cache_dtype``, zero-filled (so unwritten slots are never NaN)."""
        return torch.zeros(self.kv_cache_shape(num_blocks), dtype=self.kv_cache_dtype, device=self.device)

    def bytes_per_block(self) -> int:
        """Bytes one block takes in one layer's cache (half for an fp8 cache of a 16-bit model)."""
        per_block = torch.Size(self.kv_cache_shape(1)).numel()
        return per_block * self.kv_cache_dtype.itemsize

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Derive per-step state once for all layers; stored in ``meta.backend_state``.

        Where the device backend has a graph runner, decode graphs call this once at capture and
        replay its result with new tensor contents: derive the state from the host ints
        (max_query_len, max_seq_len) and tensor shapes only, never from the tensors' values."""
        return None

    def warmup(self) -> None:
        """Before the first request: compile (or otherwise make ready) what steps will run, so that
        no request waits on it. Default: nothing."""


class AttentionBackend(PagedKVBackend):
    """Paged attention for one model: one instance serves every layer.

    Construct with the model's head counts and the cache geometry. Queries have
    ``num_heads`` heads, keys and values ``num_kv_heads`` (GQA: query head h uses
    key/value head h // (num_heads // num_kv_heads)).
    """

    fuses_rotary: ClassVar[bool] = False
    """True where the backend applies RoPE while writing the cache (``rotary_and_write_kv``, then
    ``attend``): the attention layer then skips its separate rotary pass over q and k."""
    fuses_qk_norm: ClassVar[bool] = False
    """Contract 1.12, with ``fuses_rotary``: True where ``rotary_and_write_kv`` also takes ``qk_norm``, the
    per-head RMSNorm of q and k before the rotation (Qwen3's ``q_norm``, ``k_norm``): the attention layer
    then skips those two norms' launches."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        super().__init__(block_size, dtype, device)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor holding ``num_blocks`` blocks of keys and values."""

    @abstractmethod
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        kv_scale: Tensor | None = None,
    ) -> Tensor:
        """q: [T, num_heads, D]; k, v: [T, num_kv_heads, D]; kv_cache: this layer's cache.

        Writes k and v to ``meta.slot_mapping`` in the cache, then returns [T, num_heads, D]:
        for each new token, softmax(scale * q . K^T) V over its sequence's keys at positions
        <= its own (context tokens and earlier new tokens), accumulated in float32.

        An fp8 cache (contract 1.2): ``kv_scale`` is the layer's float32 [2] (key scale, value
        scale); k and v are stored and read back as ``chitu_core.attention.fp8`` says, and K and V
        above are the values read back. Never passed for a cache of the model dtype."""

    def rotary_and_write_kv(self, positions: Tensor, q: Tensor, k: Tensor, v: Tensor, cos_sin_cache: Tensor,
                            is_neox: bool, kv_cache: Tensor, meta: AttentionMetadata,
                            kv_scale: Tensor | None = None,
                            qk_norm: tuple[Tensor, Tensor, float] | None = None) -> tuple[Tensor, Tensor]:
        """Only where ``fuses_rotary``: the op ``rotary_embedding`` of q and k (returned), with the rotated
        k (rounded to k's dtype, as the op returns it) and v written at ``meta.slot_mapping`` as
        ``forward`` would.

        ``qk_norm`` (q weight [D], k weight [D], eps; passed only where ``fuses_qk_norm``): first each
        head of q and of k as the op ``rms_norm`` returns it with that weight (float32, rounded once to
        the dtype), then the rotation of those."""
        raise NotImplementedError(f"attention backend {self.name!r} does not fuse rotary embedding")

    def attend(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
               kv_scale: Tensor | None = None) -> Tensor:
        """Only where ``fuses_rotary``: ``forward`` after the step's keys and values are in the cache."""
        raise NotImplementedError(f"attention backend {self.name!r} does not fuse rotary embedding")
