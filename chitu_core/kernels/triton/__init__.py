"""Portable Triton kernels for the op and attention contracts; a backend opts in, the core never calls them.

One module per kernel family, each a launcher that matches its contract op exactly:

  rms_norm.py         rms_norm, fused_add_rms_norm
  activation.py       silu_and_mul, gelu_and_mul
  rotary.py           rotary_embedding (neox and interleaved, partial rotary dim),
                      and rotary fused with the KV-cache write
  kv_cache.py         the KV-cache write (slot_mapping scatter)
  paged_attention.py  paged attention for mixed prefill/decode batches, with split-KV decode
  attention.py        ``TritonPagedAttention``, the AttentionBackend over the two above
  moe.py              moe_route (one program per token) and fused_experts (grouped GEMMs over
                      expert-sorted slots, or per-slot matrix-vector products for decode)
  moe_align.py        fused_experts' sort of token slots by expert, padded to the GEMM's block rows
  moe_fp8.py          fused_experts_fp8 (contract 1.3): moe.py's two paths over FP8 weights with block or
                      channel scales, read as float8 or as bytes decoded in registers
  mla_attention.py    multi-head latent attention over the latent cache (contract 1.1)
  mla_inputs.py       mla_inputs (contract 1.10): MLA's absorbed query and latent in one launch (the NVIDIA
                      backend's, for its one-token steps)
  int4_linear.py      int4_linear (AWQ/GPTQ/in-situ int4 after repacking): tl.dot tiles for several rows
  gemv.py             int4_linear's matrix-vector kernel for one row (batch-1 decode)
  dense_gemv.py       a 16-bit or float32 linear's matrix-vector kernel for one row (the NVIDIA backend's
                      linear at batch 1 for outputs of up to 4096, and linear_float32's: contract 1.11)
  fused_gemv.py       the decode-step fusions (contract 1.9): dense_gemv with the RMSNorm in its prologue and
                      the gated activation or the residual add in its epilogue (the NVIDIA backend's
                      rms_norm_linear and linear_add at batch 1)
  splitk_gemv.py      a few rows times a large 16-bit weight: wide tiles, pipelined tensor-core steps, K split
                      and finished in order, with the same fusions (the NVIDIA backend's batch-1 products of
                      weights of 20M+ elements and K of 4096+)
  quant_matmul.py     the matmul behind fp8_linear.py and int8_linear.py (8-bit weights, per-channel or
                      block scales, 16-bit or dynamically quantized 8-bit activations: act_quant.py)
  gguf_linear.py      gguf_linear over GGUF's own blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)
  split_k.py          split-K partial sums added in order: by the kernel's last slice, or a second pass
  pdl.py              programmatic dependent launch: the decode path's kernels start while the kernel
                      before them finishes (Hopper and newer; CHITU_PDL=0 turns it off)
  ops.py              ``TRITON_OPS``: the op-contract names these kernels serve

Importing this package does not import triton; importing any module above does.
"""
