"""Guards around what an op may touch: sentinel-surrounded operands, a sentinel-filled KV cache.

Ops return new tensors, so the suite cannot hand them an output buffer. Instead:

* every operand is a view into a larger device buffer whose other elements (margins before and
  after, gaps between rows or elements) hold a sentinel: NaN for floats, an out-of-range value for
  integers. An op that reads outside its operand shows it in its output (NaN, or an index error), and
  the whole buffer must be bit-identical after the call (no write into or around an operand);
* before each call the device allocator is handed blocks of the outputs' sizes filled with 0xFF
  bytes (NaN, or -1) and given back, so a caching allocator returns poisoned memory to an op that
  leaves part of its output unwritten (best effort: host allocators may return fresh pages, and
  the per-element bounds of every metric catch what is left);
* the KV cache, the one buffer ops write in place, is a view into a larger buffer; it starts
  filled with a sentinel and its margins with NaN. After each attention step only blocks holding
  the step's new tokens may have changed, by no more elements than those tokens occupy, each of
  those blocks must have changed, and nothing outside the cache.
"""

from dataclasses import dataclass

import torch

Tensor = torch.Tensor

MARGIN = 64  # sentinel elements before and after every guarded buffer
CACHE_SENTINEL = -7.25  # finite (the contract lets kernels read unwritten slots they then mask), exact in 8 bits

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sentinel(dtype: torch.dtype) -> float | int | bool:
    """The value guard regions of a ``dtype`` buffer hold."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


def bits(t: Tensor) -> Tensor:
    """t reinterpreted as integers of the same width (NaN compares equal to itself)."""
    return t.view(_BITS[t.element_size()])


def _layout_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Element strides of ``shape`` stored as ``layout``: contiguous; padded (a gap of 3 elements after
    each index of the outermost dimension, as a slice of a fused projection has); strided (every other
    element); transposed (the last two dimensions swapped in memory)."""
    order = list(range(len(shape)))  # memory order, outermost first
    if layout == "transposed" and len(shape) >= 2:
        order[-1], order[-2] = order[-2], order[-1]
    running = 2 if layout == "strided" else 1
    strides = [0] * len(shape)
    for dim in reversed(order):
        if layout == "padded" and dim == order[0]:
            running += 3
        strides[dim] = running
        running *= max(shape[dim], 1)
    return tuple(strides)


@dataclass
class Guarded:
    """A view handed to an op, the sentinel buffer around it, and the buffer as it was."""

    view: Tensor
    buffer: Tensor
    before: Tensor

    def changed(self) -> str:
        """An empty string if the buffer is untouched, else what changed."""
        now = bits(self.buffer)
        diff = now != bits(self.before)
        if not diff.any():
            return ""
        probe = torch.zeros(self.buffer.shape, dtype=torch.uint8, device=self.buffer.device)
        probe.as_strided(self.view.shape, self.view.stride(), self.view.storage_offset()).fill_(1)
        inside = probe.bool()
        n_in, n_out = int((diff & inside).sum()), int((diff & ~inside).sum())
        return f"{n_in} elements of the operand and {n_out} of the guard regions around it were written"


def guard(t: Tensor, device: torch.device, layout: str = "contiguous") -> Guarded:
    """``t``'s values on ``device`` as a view in ``layout`` inside a sentinel-filled buffer."""
    strides = _layout_strides(tuple(t.shape), layout)
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, strides)) if t.numel() else 0
    buffer = torch.full((MARGIN + span + MARGIN,), sentinel(t.dtype), dtype=t.dtype, device=device)
    view = buffer.as_strided(tuple(t.shape), strides, MARGIN)
    view.copy_(t.to(device))
    return Guarded(view, buffer, buffer.clone())


def poison_allocator(device: torch.device, sizes: list[tuple[int, torch.dtype]]) -> None:
    """Hand the allocator blocks of these (numel, dtype) sizes filled with 0xFF bytes, then give them back."""
    blocks = [torch.full((n * dtype.itemsize,), 0xFF, dtype=torch.uint8, device=device) for n, dtype in sizes if n]
    del blocks


def block_geometry(kv_cache_shape) -> tuple[int, int] | None:
    """(dim, extent) such that block b of a cache is indices [b*extent, (b+1)*extent) of ``dim``, found from
    ``kv_cache_shape(n)`` for two block counts; None if the layout has no such dimension."""
    a, b = tuple(kv_cache_shape(7)), tuple(kv_cache_shape(11))
    dims = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) != len(b) or len(dims) != 1 or a[dims[0]] % 7 or b[dims[0]] // 11 != a[dims[0]] // 7:
        return None
    return dims[0], a[dims[0]] // 7


@dataclass
class GuardedCache:
    """One layer's KV cache as a view in a buffer with NaN margins; the body starts as CACHE_SENTINEL."""

    cache: Tensor
    buffer: Tensor
    geometry: tuple[int, int] | None
    per_slot: int  # cache elements one token occupies (numel of one block / block_size)

    @classmethod
    def allocate(cls, attn, num_blocks: int) -> "GuardedCache":
        shape = tuple(attn.kv_cache_shape(num_blocks))
        numel = torch.Size(shape).numel()
        dtype = attn.allocate_kv_cache(1).dtype
        buffer = torch.full((MARGIN + numel + MARGIN,), sentinel(dtype), dtype=dtype, device=attn.device)
        cache = buffer[MARGIN : MARGIN + numel].view(shape)
        cache.fill_(CACHE_SENTINEL if dtype.is_floating_point else 0x55)
        per_slot = torch.Size(attn.kv_cache_shape(1)).numel() // attn.block_size
        return cls(cache, buffer, block_geometry(attn.kv_cache_shape), per_slot)

    def snapshot(self) -> Tensor:
        return self.buffer.clone()

    def check_writes(self, before: Tensor, slots: Tensor, block_size: int) -> str:
        """What went wrong with the writes of one step since ``before`` (an empty string if nothing)."""
        diff = bits(self.buffer) != bits(before)
        margins = torch.cat((diff[:MARGIN], diff[-MARGIN:]))
        if margins.any():
            return f"attention wrote {int(margins.sum())} elements outside the KV cache tensor"
        changed = diff[MARGIN:-MARGIN].view(self.cache.shape)
        slots = slots.cpu().long()
        if self.geometry is None:
            n = int(changed.sum())
            limit = slots.numel() * self.per_slot
            return "" if n <= limit else (f"attention changed {n} cache elements; {slots.numel()} new tokens occupy "
                                          f"{limit}")
        dim, extent = self.geometry
        per_block = changed.movedim(dim, 0).reshape(self.cache.shape[dim] // extent, -1).sum(-1).cpu()
        allowed = torch.bincount(slots // block_size, minlength=per_block.numel())[: per_block.numel()]
        outside = ((per_block > 0) & (allowed == 0)).nonzero().flatten().tolist()
        if outside:
            return (f"attention wrote into blocks {outside[:8]} where no new token goes (slot_mapping names "
                    f"blocks {sorted(set((slots // block_size).tolist()))[:8]}...)")
        over = (per_block > allowed * self.per_slot).nonzero().flatten().tolist()
        if over:
            b = over[0]
            return (f"attention changed {int(per_block[b])} elements of block {b}, where its {int(allowed[b])} new "
                    f"tokens occupy {int(allowed[b]) * self.per_slot}: a write outside the new tokens' slots")
        unwritten = ((allowed > 0) & (per_block == 0)).nonzero().flatten().tolist()
        if unwritten:
            return f"attention left blocks {unwritten[:8]} unchanged though new tokens go there (slot_mapping)"
        return ""
