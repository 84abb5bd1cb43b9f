"""Paged attention on the CPU with PyTorch's scaled_dot_product_attention.

Layout: [2, num_blocks, block_size, num_kv_heads, head_dim], in anonymous zero pages that become
resident as they are written. Per step, ``prepare``
builds the packed<->padded index, the causal mask, the gather rows and the slots once; each layer then
scatters its new keys/values into the cache, gathers every sequence's keys and
values through its block table, and runs one SDPA call for the whole batch. A decode step (one new
token a sequence) of a float32 or bfloat16 cache takes one C++ kernel a layer instead
(``chitu_cpu.decode_kernel``, compiled at ``allocate_kv_cache``): the cache read where it lies, the new
keys and values stored after, eager or inside a compiled forward (as an opaque op). Where that kernel
cannot be built, a compiled forward's decode step takes ``decode_attention``: the graph reads the
cache through the block tables itself, and the write follows the read.

A float32 model's cache may be float16 or bfloat16 (contract 1.15): written rounded, read back upcast.
An fp8 cache (contract 1.2) is written as the reference writes it; the gathered
keys and values are upcast to the model dtype (exact for e4m3) and the scales
applied outside SDPA: the key scale folded into the softmax scale, the value
scale multiplied into the output.
"""

import mmap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chitu_core.attention.contract import VARIANTS, AttentionBackend, AttentionMetadata
from chitu_core.attention.reference import causal_mask, packed_to_padded_index, paged_attention, write_kv
from chitu_cpu.decode_kernel import DecodePlan, fits, paged_decode


@dataclass
class CpuStepState:
    seq_idx: torch.Tensor  # [T] sequence of each packed row
    pos: torch.Tensor  # [T] its row among the sequence's new tokens
    mask: torch.Tensor  # bool [B, 1, max_query_len, max_seq_len]
    rows: torch.Tensor  # [B * n] int64: the cache blocks holding each sequence's keys, in order (n blocks each)
    slots: torch.Tensor  # the cache slots of the rows stored (padding rows, slot < 0, left out)
    keep: torch.Tensor | None  # which rows those are, where some are padding
    token_slots: torch.Tensor | None  # decode steps: [B, max_seq_len] the cache slot of each sequence's tokens
    last: torch.Tensor | None  # decode steps: [B, 1] each sequence's new token's position (seq_len - 1)
    windows: dict = field(default_factory=dict)  # window -> its mask, made by the first layer that asks

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "CpuStepState":
        """What every layer of the step shares: the padding index, the mask, the gather rows, the slots."""
        seq_idx, pos = packed_to_padded_index(meta)
        rows = meta.block_tables[:, :-(-meta.max_seq_len // meta.block_size)].reshape(-1).long()
        slots, keep = meta.slot_mapping, None
        if not bool((slots >= 0).all()):  # padding rows are not stored
            keep = slots >= 0
            slots = slots[keep]
        token_slots = last = None
        if meta.max_query_len == 1:  # for a compiled step's decode_attention
            p = torch.arange(meta.max_seq_len, device=rows.device)
            token_slots = rows.view(meta.num_seqs, -1)[:, p // meta.block_size] * meta.block_size + p % meta.block_size
            last = (meta.seq_lens.long() - 1)[:, None]
        return cls(seq_idx, pos, causal_mask(meta)[:, None], rows, slots, keep, token_slots, last)

    def windowed(self, meta: AttentionMetadata, window: int) -> torch.Tensor:
        if window not in self.windows:
            self.windows[window] = causal_mask(meta, window)[:, None]
        return self.windows[window]


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A cache tensor in anonymous zero pages (an mmap): zero-filled as the contract asks, but host memory
    is committed only as blocks are first written, so the budget costs resident memory only as sequences
    fill it (``commits_on_write``, contract 1.14)."""
    pages = mmap.mmap(-1, max(1, torch.Size(shape).numel() * dtype.itemsize))
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # keeps `pages` alive


class CpuSdpaAttention(AttentionBackend):
    name = "sdpa"
    block_sizes = (16, 1, 8, 32, 64, 128)
    supports_fp8_kv_cache = True
    supports_16bit_kv_cache = True  # contract 1.15: a float32 model's cache in float16 or bfloat16
    commits_on_write = True  # contract 1.14: allocate_kv_cache's pages become resident as they are written
    decode_kernel = False  # whether decode steps take chitu_cpu.decode_kernel (set by allocate_kv_cache)
    variants = VARIANTS  # contract 1.6: a window masks more; a capped layer takes the reference's math

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        self.decode_kernel = fits(self.dtype, self.kv_cache_dtype, self.head_dim)  # built here, at load
        return zero_pages(self.kv_cache_shape(num_blocks), self.kv_cache_dtype)

    def prepare(self, meta: AttentionMetadata) -> CpuStepState | DecodePlan:
        if self.decode_kernel and meta.max_query_len == 1 and bool((meta.slot_mapping >= 0).all()):
            return DecodePlan.of(meta, self.num_heads, self.num_kv_heads, self.head_dim)
        return CpuStepState.of(meta)

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=None, softcap=None, window=None):
        if softcap is not None:  # SDPA has no logit cap
            return paged_attention(q, k, v, kv_cache, meta, scale, kv_scale, softcap, window)
        state = meta.backend_state
        if isinstance(state, DecodePlan):  # (never for an fp8 cache: fits() takes no fp8 cache)
            # one kernel reads the cache where it lies and stores the new keys and values (chitu_cpu.decode_kernel)
            call = paged_decode_op if torch.compiler.is_compiling() else paged_decode
            return call(q, k, v, kv_cache, meta.block_tables, meta.seq_lens, state.slots, state.plan, state.work, scale,
                        window or 0)
        mask = state.mask if window is None else state.windowed(meta, window)
        if torch.compiler.is_compiling() and mask.shape[2] == 1 and kv_scale is None and state.keep is None:
            # a compiled decode step: the graph reads the cache itself, then an opaque op writes the new
            # keys and values (written last, the cache is updated in place rather than copied)
            out = decode_attention(q, k, v, kv_cache, state.token_slots, state.last, mask, scale, self.num_kv_heads,
                                   self.head_dim)
            write_kv_op(k, v, kv_cache, state.slots, out)
            return out
        call = paged_sdpa_op if torch.compiler.is_compiling() else paged_sdpa  # the op: opaque to a compiled step
        return call(q, k, v, kv_cache, state.slots, state.keep, state.rows, state.seq_idx, state.pos, mask, scale,
                    kv_scale, window is not None)


def write_new_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                 after: torch.Tensor | None = None) -> None:
    """Store a step's new keys and values at ``slots``.
    ``after``, unused, orders the write in a compiled graph: a tensor computed from the cache's old
    contents, so that every read of them comes first (else the compiler may move a read past the write,
    and then keeps the old contents by copying the whole cache)."""
    kv_cache.view(2, -1, *kv_cache.shape[3:]).index_copy_(1, slots, torch.stack((k, v)).to(kv_cache.dtype))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     token_slots: torch.Tensor, last: torch.Tensor, mask: torch.Tensor, scale: float,
                     num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A decode step's attention (one query row per sequence) in plain tensor operations, for a compiled
    step: inductor fuses the cache lookup into the products and the softmax, so no sequence's keys are
    copied out of the cache first (``paged_sdpa`` gathers them: at batch 16 that copy and the second
    read cost SmolLM2 more than its weights). q [B, Hq, D]; the new k and v [B, Hk, D], not yet in the
    cache, stand at each sequence's position ``last``; ``token_slots``, ``last`` and ``mask``
    [B, 1, 1, S] as ``CpuStepState`` has them. The head sizes come as plain ints (the attention's own),
    so that a graph compiled with dynamic shapes keeps them constant and vectorises over them. float32
    inside."""
    b, s = token_slots.shape
    hk, d = num_kv_heads, head_dim
    hq = q.shape[1]
    flat = kv_cache.view(2, -1, hk, d)
    new = (torch.arange(s, device=q.device)[None, :] == last)[:, :, None, None]  # [B, S, 1, 1]
    # the new key and value as the cache will hold them (a 16-bit cache of a float32 model rounds them)
    keys = torch.where(new, k[:, None].to(kv_cache.dtype).float(), flat[0][token_slots].float())  # [B, S, Hk, D]
    values = torch.where(new, v[:, None].to(kv_cache.dtype).float(), flat[1][token_slots].float())
    qg = q.float().view(b, 1, hk, hq // hk, d)
    scores = (qg * keys[:, :, :, None]).sum(-1) * scale  # [B, S, Hk, G]
    scores = scores.masked_fill(~mask.view(b, s, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs[..., None] * values[:, :, :, None]).sum(1)  # [B, Hk, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


def paged_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
               keep: torch.Tensor | None, rows: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor,
               mask: torch.Tensor, scale: float, kv_scale: torch.Tensor | None, windowed: bool = False) -> torch.Tensor:
    """One layer's step, with ``CpuStepState``'s tensors: the cache write, the gather of the blocks
    ``rows`` names (the mask's [B, 1, max_query_len, max_seq_len] gives the sizes; whole blocks copied
    by index_select, several times faster than advanced indexing) and one SDPA call for the batch. A decode step (one
    query row per sequence) needs no padding, and a single sequence no mask unless ``windowed`` (a
    sliding-window mask hides its oldest keys)."""
    if keep is not None:
        k, v = k[keep], v[keep]
    if kv_scale is not None:  # an fp8 cache: written as the reference writes it
        write_kv(kv_cache, k, v, slots, kv_scale)
    else:
        write_new_kv(k, v, kv_cache, slots)
    b, _, max_q, max_s = mask.shape
    num_blocks, block_size, hk, d = kv_cache.shape[1:]
    gathered = kv_cache.view(2, num_blocks, -1).index_select(1, rows)
    kv = gathered.view(2, b, -1, hk, d)[:, :, :max_s].transpose(2, 3)  # [2, B, Hk, S, D]
    keys, values = kv[0], kv[1]
    v_scale = None
    if keys.dtype != q.dtype:  # an fp8 cache, or a float32 model's 16-bit one
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if kv_scale is not None:
        k_scale, v_scale = kv_scale.tolist()
        scale *= k_scale
    hq = q.shape[1]
    if max_q == 1:
        out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask if b > 1 or windowed else None,
                                             scale=scale, enable_gqa=hq != hk)[:, :, 0]
    else:
        q_pad = q.new_zeros(b, max_q, hq, d)
        q_pad[seq_idx, pos] = q
        out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=hq != hk)  # [B, Hq, max_q, D]
        out = out.transpose(1, 2)[seq_idx, pos]
    return out if v_scale is None else (out.float() * v_scale).to(q.dtype)


# ``paged_sdpa`` as an operator for torch.compile: the compiled step calls it as it is and takes its sizes
# from the tensors rather than specialising on them. Registered through torch.library.Library rather than
# the custom_op decorator, whose Python wrapper costs ~100 us a call here against ~4.
_LIBRARY = torch.library.Library("chitu_cpu", "DEF")
_LIBRARY.define("paged_sdpa(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slots, Tensor? keep, Tensor rows, "
                "Tensor seq_idx, Tensor pos, Tensor mask, float scale, Tensor? kv_scale, bool windowed) -> Tensor")
_LIBRARY.impl("paged_sdpa", paged_sdpa, "CPU")
_LIBRARY.impl("paged_sdpa", lambda q, *_: torch.empty_like(q), "Meta")
paged_sdpa_op = torch.ops.chitu_cpu.paged_sdpa
_LIBRARY.define("write_kv(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slots, Tensor? after) -> ()")
_LIBRARY.impl("write_kv", write_new_kv, "CPU")
_LIBRARY.impl("write_kv", lambda *_: None, "Meta")
write_kv_op = torch.ops.chitu_cpu.write_kv
_LIBRARY.define("paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor block_tables, Tensor seq_lens, "
                "Tensor slots, Tensor plan, Tensor(b!) work, float scale, int window) -> Tensor")
_LIBRARY.impl("paged_decode", paged_decode, "CPU")
_LIBRARY.impl("paged_decode", lambda q, *_: torch.empty(q.shape, dtype=q.dtype, device=q.device), "Meta")
paged_decode_op = torch.ops.chitu_cpu.paged_decode
