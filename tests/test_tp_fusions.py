"""Contract 1.13: the decode-step fusions under tensor parallelism. Where the backend's small-message
all-reduce offers ``linear_add`` (a row-parallel linear with its all-reduce and the residual add), the
layers keep the residual stream whole under TP too: the norms in the QKV and gate/up products, the
ranks' sums in o_proj's and down's. On two gloo ranks with a stand-in that composes ``linear_add``,
dense and MoE models (whose MLP leaves its sum to the next layer) give one process's fp32 greedy tokens
and logprobs, with prefills unfused and decode steps fused (``fusion_max_tokens``); and the
Communicator's composition when the backend has no one-pass path."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from chitu_cpu.backend import CpuBackend

from chitu_core import LLM, SamplingParams
from chitu_core.distributed import Communicator
from chitu_core.ops import reference
from builders import build_model
from test_moe_models import build_moe

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 53)), [300, 200, 100], [7] * 17]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
MODELS = ("llama", "moe")
FUSED_TOKENS = 4  # decode steps of the four prompts take the fusions, their prefills do not


class ComposedLinearAdd:
    """A small-message all-reduce over gloo that offers ``linear_add``, composed: the products of this rank
    summed by the process group; counts its calls."""

    max_bytes, dtypes = 1 << 20, frozenset({torch.float32})

    def __init__(self, comm):
        self.group, self.calls = comm.group, 0

    def __call__(self, x):
        dist.all_reduce(x, group=self.group)

    def linear_add(self, x, weight, bias, residual):
        self.calls += 1
        out = F.linear(x, weight)
        dist.all_reduce(out, group=self.group)
        return residual + (out if bias is None else out + bias)


def run(path, pp: int = 1) -> tuple:
    llm = LLM(str(path), device="cpu", dtype="float32", load_progress=False, num_threads=1, max_num_batched_tokens=32,
              pipeline_parallel_size=pp)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[sorted(lp.items()) for lp in o.outputs[0].logprobs] for o in outs]
    model = llm.engine.model.model
    layers = [model.layers[i] for i in model.local]
    per_step = sum(1 + bool(getattr(layer.mlp, "fuses", bool)()) for layer in layers)  # o_proj; down where fused
    return (tokens, logprobs, all(layer.fusions for layer in layers), getattr(llm.engine.comm.fast, "calls", 0),
            per_step)


def _rank(rank: int, world: int, pp: int, port: int, root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    CpuBackend.fast_all_reduce = lambda self, comm: ComposedLinearAdd(comm)
    CpuBackend.fusion_max_tokens = lambda self: FUSED_TOKENS
    try:
        queue.put((rank, {name: run(os.path.join(root, name), pp) for name in (MODELS if pp == 1 else ("llama",))}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpfused")
    build_model(root / "llama", "llama", num_hidden_layers=3)
    build_moe(root / "moe", "qwen3_moe")
    return root


@pytest.fixture(scope="module")
def one(models):
    CpuBackend.fusion_max_tokens, saved = (lambda self: FUSED_TOKENS), CpuBackend.fusion_max_tokens
    try:
        return {name: run(models / name) for name in MODELS}
    finally:
        CpuBackend.fusion_max_tokens = saved


@pytest.mark.parametrize("world,pp", [(2, 1), (4, 2)], ids=["tp2", "tp2xpp2"])
def test_fused_tensor_parallel_decode_matches_one_process(models, one, world, pp):
    """Two tensor-parallel ranks; and two pipeline stages of two (the first stage hands the second a whole
    stream: its last layer summed it in its products)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(world, pp, port, str(models), queue), nprocs=world, join=True)
    ranks = dict(queue.get() for _ in range(world))
    for name in ranks[0]:
        tokens, logprobs, fused, _, _ = one[name]
        assert fused, name  # one process: the CPU backend serves the fusions
        for rank, got in ranks.items():
            got_tokens, got_logprobs, got_fused, calls, per_step = got[name]
            assert got_fused, f"{name}: rank {rank} did not take the fusions under TP"
            # Every decode step of at most FUSED_TOKENS tokens (at least the last 9) sums in its products.
            assert calls >= 9 * per_step and calls % per_step == 0, (name, calls, per_step)
            assert got_tokens == tokens, f"{name}: rank {rank} tokens"
            for ours, ref in zip(got_logprobs, logprobs):
                for a, b in zip(ours, ref):
                    assert [t for t, _ in a] == [t for t, _ in b]
                    torch.testing.assert_close([v for _, v in a], [v for _, v in b], rtol=0, atol=1e-4)


class NoLinearAdd:
    max_bytes, dtypes = 1024, frozenset({torch.float32})

    def __call__(self, x):
        x.mul_(2)


class DeclinesLinearAdd(NoLinearAdd):
    def __init__(self):
        self.seen = []

    def linear_add(self, x, weight, bias, residual):
        self.seen.append(tuple(x.shape))
        return None


@pytest.mark.parametrize("kind,offers", [(None, False), (NoLinearAdd, False), (DeclinesLinearAdd, True)])
@pytest.mark.parametrize("rank", [0, 1])
def test_linear_all_reduce_add_composes_where_the_backend_has_no_one_pass_path(kind, offers, rank):
    """The composition: this rank's product (the bias on rank 0 only), the all-reduce (here: doubled), the add."""
    comm = Communicator(group=None, world_size=2, rank=rank)
    comm.fast = fast = kind and kind()
    if fast is None:
        comm.all_reduce = lambda t: t.mul_(2)
    assert comm.fuses_linear_all_reduce() is offers
    x, w, b, res = torch.randn(1, 6), torch.randn(5, 6), torch.randn(5), torch.randn(1, 5)
    kept = [t.clone() for t in (x, w, b, res)]
    got = comm.linear_all_reduce_add(x, w, b, res, reference)
    want = res + 2 * (x @ w.T + (b if rank == 0 else 0))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert all(torch.equal(a, k) for a, k in zip((x, w, b, res), kept))
    if offers:
        assert fast.seen == [(1, 6)]
    assert not Communicator.single().fuses_linear_all_reduce()
