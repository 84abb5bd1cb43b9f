"""``greedy_sample``: the index of each row's largest logit (the first one on ties), in two passes.

torch's argmax gives a row to one block of threads, which leaves most of a GPU idle for a decode
batch (a backend's notes may give numbers). Here each program takes one
chunk of a row and writes its largest value and where it is; a second program per row picks
the first chunk holding the row's maximum. A NaN is taken for +inf (torch also ranks NaN first).
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import pow2

CHUNK = 4096  # logits one program reads


@triton.jit
def _chunk_max_kernel(x, part_val, part_idx, vocab, stride_row, stride_col, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    values = tl.load(x + row * stride_row + cols.to(tl.int64) * stride_col, mask=cols < vocab,
                     other=float("-inf")).to(tl.float32)
    values = tl.where(values != values, float("inf"), values)  # NaN wins, like torch's argmax
    best = tl.max(values, axis=0)
    first = tl.min(tl.where(values == best, cols, vocab), axis=0)
    tl.store(part_val + row * num_chunks + chunk, best)
    tl.store(part_idx + row * num_chunks + chunk, first)


@triton.jit
def _pick_chunk_kernel(part_val, part_idx, out, num_chunks, CHUNKS_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_P)
    ok = c < num_chunks
    values = tl.load(part_val + row * num_chunks + c, mask=ok, other=float("-inf"))
    idx = tl.load(part_idx + row * num_chunks + c, mask=ok, other=0)
    best = tl.max(values, axis=0)
    first = tl.min(tl.where(ok & (values == best), idx, 2147483647), axis=0)
    tl.store(out + row, first.to(tl.int64))


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any strides, any float dtype) -> int64 [B]."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    part_val = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_max_kernel[(rows, num_chunks)](logits, part_val, part_idx, vocab, logits.stride(0), logits.stride(1),
                                          num_chunks, CHUNK=CHUNK, num_warps=8)
    _pick_chunk_kernel[(rows,)](part_val, part_idx, out, num_chunks, CHUNKS_P=pow2(num_chunks), num_warps=1)
    return out
