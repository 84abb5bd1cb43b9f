"""A row-parallel linear at batch 1 with its all-reduce and the residual add in one kernel (contract 1.13,
``linear_add`` of the small-message all-reduce): out = residual + sum over ranks of x_r @ W_r^T (+ bias).

Each program multiplies its BLOCK_N output columns as the fused matrix-vector kernel does
(``chitu_core.kernels.triton.fused_gemv``: the first weight tile loaded before the dependent-launch
wait), rounds its partial sums to the dtype, pushes them into every rank's symmetric buffer (its own
slot there, over NVLink), and meets the same program of every peer on the flags of
``boundary_kernel._meet``; then it sums the slots in float32 in rank order (every rank computes the
same bits), rounds the sum to the dtype as an all-reduce would, adds the bias and the residual and
stores its columns. So the sum costs no launch of its own and overlaps the other programs' products;
the layer boundary's RMSNorm moves into the next product's prologue (``rms_norm_linear``).

Program p owns region p of the buffers whatever the call's grid, and counts its own calls (epochs): a
peer's program p has met this call's program p only after finishing its previous call, so the two
halves (alternating with the epoch's parity) never hold data a peer may still read. Every program of a
grid must be resident at once on both ranks (one waits for its peer's), so the grid is at most
``MAX_PROGRAMS`` and no more than the device's compute units.
"""

import torch
import triton
import triton.language as tl

from chitu_core.kernels.triton.common import num_compute_units
from chitu_core.kernels.triton.dense_gemv import _tile, row_sums
from chitu_core.kernels.triton.fused_gemv import fused_gemv_config
from chitu_core.kernels.triton.pdl import gdc_enter, pdl_launch
from chitu_nvidia.boundary_kernel import Meeting, _meet

MAX_PROGRAMS = 256
MAX_BLOCK_N = 64  # a program's region in the buffers


@triton.jit
def _gemv_all_reduce_kernel(out, x, w, bias, res, buf_ptrs, flag_ptrs, epoch_ptr, rank, N, K, slot, stride_xk,
                            stride_wn, stride_wk, stride_b, WORLD: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, REGION: tl.constexpr, K_MAJOR: tl.constexpr,
                            HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    rn = pid * BLOCK_N + cols
    n_ok = rn < N
    kk = tl.arange(0, BLOCK_K)
    nxt = _tile(w, kk, rn, K, n_ok, stride_wn, stride_wk, K_MAJOR)  # weights: no wait
    gdc_enter(PDL)
    dtype = out.dtype.element_ty
    epoch = tl.load(epoch_ptr + pid) + 1
    part = row_sums(nxt, w, x, kk, rn, n_ok, 0, K, stride_xk, stride_wn, stride_wk, BLOCK_N, BLOCK_K, K_MAJOR).to(dtype)
    region = (epoch & 1).to(tl.int64) * WORLD * slot + pid * REGION + cols  # this call's half, this program's
    for r in tl.static_range(WORLD):
        peer = tl.load(buf_ptrs + r).to(tl.pointer_type(dtype))
        tl.store(peer + region + rank * slot, part, mask=n_ok)
    _meet(flag_ptrs, pid, rank, epoch, WORLD)
    own = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype))
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r in tl.static_range(WORLD):
        total += tl.load(own + region + r * slot, mask=n_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = total.to(dtype).to(tl.float32)  # the all-reduce's rounding
    if HAS_BIAS:
        y += tl.load(bias + rn * stride_b, mask=n_ok, other=0.0).to(tl.float32)
    y += tl.load(res + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out + rn, y.to(dtype), mask=n_ok)
    tl.store(epoch_ptr + pid, epoch)


class GemvAllReduce:
    """``linear_add`` of the small-message all-reduce: the kernel over buffers made once per dtype (two
    halves of WORLD slots of MAX_PROGRAMS regions each), one flag array and this rank's epochs."""

    def __init__(self, group_name: str, device: torch.device, dtypes):
        import torch.distributed._symmetric_memory as symm_mem

        self.units = num_compute_units(device)
        self.programs = min(MAX_PROGRAMS, self.units)
        self.meeting = Meeting(group_name, device, MAX_PROGRAMS, "the one-pass row-parallel linear")
        self.rank, self.world = self.meeting.rank, self.meeting.world
        self.slot, self.buffers = MAX_PROGRAMS * MAX_BLOCK_N, {}
        for dtype in dtypes:
            buf = symm_mem.empty(2 * self.world * self.slot, dtype=dtype, device=device)
            ptrs = symm_mem.rendezvous(buf, group_name).buffer_ptrs
            self.buffers[dtype] = (buf, torch.tensor(ptrs, dtype=torch.int64, device=device))
        self.meeting.ready(device)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor) -> torch.Tensor | None:
        """residual + the ranks' sum of x @ weight.T (+ bias), or None where it does not take the shape:
        more than one row, x and weight of different dtypes, or more columns than its programs cover."""
        k, n = x.shape[-1], weight.shape[0]
        if (x.numel() != k or residual.numel() != n or x.dtype != weight.dtype or residual.dtype != x.dtype
                or x.dtype not in self.buffers or weight.shape[1] != k):
            return None
        k_major = weight.stride(1) == 1
        cfg = fused_gemv_config(n, k, k_major, 1, False, self.units)
        grid = triton.cdiv(n, cfg.block_n)
        if cfg.block_n > MAX_BLOCK_N or grid > self.programs:
            return None
        row = x.reshape(k)
        out = torch.empty_like(residual)
        _, buf_ptrs = self.buffers[x.dtype]
        b = bias if bias is not None else out
        use_pdl = pdl_launch(x.device)
        _gemv_all_reduce_kernel[(grid,)](
            out, row, weight, b, residual, buf_ptrs, self.meeting.flag_ptrs, self.meeting.epochs, self.rank, n, k,
            self.slot,
            row.stride(0), weight.stride(0), weight.stride(1), b.stride(0) if bias is not None else 0,
            WORLD=self.world, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, REGION=MAX_BLOCK_N, K_MAJOR=k_major,
            HAS_BIAS=bias is not None, PDL=use_pdl, num_warps=cfg.num_warps, num_stages=1,
            **({"launch_pdl": True} if use_pdl else {}))
        return out
