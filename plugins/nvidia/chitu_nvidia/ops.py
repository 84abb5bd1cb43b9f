"""The NVIDIA backend's ops over the portable Triton ones (``TritonBackend.native_ops``).

One row of 16-bit x times a large weight (``splitk_takes``) goes to the split-K matrix-vector kernel
(``splitk_gemv``): plain, with the norm of ``rms_norm_linear`` (contract 1.9) in its prologue, or with the add
of ``linear_add`` in its epilogue; a gated ``rms_norm_linear`` of such a weight runs the norm, the kernel and
the activation. Otherwise linear goes to cuBLAS, or to cuBLASLt for the batch sizes where its kernels are
faster, or at batch 1 with an output of up to ``MAX_GEMV_N`` to the Triton matrix-vector kernel; the fusions
take the fused matrix-vector kernel at batch 1 for weights of up to ``MAX_FUSED_N`` outputs, and up to
``fused_gemv.MAX_ROWS`` rows for small weights (``MAX_FUSED_ROWS_WEIGHT``); else the unfused ops.
``mla_inputs`` (contract 1.10) is the portable Triton
kernel, served here rather than by every Triton backend: its per-head matrix-vector products suit decode
steps (``fusion_max_tokens``), not a prefill's thousands of tokens. One row of 16-bit x through
``int4_linear`` takes this plugin's matrix-vector kernel with x as 8-bit digits and its products in integer
dot products (``int4_digits_gemv``: PTX); through ``fp8_linear`` with unquantized activations, the one with
its products in fp16 pairs (``fp8_gemv``), as int4's fp16-pair one (``int4_gemv``) where
CHITU_INT4_DIGITS=0; with CHITU_INT4_FUSIONS=1 (``INT4_FUSIONS``) so do the 4-bit weights' fusions of contract 1.18
(``int4_rms_norm_linear``, ``int4_linear_add``), in that kernel's prologue and epilogue. Before
Ada/Hopper (compute capability 8.9) there are no FP8 types, so the FP8 linears and experts decode the
bytes in registers. Sampling filters and penalties stay reference fallbacks until on-device sampling
kernels land.
"""

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

LT_ROWS = (32, 64)
"""Rows (tokens) for which ``linear`` asks PyTorch for cuBLASLt: on an H200, bf16 Llama-3.1-8B
decode shapes (scripts/gemm_layouts.py rows), cuBLASLt is as fast or faster for 32-64 rows
(at 64: gate_up 59.5 -> 56.8 us, down 34.9 -> 31.3 us) and slower at 16 (down) and at 128
(down, LM head); elsewhere they tie. Graph capture records the choice, so replays pay nothing."""

MAX_GEMV_N = int(os.environ.get("CHITU_GEMV_MAX_N", 4096))
"""Widest output ``linear`` sends to the Triton matrix-vector kernel at batch 1 (``dense_gemv_config``);
CHITU_GEMV_MAX_N sets another (to compare). On an H100 (plugins/nvidia/scripts/dense_gemv_sweep.py,
SEARCH=0) the kernel beat cuBLAS on every bf16 decode shape of SmolLM2-135M, Qwen3-1.7B, Llama-3.1-8B,
Qwen3-30B-A3B and DeepSeek-V2-Lite up to 4096 outputs (Llama-3.1-8B down 52.6 -> 45.7 us, SmolLM2's
576 x 576 3.6 -> 1.7 us); wider (5632, the LM heads, 28672) cuBLAS was faster or tied."""
MAX_FUSED_N = int(os.environ.get("CHITU_FUSED_MAX_N", 8192))
"""Widest weight (both halves of a gated pair) the decode-step fusions send to the fused matrix-vector
kernel at batch 1; CHITU_FUSED_MAX_N sets another, 0 turns the fused kernel off (to compare). On an H100
(plugins/nvidia/scripts/fused_gemv_sweep.py) it beat RMSNorm + linear (+ silu_and_mul) and linear + add
on every bf16 decode shape of SmolLM2-135M, Qwen3-1.7B and Llama-3.1-8B up to 6144 outputs (SmolLM2
gate_up 6.0 -> 3.9 us, o_proj 5.0 -> 1.9 us; Llama-3.1-8B qkv 25.3 -> 23.4 us), tied at 12288 (Qwen3-1.7B
gate_up) and lost at 28672 (Llama-3.1-8B gate_up, 88.8 -> 98.2 us)."""
MAX_FUSED_ROWS_WEIGHT = int(os.environ.get("CHITU_FUSED_ROWS_MAX_WEIGHT", 1 << 21))
"""Largest weight (elements) the fused kernel takes for 2 to 8 rows. Its tensor-core product beat the
unfused ops on SmolLM2-135M's shapes at 4 rows (qkv 5.7 -> 3.8 us, o_proj 5.2 -> 3.2 us) but lost from
Qwen3-1.7B's up (o_proj 7.8 -> 8.1 us at best, down 16.2 -> 21.9 us)."""
SPLITK_MIN_WEIGHT = int(os.environ.get("CHITU_SPLITK_MIN_WEIGHT", 20_000_000))
"""Smallest 16-bit weight (elements) whose one-row products take ``splitk_gemv``, if its K is at least
``SPLITK_MIN_K`` and its N at most ``SPLITK_MAX_N``; CHITU_SPLITK_MIN_WEIGHT=0 turns the kernel off (to
compare). On an H200 (docs/benchmarks/nvidia-h200-splitk-gemv.md) it takes Llama-3.1-8B's qkv, gate/up and
down (batch-1 decode 221.0 -> 240.6 tok/s, 0.792 -> 0.864 of the byte floor); o_proj (16.8M elements) stays on
the fused matrix-vector kernel, faster there. Qwen3-1.7B's gate/up (25.2M elements, K 2048), taken in a trial,
cost its batch-1 decode 1% (650.5 -> 643.7 tok/s), hence ``SPLITK_MIN_K``."""
SPLITK_MIN_K = 4096
"""Shallowest weight (features) ``splitk_gemv`` takes at one row: each slice of K must stream long enough to
pay for the split's finish."""
SPLITK_MAX_N = 32768
"""Widest weight ``splitk_gemv`` takes: a vocabulary head stays on cuBLAS."""
PAIRS_GEMV = os.environ.get("CHITU_PAIRS_GEMV", "1") != "0"
"""One row of 16-bit x through int4_linear, and through fp8_linear without activation quantization, takes this
plugin's matrix-vector kernels (PTX: int4's per ``INT4_DIGITS``, ``fp8_gemv``); CHITU_PAIRS_GEMV=0 leaves them
to the portable Triton kernels (to compare)."""
INT4_FUSIONS = os.environ.get("CHITU_INT4_FUSIONS", "0") == "1"
"""Whether this backend serves the 4-bit weights' fusions of contract 1.18 (on ``int4_gemv``); by default it
leaves them to the reference, so the layers keep their unfused path. On an H200 each fused product alone is as
fast or faster (Llama-3.1-8B's qkv 9.1 against 11.1 us, gate/up 26.3 against 27.0), but batch-1 decode is not:
414.4 tok/s with them, 416.9 without (docs/benchmarks/nvidia-h200-int4-fusions.md): under dependent launch the
norm kernels they replace overlap their neighbours. CHITU_INT4_FUSIONS=1 serves them (to compare)."""
INT4_DIGITS = os.environ.get("CHITU_INT4_DIGITS", "1") != "0"
"""One row through int4_linear takes ``int4_digits_gemv`` (x as two 8-bit digits a feature, dp4a products);
CHITU_INT4_DIGITS=0 gives it to ``int4_gemv`` (fp16 pairs; to compare). On an H200, Llama-3.1-8B int4 batch 1
decodes about 4% faster (docs/benchmarks/nvidia-h200-int4-digits.md). The fusions of contract 1.18 stay on
``int4_gemv``."""
FP8_CAPABILITY = (8, 9)
"""Compute capability from which the GPU has FP8 types (Ada, Hopper and newer): Triton reads float8_e4m3fn
and PTX converts e4m3 pairs to fp16 pairs in one instruction."""


def has_fp8_types() -> bool:
    """Whether the current CUDA device has FP8 types (``FP8_CAPABILITY``)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_CAPABILITY


_dense_gemv: Callable | None = None  # bound by nvidia_ops(), which runs only where triton is installed
_splitk_gemv: Callable | None = None
_fused_gemv: Callable | None = None
_MAX_ROWS = 0
_unfused: dict[str, Callable] = {}  # the Triton rms_norm and gated activations, for the shapes the kernel leaves
_pairs: dict[str, Callable] = {}  # the fp16-pair kernels, the portable int4/fp8 linears they stand before, their checks


def splitk_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``splitk_gemv`` takes x times weight [N, K]: one row, 16-bit x and weight of one dtype, at least
    ``SPLITK_MIN_WEIGHT`` elements, K at least ``SPLITK_MIN_K``, N at most ``SPLITK_MAX_N``."""
    n, k = weight.shape
    return (_splitk_gemv is not None and SPLITK_MIN_WEIGHT > 0 and x.numel() == k and x.dtype == weight.dtype
            and weight.dtype in (torch.bfloat16, torch.float16) and weight.numel() >= SPLITK_MIN_WEIGHT
            and k >= SPLITK_MIN_K and n <= SPLITK_MAX_N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if splitk_takes(x, weight):
        return _splitk_gemv(x, weight, bias)
    rows = x.numel() // max(1, x.shape[-1])
    if rows == 1 and weight.shape[0] <= MAX_GEMV_N and x.dtype == weight.dtype and _dense_gemv is not None:
        return _dense_gemv(x, weight, bias)  # batch 1: every projection but the widest and the LM head
    if not LT_ROWS[0] <= rows <= LT_ROWS[1]:
        return F.linear(x, weight, bias)
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight, bias)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Contract 1.11: one row on the matrix-vector kernel, which widens x as it reads it (a 64 x 2048
    float32 router: one launch instead of a cast and the product); else a cast and cuBLAS."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows == 1 and weight.dtype == torch.float32 and weight.shape[0] <= MAX_GEMV_N and _dense_gemv is not None:
        return _dense_gemv(x, weight, None, out_dtype=torch.float32)
    return F.linear(x.float(), weight)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """int4_linear: one row of bfloat16 or float16 x on ``int4_digits_gemv`` (``int4_gemv`` where
    CHITU_INT4_DIGITS=0), else the portable kernel."""
    if not _int4_row_takes(x, qweight):
        return _pairs["int4_linear"](x, qweight, scales, zeros, group_size, bias)
    _pairs["int4_check"](x, qweight, scales, zeros, group_size)
    return _pairs["int4_digits" if INT4_DIGITS else "int4_gemv"](x, qweight, scales, zeros, group_size, bias)


def _int4_row_takes(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether this plugin's one-row int4 kernels (``int4_digits_gemv``, ``int4_gemv``) take x: one row of
    bfloat16 or float16, a weight with columns."""
    return (x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16) and PAIRS_GEMV
            and qweight.shape[-1] > 0)


def int4_rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, qweight: torch.Tensor,
                         scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                         activation: str | None = None) -> torch.Tensor:
    """Contract 1.18: one row on ``int4_gemv`` with the norm in its prologue (and the gated activation in its
    epilogue); else the norm, ``int4_linear`` and the activation."""
    _check_activation("int4_rms_norm_linear", activation)
    if not _int4_row_takes(x, qweight):
        return _gated(int4_linear(_unfused["rms_norm"](x, norm_weight, eps), qweight, scales, zeros, group_size, bias),
                      activation)
    _pairs["int4_check"](x, qweight, scales, zeros, group_size)
    if tuple(norm_weight.shape) != (x.shape[-1],):
        raise ValueError(f"int4_rms_norm_linear: norm_weight {list(norm_weight.shape)} for x of {x.shape[-1]} features")
    return _pairs["int4_gemv"](x, qweight, scales, zeros, group_size, bias, norm_weight=norm_weight, eps=eps,
                               activation=activation)


def int4_linear_add(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """Contract 1.18: one row on ``int4_gemv`` with the residual in its epilogue; else ``int4_linear`` and the add."""
    if not _int4_row_takes(x, qweight):
        return residual + int4_linear(x, qweight, scales, zeros, group_size, bias)
    _pairs["int4_check"](x, qweight, scales, zeros, group_size)
    if tuple(residual.shape) != (*x.shape[:-1], qweight.shape[1]):
        raise ValueError(f"int4_linear_add: residual {list(residual.shape)} for an output of "
                         f"{[*x.shape[:-1], qweight.shape[1]]}")
    return _pairs["int4_gemv"](x, qweight, scales, zeros, group_size, bias, residual=residual)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int] | None,
               act_quant: bool, bias: torch.Tensor | None) -> torch.Tensor:
    """fp8_linear: one row of bfloat16 or float16 x, not quantized, on ``fp8_gemv``; else the portable kernel."""
    rows = x.numel() // max(1, x.shape[-1])
    if (rows != 1 or act_quant or x.dtype not in (torch.bfloat16, torch.float16) or not PAIRS_GEMV
            or weight.shape[0] == 0 or not _pairs["fp8_fits"](weight, block_size)):
        return _pairs["fp8_linear"](x, weight, scales, block_size, act_quant, bias)
    _pairs["fp8_check"](weight, scales, block_size)
    return _pairs["fp8_gemv"](x, weight, scales, block_size, bias)


def _fused_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // max(1, x.shape[-1])
    if _fused_gemv is None or rows > _MAX_ROWS or x.dtype != weight.dtype:
        return False
    return weight.shape[0] <= MAX_FUSED_N if rows == 1 else weight.numel() <= MAX_FUSED_ROWS_WEIGHT


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None, activation: str | None = None) -> torch.Tensor:
    _check_activation("rms_norm_linear", activation)
    splitk = splitk_takes(x, weight)
    if splitk and activation is None:  # gated: the norm, then linear's split-K kernel, then the activation
        return _splitk_gemv(x, weight, bias, norm_weight, eps)
    if _fused_rows(x, weight) and not splitk:
        return _fused_gemv(x, weight, bias, norm_weight, eps, activation)
    return _gated(linear(_unfused["rms_norm"](x, norm_weight, eps), weight, bias), activation)


def _check_activation(op: str, activation: str | None) -> None:
    if activation not in (None, "silu", "gelu", "gelu_tanh"):
        raise ValueError(f"{op}: activation {activation!r} is not 'silu', 'gelu', 'gelu_tanh' or None")


def _gated(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The unfused gated activation of a product (or the product itself)."""
    if activation is None:
        return y
    if activation == "silu":
        return _unfused["silu_and_mul"](y)
    return _unfused["gelu_and_mul"](y, "tanh" if activation == "gelu_tanh" else "none")


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
    if splitk_takes(x, weight):
        return _splitk_gemv(x, weight, bias, residual=residual)
    if _fused_rows(x, weight):
        return _fused_gemv(x, weight, bias, residual=residual)
    return residual + linear(x, weight, bias)


def nvidia_ops() -> dict[str, Callable]:
    """Called only where triton is installed (``TritonBackend.native_ops``)."""
    global _dense_gemv, _fused_gemv, _MAX_ROWS, _splitk_gemv
    from chitu_core.kernels.triton import fp8_linear as portable_fp8
    from chitu_core.kernels.triton import int4_linear as portable_int4
    from chitu_core.kernels.triton import pdl
    from chitu_core.kernels.triton.activation import gelu_and_mul, silu_and_mul
    from chitu_core.kernels.triton.dense_gemv import dense_gemv
    from chitu_core.kernels.triton.fused_gemv import MAX_ROWS, fused_gemv
    from chitu_core.kernels.triton.mla_inputs import mla_inputs
    from chitu_core.kernels.triton.rms_norm import rms_norm
    from chitu_core.kernels.triton.splitk_gemv import splitk_gemv
    from chitu_nvidia.fp8_gemv import fits, fp8_gemv
    from chitu_nvidia.int4_digits import int4_digits_gemv
    from chitu_nvidia.int4_gemv import int4_gemv

    _dense_gemv = dense_gemv
    _splitk_gemv = splitk_gemv
    _pairs.update(int4_gemv=int4_gemv, int4_digits=int4_digits_gemv, int4_linear=portable_int4.int4_linear,
                  int4_check=portable_int4.check_operands, fp8_gemv=fp8_gemv, fp8_fits=fits,
                  fp8_linear=portable_fp8.fp8_linear,
                  fp8_check=portable_fp8.check_operands)
    _fused_gemv, _MAX_ROWS = (fused_gemv if MAX_FUSED_N > 0 else None), MAX_ROWS
    _unfused.update(rms_norm=rms_norm, silu_and_mul=silu_and_mul, gelu_and_mul=gelu_and_mul)
    pdl.allow()  # Hopper and newer: the decode path's kernels launch dependent (pdl.pdl_launch checks the device)
    ops: dict[str, Callable] = {"linear": linear, "rms_norm_linear": rms_norm_linear, "linear_add": linear_add,
                                "mla_inputs": mla_inputs,  # contract 1.10
                                "linear_float32": linear_float32,  # contract 1.11
                                "int4_linear": int4_linear}
    if INT4_FUSIONS:  # contract 1.18
        ops.update(int4_rms_norm_linear=int4_rms_norm_linear, int4_linear_add=int4_linear_add)
    if torch.cuda.is_available() and not has_fp8_types():
        from chitu_core.kernels.triton.fp8_linear import fp8_linear_bytes
        from chitu_core.kernels.triton.moe_fp8 import fused_experts_fp8_bytes

        ops["fp8_linear"] = fp8_linear_bytes
        ops["fused_experts_fp8"] = fused_experts_fp8_bytes
    elif torch.cuda.is_available():  # e4m3 pairs convert to fp16 pairs in one instruction
        ops["fp8_linear"] = fp8_linear
    return ops
