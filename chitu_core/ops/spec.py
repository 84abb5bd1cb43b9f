"""Op signatures and semantics. Every backend op must match these exactly.

Shapes use T for tokens in the step, H for hidden size, B for rows (sequences
being sampled), V for vocabulary size. Unless an op says otherwise, outputs
have the dtype of the first tensor input, inputs may be non-contiguous, and
ops return new tensors (they never modify their inputs). Reductions (norms,
softmax) accumulate in at least float32.
"""

from typing import Protocol

import torch

Tensor = torch.Tensor


class OpSet(Protocol):
    """The ops a backend provides. ``chitu_core.ops.reference`` is the definition by example."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x: [..., H], weight: [H]. Returns weight * (x / sqrt(mean(x**2, -1) + eps)).

        The normalisation is computed in float32 and cast back to x.dtype before
        the multiplication by weight (the Llama convention)."""

    def fused_add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """x, residual: [..., H]. Returns (rms_norm(x + residual), x + residual); the sum is
        rounded to x.dtype before the norm, as an unfused add would be."""

    def rotary_embedding(
        self, positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool
    ) -> tuple[Tensor, Tensor]:
        """Rotary position embedding of queries and keys.

        positions: int64 [T]; q: [T, Hq, D]; k: [T, Hk, D]; cos_sin_cache: float32 [P, R]
        holding cos(pos * inv_freq) in columns [0, R/2) and sin in [R/2, R), with R <= D
        the rotary dimension (only the first R channels of each head rotate). Rotation is
        computed in float32. is_neox pairs channel i with i + R/2 (GPT-NeoX, Llama);
        otherwise channel 2i with 2i+1 (GPT-J, interleaved). Returns rotated (q, k)."""

    def silu_and_mul(self, x: Tensor) -> Tensor:
        """x: [..., 2I]. Returns silu(x[..., :I]) * x[..., I:] ([..., I])."""

    def gelu_and_mul(self, x: Tensor, approximate: str = "none") -> Tensor:
        """x: [..., 2I]. Returns gelu(x[..., :I]) * x[..., I:]; approximate is "none" (erf)
        or "tanh"."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """x: [..., K], weight: [N, K], bias: [N] or None. Returns x @ weight.T + bias."""

    def embedding(self, ids: Tensor, weight: Tensor) -> Tensor:
        """ids: int64 [...] in [0, V); weight: [V, H]. Returns weight[ids] ([..., H])."""

    def greedy_sample(self, logits: Tensor) -> Tensor:
        """logits: [B, V]. Returns int64 [B], the index of the largest logit (the lowest
        index among ties)."""

    def apply_temperature(self, logits: Tensor, temperature: Tensor) -> Tensor:
        """logits: [B, V]; temperature: float32 [B]. Returns float32 logits / temperature per
        row; rows whose temperature is 0 are returned unscaled (they are sampled greedily)."""

    def apply_top_k_top_p(self, logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
        """logits: float32 [B, V]; top_k: int64 [B]; top_p: float32 [B].

        Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary
        are all kept); k <= 0 or k >= V disables it. Top-p then keeps the smallest set of
        most probable tokens (of the softmax of what top-k kept) whose probability sums to
        at least top_p, and always the most probable one; top_p = 1 disables it. Removed
        tokens get -inf. Returns float32 [B, V]."""

    def apply_min_p(self, logits: Tensor, min_p: Tensor) -> Tensor:
        """logits: float32 [B, V]; min_p: float32 [B]. Sets to -inf every token whose
        probability is below min_p times the row's largest probability; min_p = 0 disables."""

    def apply_penalties(
        self,
        logits: Tensor,
        prompt_mask: Tensor,
        output_counts: Tensor,
        repetition: Tensor,
        frequency: Tensor,
        presence: Tensor,
    ) -> Tensor:
        """Repetition, frequency and presence penalties, as vLLM and transformers define them.

        logits: float32 [B, V]; prompt_mask: bool [B, V], True where the token occurs in the
        row's prompt; output_counts: int32 or int64 [B, V], how many times the token occurs in
        the row's output so far (>= 0); repetition (> 0), frequency, presence: float32 [B].

        For a token in the prompt or in the output (count > 0), a logit > 0 is divided by the
        row's repetition and a logit <= 0 is multiplied by it; other logits are kept. Then every
        token loses frequency * count and, if count > 0, presence:
        ``out = rep(logit) - frequency * count - presence * (count > 0)``, in float32. Repetition
        1, frequency 0 and presence 0 leave a row exactly unchanged; -inf stays -inf. Returns
        float32 [B, V]."""

    def random_sample(self, probs: Tensor, exponentials: Tensor) -> Tensor:
        """probs: float32 [B, V] (rows sum to 1); exponentials: float32 [B, V] of
        independent Exp(1) draws. Returns int64 [B], argmax(probs / exponentials): an exact
        sample from each row's distribution, determined entirely by the given noise."""

    def log_softmax(self, logits: Tensor) -> Tensor:
        """logits: [B, V]. Returns float32 log-probabilities over the last dimension."""

    # --- contract 1.1: mixture of experts ---------------------------------------------------------

    def moe_route(
        self,
        router_logits: Tensor,
        top_k: int,
        scoring: str = "softmax",
        renormalize: bool = False,
        correction_bias: Tensor | None = None,
        num_groups: int = 1,
        topk_groups: int = 1,
        group_score: str = "max",
        scaling: float = 1.0,
    ) -> tuple[Tensor, Tensor]:
        """Choose top_k of E experts for each of T tokens. Returns (weights float32 [T, top_k],
        ids int64 [T, top_k]); the k entries of a row may come in any order (weights follow ids).

        router_logits: [T, E] in any float dtype; everything is computed in (at least) float32.
        scores = softmax(logits) over E (scoring "softmax") or sigmoid(logits) ("sigmoid").
        choice = scores + correction_bias (float32 [E], DeepSeek-V3's e_score_correction_bias) if
        given, else scores. Grouped routing (num_groups > 1): the E experts form num_groups
        contiguous groups; a group's score is the max of its choices ("max", DeepSeek-V2) or the
        sum of its two largest ("top2_sum", DeepSeek-V3); only experts of the topk_groups best
        groups may be chosen. ids are the top_k experts by choice; weights are their *scores*
        (without the bias), divided by their sum if renormalize, then multiplied by scaling."""

    def fused_experts(
        self,
        x: Tensor,
        w13: Tensor,
        w2: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        activation: str = "silu",
    ) -> Tensor:
        """The routed experts of a MoE layer, weighted and summed.

        x: [T, H]; w13: [E, 2I, H], each expert's gate rows then its up rows; w2: [E, H, I];
        topk_weights: float32 [T, k]; topk_ids: int64 [T, k], in [0, E) or negative (a slot
        routed to no expert held here: it contributes nothing, as expert parallelism needs).
        Returns [T, H] in x.dtype: for each token, sum over its slots j of
        ``topk_weights[j] * (w2[e_j] @ act_and_mul(w13[e_j] @ x))``, where act_and_mul is the op
        ``silu_and_mul`` (activation "silu") or ``gelu_and_mul`` ("gelu"). The activation's result
        is rounded to x.dtype, as the unfused ops would round it; the down projection, the weighting
        and the sum over slots may accumulate in float32."""

    # --- contract 1.2: quantized linears (chitu_core.quantization's methods call these) -------------
    # Each takes x: [..., K] in float16, bfloat16, float32 (float64 for the reference) and an optional
    # bias [N] in x.dtype, and returns x @ W.T + bias in x.dtype ([..., N]), W [N, K] being the
    # dequantized weight below. Dequantization is exact in float32 (the reference computes in float64
    # when x is float64); products accumulate in at least float32.

    def int4_linear(self, x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int,
                    bias: Tensor | None) -> Tensor:
        """4-bit weights in groups along K (AWQ, GPTQ, in-situ int4 after repacking).

        qweight: int32 [K/8, N]; bits 4j..4j+3 of qweight[i, n] (j = 0..7, as unsigned) hold
        q[8i + j, n] in [0, 16). scales, zeros: [K/G, N] of one float dtype, G = group_size (K % G == 0,
        G % 8 == 0). W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]."""

    def int8_linear(self, x: Tensor, weight: Tensor, scales: Tensor, act_quant: bool,
                    bias: Tensor | None) -> Tensor:
        """8-bit integer weights with a float32 scale per output channel (W8A8, W8A16).

        weight: int8 [N, K]; scales: float32 [N]; W[n, k] = weight[n, k] * scales[n]. act_quant: each
        row of x is first quantized symmetrically to int8: s = max|row| / 127 (1 for an all-zero row),
        q = clamp(round-half-to-even(row / s), -127, 127), computed in float32, and q * s takes the
        row's place (so y = (q @ weight.T) * s * scales, the integer products being exact)."""

    def fp8_linear(self, x: Tensor, weight: Tensor, scales: Tensor, block_size: tuple[int, int] | None,
                   act_quant: bool, bias: Tensor | None) -> Tensor:
        """FP8 (e4m3) weights, per output channel or in [bn, bk] blocks (DeepSeek-V3's format).

        weight: float8_e4m3fn [N, K]. block_size None: scales float32 [N], W[n, k] = weight[n, k] *
        scales[n]. block_size (bn, bk): scales float32 [ceil(N/bn), ceil(K/bk)], W[n, k] = weight[n, k]
        * scales[n // bn, k // bk]. act_quant (where the device multiplies FP8): x is quantized
        dynamically per token, in groups of bk along K with blocks (the whole row without): s = max|g| /
        448 (1 for an all-zero group), q = (g / s) cast to float8_e4m3fn (round to nearest even),
        computed in float32, and q * s takes g's place. Without act_quant ("soft FP8") x is used as is."""

    def gguf_linear(self, x: Tensor, qweight: Tensor, qtype: int, bias: Tensor | None) -> Tensor:
        """GGUF/GGML block-quantized weights, kept in the file's own block layout.

        qweight: uint8 [N, K / E * B]: each row is its K values as K / E consecutive blocks of the type's
        E elements and B bytes; qtype: the ggml type id (``gguf.GGMLQuantizationType``: Q4_0 2, Q4_1 3,
        Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14). W is the rows dequantized exactly as ggml's reference
        dequantizer does (``chitu_core.quantization.gguf_blocks``)."""

    # --- contract 1.3: quantized MoE experts (a quantization method's ``apply_experts`` calls it) ------

    def fused_experts_fp8(
        self,
        x: Tensor,
        w13: Tensor,
        w13_scale: Tensor,
        w2: Tensor,
        w2_scale: Tensor,
        block_size: tuple[int, int] | None,
        topk_weights: Tensor,
        topk_ids: Tensor,
        activation: str = "silu",
    ) -> Tensor:
        """``fused_experts`` with FP8 (e4m3) expert weights and 16-bit (or float32) activations ("soft FP8").

        w13: float8_e4m3fn [E, 2I, H]; w2: float8_e4m3fn [E, H, I]. block_size (bn, bk): w13_scale
        float32 [E, ceil(2I/bn), ceil(H/bk)], w2_scale [E, ceil(H/bn), ceil(I/bk)], W[e, n, k] =
        w[e, n, k] * scale[e, n // bn, k // bk] (last blocks possibly partial); block_size None: per output
        channel, w13_scale float32 [E, 2I], w2_scale [E, H], W[e, n, k] = w[e, n, k] * scale[e, n]. The
        result is ``fused_experts(x, W13, W2, topk_weights, topk_ids, activation)`` with these dequantized
        weights, which are exact in float32 (the reference computes in float64 when x is float64): the same
        slots, negative ids skipped, the activation's result rounded to x.dtype, float32 accumulation."""

    # --- contract 1.6: norms of more architectures (Gemma's, LayerNorm) ------------------------------

    def offset_rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x: [..., H], weight: [H]. Returns (x / sqrt(mean(x**2, -1) + eps)) * (1 + weight), all of it
        computed in float32 and rounded to x.dtype once at the end (the Gemma convention: its stored
        weight is the offset from one)."""

    def fused_add_offset_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """x, residual: [..., H]. Returns (offset_rms_norm(x + residual), x + residual); the sum is
        rounded to x.dtype before the norm, as an unfused add would be."""

    def layer_norm(self, x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
        """x: [..., H], weight and bias (or None): [H]. Returns (x - mean) / sqrt(var + eps) * weight
        + bias over the last dimension (biased variance), computed in float32 and rounded to x.dtype
        once at the end."""

    # --- contract 1.9: decode-step fusions (layers call them only where the backend serves them itself) ---

    def rms_norm_linear(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                        activation: str | None = None) -> Tensor:
        """x: [..., K], norm_weight: [K], weight: [N, K], bias: [N] or None. Returns
        ``linear(rms_norm(x, norm_weight, eps), weight, bias)`` ([..., N]); with ``activation`` ("silu",
        "gelu" or "gelu_tanh") the gated activation of that product, act(y[..., :N/2]) * y[..., N/2:]
        ([..., N/2]), as ``silu_and_mul``/``gelu_and_mul`` give it. The normed x may stay in float32
        rather than be rounded to x.dtype; accumulation in float32, the result rounded once."""

    def linear_add(self, x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
        """x: [..., K], weight: [N, K], bias: [N] or None, residual: [..., N]. Returns
        ``residual + linear(x, weight, bias)``; the float32 product may be added to the residual before
        rounding (once) rather than after."""

    # --- contract 1.10: multi-head latent attention's inputs in one op (layers call it where the backend
    # serves it itself, for steps of at most ``Backend.fusion_max_tokens`` tokens) ---

    def mla_inputs(self, q: Tensor, kv: Tensor, w_uk: Tensor, kv_norm_weight: Tensor, eps: float,
                   positions: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> tuple[Tensor, Tensor]:
        """The absorbed query and the latent of multi-head latent attention, from its projections.

        q: [T, H, N + R], each head's N channels without position then its R rotary ones (R the width
        of cos_sin_cache); kv: [T, L + R], the compressed KV then the one rotary key all heads share;
        w_uk: [H, N, L], each head's key up-projection; kv_norm_weight: [L]; positions, cos_sin_cache
        and is_neox as ``rotary_embedding``. Returns (q_attn [T, H, L + R], latent [T, L + R]) in
        q.dtype: q_attn[t, h] = (q[t, h, :N] @ w_uk[h], the rotated q[t, h, N:]) and latent[t] =
        (rms_norm(kv[t, :L], kv_norm_weight, eps), the rotated kv[t, L:]), what the MLA attention
        takes. Each part computed in float32 and rounded to q.dtype once, except that the normed kv
        may be rounded before its product with the weight, as ``rms_norm`` may do."""

    # --- contract 1.11: a float32 product over a lower-precision input (routers' logits) ---

    def linear_float32(self, x: Tensor, weight: Tensor) -> Tensor:
        """x: [..., K] in any floating dtype, weight: float32 [N, K]. Returns float32 ``x @ weight.T``
        ([..., N]), x widened to float32 exactly and the products summed in float32: a router whose
        weight and logits stay float32 in a bfloat16 model (DeepSeek's), without a cast of x first."""

    # --- contract 1.18: the decode-step fusions over 4-bit weights (layers call them only where the backend
    # serves them itself, as those of 1.9) ---

    def int4_rms_norm_linear(self, x: Tensor, norm_weight: Tensor, eps: float, qweight: Tensor, scales: Tensor,
                             zeros: Tensor, group_size: int, bias: Tensor | None,
                             activation: str | None = None) -> Tensor:
        """``rms_norm_linear`` with ``int4_linear``'s weight: x: [..., K], norm_weight: [K], qweight,
        scales, zeros and group_size as ``int4_linear`` takes them (W [N, K]), bias: [N] or None. Returns
        ``int4_linear(rms_norm(x, norm_weight, eps), ...)`` ([..., N]); with ``activation`` its gated
        activation ([..., N/2]). The normed x may stay in float32; accumulation in float32, the result
        rounded once."""

    def int4_linear_add(self, x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int,
                        bias: Tensor | None, residual: Tensor) -> Tensor:
        """``linear_add`` with ``int4_linear``'s weight: ``residual + int4_linear(x, ...)`` ([..., N]); the
        float32 product may meet the residual before it is rounded."""


OP_NAMES: tuple[str, ...] = tuple(
    name for name in OpSet.__dict__ if not name.startswith("_") and callable(OpSet.__dict__[name])
)
