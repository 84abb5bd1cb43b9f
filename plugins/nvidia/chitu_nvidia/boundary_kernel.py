"""The tensor-parallel layer boundary in one kernel (contract 1.5): all-reduce + residual add + RMSNorm.

Each rank's program p pushes its rows of x into every rank's symmetric buffer (its own slot there,
over NVLink), then raises a flag in every rank's flag array and waits for every rank's flag in its
own; it then sums the slots in float32 in rank order (every rank computes the same bits), rounds the
sum to the dtype as an all-reduce would, adds the residual and normalises, reading only local memory.

No flag is ever reset and no second barrier is needed: every rank launches the same PROGRAMS programs
for every call, program p counts its calls in a local epoch (the same count on every rank), raises its
flags to epoch + 1 (a release store, system scope) and waits until each peer's flag has reached it
(acquire loads). Buffers alternate with the epoch's parity, so a rank writing call k + 1's rows never
touches the half a slower peer may still be reading for call k; and it cannot get two calls ahead,
since call k + 1's wait needs every peer to have finished call k. Replays of a captured graph need
nothing from the host. No NVLink multicast is used.
"""

import os

import torch
import triton
import triton.language as tl

# Every call launches these (program p takes rows p, p + PROGRAMS, ...), so epochs stay equal; the same on
# every rank. 64: on two H100s (allreduce_bench.py) 32 rows took 7.9 us and 64 rows 8.4 us against 8.1 and
# 10.6 with 32 programs, and 9.2 and 10.2 with 128; one row alike (6.7-7.0). CHITU_BOUNDARY_PROGRAMS sets it.
PROGRAMS = int(os.environ.get("CHITU_BOUNDARY_PROGRAMS", "64"))
MAX_HIDDEN = 16384  # the widest row one program normalises in registers
MAX_WORLD = 8


@triton.jit
def _thread_index():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _meet(flag_ptrs, pid, rank, epoch, WORLD: tl.constexpr):
    """Program ``pid`` of every rank raises its flags to ``epoch`` once its threads' writes are done,
    and leaves when every peer's flag has reached ``epoch``; the peers' writes are then visible to
    every thread of this program."""
    tl.debug_barrier()
    peers = tl.arange(0, WORLD)
    send = tl.load(flag_ptrs + peers) + 4 * (pid * WORLD + rank)  # my flag in each rank's array
    wait = tl.load(flag_ptrs + rank) + 4 * (pid * WORLD + peers)  # each rank's flag in mine
    value = tl.zeros([WORLD], dtype=tl.int32) + epoch
    if _thread_index() < WORLD:  # thread r holds element r: one thread per peer
        tl.inline_asm_elementwise(
            """
            {
            .reg .s32 %seen;
            .reg .pred %behind;
            st.release.sys.global.u32 [$1], $3;
            wait_flag:
                ld.acquire.sys.global.u32 %seen, [$2];
                sub.s32 %seen, %seen, $3;
                setp.lt.s32 %behind, %seen, 0;
                @%behind bra wait_flag;
            mov.u32 $0, %seen;
            }
            """,
            "=r,l,l,r", [send, wait, value], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    for r in tl.static_range(WORLD):  # every thread acquires what the peers released
        tl.inline_asm_elementwise("ld.acquire.sys.global.u32 $0, [$1];", "=r,l",
                                  [tl.load(flag_ptrs + rank) + 4 * (pid * WORLD + r)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _boundary_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buf_ptrs, flag_ptrs, epoch_ptr, rank, rows, h,
                     slot, eps, WORLD: tl.constexpr, BLOCK_H: tl.constexpr, PROGRAMS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    inside = cols < h
    dtype = x_ptr.dtype.element_ty
    epoch = tl.load(epoch_ptr + pid) + 1
    half = (epoch & 1).to(tl.int64) * WORLD * slot
    for row in range(pid, rows, PROGRAMS):
        v = tl.load(x_ptr + row * h + cols, mask=inside)
        for r in tl.static_range(WORLD):
            peer = tl.load(buf_ptrs + r).to(tl.pointer_type(dtype))
            tl.store(peer + half + rank * slot + row * h + cols, v, mask=inside)
    _meet(flag_ptrs, pid, rank, epoch, WORLD)
    own = tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype)) + half
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    for row in range(pid, rows, PROGRAMS):
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            total += tl.load(own + r * slot + row * h + cols, mask=inside, other=0.0, cache_modifier=".cg").to(tl.float32)
        residual = tl.load(res_ptr + row * h + cols, mask=inside, other=0.0).to(tl.float32)
        s = total.to(dtype).to(tl.float32) + residual  # the all-reduce's rounding; the add's sum in float32
        tl.store(res_out_ptr + row * h + cols, s.to(dtype), mask=inside)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / h + eps)  # as fused_add_rms_norm: the float32 sum normed,
        tl.store(out_ptr + row * h + cols, (s * rstd * w).to(dtype), mask=inside)  # times the weight, rounded once
    tl.store(epoch_ptr + pid, epoch)


class Meeting:
    """The flags ``_meet`` waits on, for kernels of up to ``programs`` programs over one group's ranks: a flag
    array every rank maps (made and zeroed collectively), the peers' addresses, and this rank's epochs."""

    def __init__(self, group_name: str, device: torch.device, programs: int, what: str):
        import torch.distributed._symmetric_memory as symm_mem

        self.flags = symm_mem.empty(programs * MAX_WORLD, dtype=torch.int32, device=device)
        self.flags.zero_()
        self.handle = symm_mem.rendezvous(self.flags, group_name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        if self.world > MAX_WORLD:
            raise ValueError(f"{what} takes up to {MAX_WORLD} ranks, not {self.world}")
        self.flag_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(programs, dtype=torch.int32, device=device)

    def ready(self, device: torch.device) -> None:
        """Wait until every rank's flags are zero, before any kernel raises one (a collective)."""
        torch.cuda.synchronize(device)
        self.handle.barrier()


class LayerBoundary:
    """``add_rms_norm`` of the small-message all-reduce: the kernel over buffers made once per dtype
    (two halves of WORLD slots of ``max_bytes`` each), one flag array and this rank's epochs."""

    def __init__(self, group_name: str, device: torch.device, dtypes, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes, self.buffers = max_bytes, {}
        self.meeting = Meeting(group_name, device, PROGRAMS, "the one-pass layer boundary")
        self.rank, self.world = self.meeting.rank, self.meeting.world
        for dtype in dtypes:
            slot = max_bytes // dtype.itemsize
            buf = symm_mem.empty(2 * self.world * slot, dtype=dtype, device=device)
            ptrs = symm_mem.rendezvous(buf, group_name).buffer_ptrs
            self.buffers[dtype] = (buf, slot, torch.tensor(ptrs, dtype=torch.int64, device=device))
        self.meeting.ready(device)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        h = x.shape[-1]
        rows = x.numel() // h if h else 0
        if (h > MAX_HIDDEN or not residual.is_contiguous() or residual.dtype != x.dtype or rows == 0
                or x.numel() * x.element_size() > self.max_bytes):
            return None
        out, new_residual = torch.empty_like(x), torch.empty_like(residual)
        _, slot, buf_ptrs = self.buffers[x.dtype]
        block = triton.next_power_of_2(h)
        _boundary_kernel[(PROGRAMS,)](
            x, residual, weight, out, new_residual, buf_ptrs, self.meeting.flag_ptrs, self.meeting.epochs, self.rank,
            rows, h, slot, eps, WORLD=self.world, BLOCK_H=block, PROGRAMS=PROGRAMS, num_warps=8 if block >= 4096 else 4)
        return out, new_residual
