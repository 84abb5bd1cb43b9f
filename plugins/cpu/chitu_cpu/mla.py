"""Multi-head latent attention on the CPU with PyTorch's scaled_dot_product_attention.

Layout: [num_blocks, block_size, L + R], one latent row per token (L = kv_lora_rank channels,
then R = rope_dim). Each layer writes its new latents, gathers every sequence's latents through
its block table into [B, max_seq_len, L + R], and runs one SDPA call for the whole batch with
the gathered latents as both key and value: the output's first L channels are the contract's
(value = the latents' first L channels) and the last R are dropped. A value narrower than the
key would send SDPA to its unfused math path; the shared tensor keeps its fused CPU kernel.

An fp8 cache (contract 1.2) is written as the reference writes it; the gathered latents are upcast to
the model dtype (exact for e4m3), the layer's scale folded into the softmax scale and multiplied into
the output.

Decode-only steps fold the heads into the query rows of the one shared key "head" ([B, 1, H,
L + R] against [B, 1, S, L + R]): every key is read once per sequence, not once per head. Other
steps broadcast the key over the heads (a stride-0 expand, no copy), so that the causal mask
[B, 1, max_query_len, S] is shared by every head.
"""

import torch.nn.functional as F

from chitu_core.attention.contract import AttentionMetadata
from chitu_core.attention.mla import MLAAttentionBackend, gather_latents, write_latent
from chitu_cpu.attention import CpuStepState, zero_pages


class CpuSdpaMLAAttention(MLAAttentionBackend):
    """The CPU's MLA backend; cache [num_blocks, block_size, kv_lora_rank + rope_dim] (see the module)."""

    name = "sdpa-mla"
    block_sizes = (16, 1, 8, 32, 64, 128)
    supports_fp8_kv_cache = True
    commits_on_write = True  # contract 1.14: anonymous zero pages, as the CPU's sdpa keeps its cache

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.latent_dim)

    def allocate_kv_cache(self, num_blocks: int):
        return zero_pages(self.kv_cache_shape(num_blocks), self.kv_cache_dtype)

    def prepare(self, meta: AttentionMetadata) -> CpuStepState:
        return CpuStepState.of(meta)

    def forward(self, q, latent, kv_cache, meta, scale, kv_scale=None):
        state: CpuStepState = meta.backend_state
        write_latent(kv_cache, latent, meta.slot_mapping, kv_scale)
        keys = gather_latents(kv_cache, meta)[:, None]  # [B, 1, S, L + R]
        value_scale = None
        if kv_scale is not None:  # an fp8 cache
            keys, value_scale = keys.to(q.dtype), kv_scale.item()
            scale *= value_scale
        b, h, d = meta.num_seqs, q.shape[1], q.shape[2]
        q_pad = q.new_zeros(b, meta.max_query_len, h, d)
        q_pad[state.seq_idx, state.pos] = q
        if meta.max_query_len == 1:  # q_pad [B, 1, H, L + R] read as one shared head with H query rows
            out = F.scaled_dot_product_attention(q_pad, keys, keys, attn_mask=state.mask, scale=scale)
        else:
            keys = keys.expand(b, h, -1, -1)
            out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, keys, attn_mask=state.mask,
                                                 scale=scale).transpose(1, 2)  # [B, max_q, H, L + R]
        out = out[..., : self.kv_lora_rank][state.seq_idx, state.pos]
        return out if value_scale is None else (out.float() * value_scale).to(q.dtype)
