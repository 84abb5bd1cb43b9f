"""STAND-IN for ``torch_npu.npu_fused_infer_attention_score``, in its page-attention form only, on the host.

Doc: torch_npu API reference, "torch_npu.npu_fused_infer_attention_score" (Pytorch 7.0.0, ptaoplist_001232).
"""

import math

import torch

Tensor = torch.Tensor
MASK_SIZE = 2048


def _fail(what: str) -> None:
    raise RuntimeError(f"torch_npu stand-in: npu_fused_infer_attention_score needs {what}")


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    softmax_lse_flag=False, **unused) -> tuple[Tensor, Tensor]:
    """What the page documents for input_layout "TND" with a block table:

    query [T, N, D] float16/bfloat16, contiguous, the sequences' tokens packed along T; actual_seq_lengths the
    cumulative ends of the sequences in T (host ints); key and value the paged caches [blockNum, blockSize,
    H] (H = num_key_value_heads * D) with blockSize == block_size, a multiple of 16; block_table int32
    [B, maxBlocks] the blocks of each sequence in order; actual_seq_lengths_kv the tokens of each sequence
    in the cache (host ints). num_key_value_heads 0 means num_heads; query head h reads key/value head
    h // (num_heads / num_key_value_heads). sparse_mode 0 without a mask: every key; sparse_mode 3:
    right-down causal, query i of a sequence with S_q queries and S_kv keys sees keys j <= i + S_kv - S_q,
    with atten_mask the 2048 x 2048 upper-triangular bool/int8 mask. Returns (out [T, N, D] in query's
    dtype, softmax_lse float32 [T, N, 1])."""
    if unused or pse_shift is not None:
        _fail(f"no other arguments in the stand-in (got {sorted(unused) or ['pse_shift']})")
    if input_layout != "TND" or block_table is None:
        _fail("input_layout 'TND' with a block_table (the only form the stand-in implements)")
    if query.dtype not in (torch.float16, torch.bfloat16) or not query.is_contiguous():
        _fail(f"a contiguous float16/bfloat16 query, not {query.dtype}")
    kv_heads = num_key_value_heads or num_heads
    tokens, heads, dim = query.shape
    if heads != num_heads or num_heads % kv_heads or block_size % 16 or key.shape[1] != block_size:
        _fail("num_heads matching query, a multiple of num_key_value_heads, and caches of block_size (16k) tokens")
    if key.dim() != 3 or key.shape != value.shape or key.shape[2] != kv_heads * dim or block_table.dtype != torch.int32:
        _fail("key and value [blockNum, blockSize, num_key_value_heads * D] and an int32 block_table")
    if sparse_mode == 3:
        if atten_mask is None or tuple(atten_mask.shape) != (MASK_SIZE, MASK_SIZE):
            _fail("sparse_mode 3 with the 2048 x 2048 mask")
        if not bool(atten_mask.bool().equal(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1))):
            _fail("the upper-triangular (True above the diagonal) mask for sparse_mode 3")
    elif sparse_mode != 0 or atten_mask is not None:
        _fail("sparse_mode 0 (no mask) or 3 (the stand-in implements these)")
    ends, kv_lens = list(actual_seq_lengths), list(actual_seq_lengths_kv)
    if len(ends) != len(kv_lens) or len(kv_lens) > block_table.shape[0] or (ends and ends[-1] > tokens):
        _fail("one cumulative query end and one kv length per block-table row")
    out = torch.zeros(tokens, heads, dim, dtype=torch.float32)
    lse = torch.zeros(tokens, heads, 1, dtype=torch.float32)
    start = 0
    for b, (end, kv_len) in enumerate(zip(ends, kv_lens)):
        n_q = end - start
        blocks = block_table[b, : math.ceil(kv_len / block_size)].long()
        k = key[blocks].reshape(-1, kv_heads, dim)[:kv_len].float().repeat_interleave(heads // kv_heads, dim=1)
        v = value[blocks].reshape(-1, kv_heads, dim)[:kv_len].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
        if sparse_mode == 3:
            visible = torch.arange(kv_len)[None, :] <= torch.arange(n_q)[:, None] + (kv_len - n_q)
            scores = scores.masked_fill(~visible, float("-inf"))
        lse[start:end] = torch.logsumexp(scores, -1).transpose(0, 1)[..., None]
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start = end
    return out.to(query.dtype), lse
