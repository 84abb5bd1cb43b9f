"""Device graphs for the engine's decode steps (the Backend contract's ``GraphRunner``) on a device that
PyTorch exposes as ``torch.cuda``: CUDA graphs, and HIP graphs under ROCm builds (the same API)."""

from collections.abc import Callable

import torch

from chitu_core.backend import GraphRunner


class DeviceGraphRunner(GraphRunner):
    """Each capture warms ``fn`` up on a side stream, then records it into a ``torch.cuda.CUDAGraph``.
    All captures share one memory pool (the engine captures the largest batch first and replays
    one graph at a time). Nothing touches the device before the first capture."""

    def __init__(self):
        self.pool = None
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # compiles the Triton kernels, lets the BLAS library pick its workspaces
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
