"""What crosses between pipeline stages, and how decode batches are cut into groups that keep every
stage busy.

Stage s > 0 takes its input from stage s-1: the hidden states and the residual stream stacked as one
[2, T, H] tensor (both, so that the stage's first fused add+norm computes exactly what one process
would). Tensor-parallel rank i of stage s talks to rank i of stage s+1 through ``Parallel.pp``.
A send is asynchronous: the stage goes on with its next work while the last output travels; the
link keeps each sent tensor until its transfer is done.

Groups: with P stages, a decode batch of at least ``MICRO_BATCH_MIN_SEQS * P`` sequences is split
into P groups of rows, and the engine keeps one step of each group in flight (vLLM calls them
virtual engines): while stage s+1 runs group g's step, stage s runs group g+1's, and each group's
next step starts on stage 0 as soon as the last stage has sampled its tokens. In steady state no
stage waits for another, and each reads its weights once per group step. Every row's computation
is the same as in one batch; only the batch the kernels see is smaller.
"""

import torch
import torch.distributed as dist

from chitu_core.distributed.parallel import Parallel

MICRO_BATCH_MIN_SEQS = 8  # per stage: below this a slice is too small to keep a device busy


class StageLink:
    """This rank's ends of the pipeline: receive from the previous stage, send to the next."""

    def __init__(self, parallel: Parallel, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.parallel, self.hidden_size, self.dtype, self.device = parallel, hidden_size, dtype, device
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # (work, the tensor it sends)

    @property
    def first(self) -> bool:
        return self.parallel.is_first_stage

    @property
    def last(self) -> bool:
        return self.parallel.is_last_stage

    def receive(self, num_tokens: int) -> torch.Tensor:
        """[2, T, H]: hidden states and residual of ``num_tokens`` tokens from the previous stage."""
        buf = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        return self.parallel.pp.recv(buf, self.parallel.pp_rank - 1)

    def send(self, stacked: torch.Tensor) -> None:
        """Start sending [2, T, H] to the next stage. ``stacked`` must not change afterwards: pass a
        tensor nothing else writes (a graph's static output is cloned first); the link holds it
        until its transfer is done."""
        pp = self.parallel.pp
        stacked = stacked.contiguous()
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]
        work = dist.isend(stacked, dst=pp.ranks[pp.rank + 1], group=pp.group)
        self._in_flight.append((work, stacked))


def micro_batches(num_seqs: int, pp_size: int, decode: bool) -> list[range]:
    """The row ranges of the groups a batch runs as, in order: ``pp_size`` near-equal slices (earlier
    ones one row longer) for a decode batch with ``MICRO_BATCH_MIN_SEQS`` sequences per stage or
    more, else one."""
    if pp_size == 1 or not decode or num_seqs < MICRO_BATCH_MIN_SEQS * pp_size:
        return [range(num_seqs)]
    base, extra = divmod(num_seqs, pp_size)
    bounds = [0]
    for i in range(pp_size):
        bounds.append(bounds[-1] + base + (i < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
