"""Expert parallelism and CPU experts, on CPU in float32.

Expert parallelism (gloo): two tensor-parallel ranks that each hold half of the routed experts whole
give the same greedy tokens as one process (Qwen2-MoE with a gated shared expert, Mixtral, DeepSeek-V2
with group-limited routing, DeepSeek-V3 with grouped sigmoid routing, and a DeepSeek-V2 whose experts
are stored in FP8), loading from safetensors checkpoints and with dummy weights; each rank holds
exactly its experts. CPU experts (``cpu_experts``): the named layers' routed experts are host tensors
of their own, run by the CPU backend's op table on the worker thread, and the tokens are those of the
model without them, for "all", a partial list, FP8 experts, and under expert parallelism. One spawned
world of two ranks serves every several-rank check.
"""

import os
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chitu_core import LLM, SamplingParams
from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.cpu_experts import CPUExperts, parse_cpu_experts
from chitu_core.layers.moe import FusedMoE
from chitu_core.ops.table import resolve_ops
from test_communicator import free_port
from test_deepseek import build_deepseek
from test_moe_models import build_moe
from test_quant_moe import save_fp8_experts_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], [7] * 17, list(range(10, 43))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MODELS = {"qwen2_moe": 8, "mixtral": 4, "v2": 8, "v3": 8, "fp8": 8}  # name: routed experts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    build_moe(root / "qwen2_moe", "qwen2_moe", seed=3)
    build_moe(root / "mixtral", "mixtral", seed=4)
    build_deepseek(root / "v2", "v2", seed=6)
    build_deepseek(root / "v3", "v3", seed=5)
    (root / "fp8").mkdir()
    save_fp8_experts_checkpoint(root / "fp8")
    return root


def load(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", load_progress=False, num_threads=1, **kwargs)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def moe_layers(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]


def run(path, **kwargs) -> tuple[list, list]:
    llm = load(path, **kwargs)
    moe = moe_layers(llm)[0]
    return greedy(llm), [moe.first_expert, moe.local_experts, tuple(moe.w13.shape)]


def run_cpu_experts(path, spec: str, **kwargs) -> dict:
    """Greedy tokens with ``cpu_experts=spec``; which MoE layers hold host experts; the threads the CPU
    backend's expert ops ran on (a spy on the host op table, which is not the device's)."""
    llm = load(path, cpu_experts=spec, **kwargs)
    layers = moe_layers(llm)
    hosts = {id(m.host): m.host for m in layers if m.host is not None}
    threads: set[str] = set()

    def spy(op):
        def call(*args, **kwargs):
            threads.add(threading.current_thread().name)
            return op(*args, **kwargs)
        return call

    for host in hosts.values():
        assert host.ops is not llm.engine.ops
        for name in ("fused_experts", "fused_experts_fp8"):
            setattr(host.ops, name, spy(getattr(host.ops, name)))
    tokens = greedy(llm)
    return {"tokens": tokens, "on_host": [m.host is not None for m in layers], "threads": threads,
            "devices": {str(p.device) for m in layers if m.host for p in m.parameters()},
            "graphs": llm.engine.graph_runner}


def _rank(rank: int, port: int, root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    try:
        got = {name: run(os.path.join(root, name), enable_expert_parallel=True) for name in MODELS}
        got["dummy"] = run(os.path.join(root, "qwen2_moe"), enable_expert_parallel=True, load_format="dummy")
        cpu = run_cpu_experts(os.path.join(root, "qwen2_moe"), "all", enable_expert_parallel=True)
        got["cpu_experts"] = cpu["tokens"], cpu["on_host"], cpu["threads"]
        queue.put((rank, got))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def one(models):
    got = {name: run(models / name) for name in MODELS}
    got["dummy"] = run(models / "qwen2_moe", load_format="dummy")
    return got


@pytest.fixture(scope="module")
def ranks(models):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(free_port(), str(models), queue), nprocs=2, join=True)
    return dict(queue.get() for _ in range(2))


def test_two_expert_parallel_ranks_match_one(one, ranks):
    # Dummy weights are drawn per rank and shape, so they differ from one process's: the ranks agree.
    assert ranks[0]["dummy"][0] == ranks[1]["dummy"][0]
    for name in (*MODELS, "dummy"):
        tokens, (first, local, shape) = one[name]
        assert (first, local) == (0, shape[0])
        for rank, got in ranks.items():
            ep_tokens, (ep_first, ep_local, ep_shape) = got[name]
            assert name == "dummy" or ep_tokens == tokens, f"{name}: rank {rank}"
            experts = MODELS.get(name, 8)
            assert (ep_first, ep_local) == (rank * experts // 2, experts // 2), name
            assert ep_shape == (experts // 2, *shape[1:]), name  # whole experts: the full intermediate size


def test_cpu_experts_under_expert_parallelism_match_one_process(one, ranks):
    for rank, got in ranks.items():
        tokens, on_host, threads = got["cpu_experts"]
        assert tokens == one["qwen2_moe"][0], f"rank {rank}"
        assert on_host == [True, True] and threads == {"MainThread"}, rank  # the engine's thread


@pytest.mark.parametrize("name, spec, on_host", [
    ("qwen2_moe", "all", [True, True]),  # layers 0 and 2 are sparse, 1 is dense
    ("qwen2_moe", "0", [True, False]),
    ("v2", "0-1", [True]),  # layer 0 is dense: naming it holds nothing
    ("fp8", "1", [True]),  # FP8 experts stay FP8 in host memory: the CPU backend's fused_experts_fp8
])
def test_cpu_experts_give_the_tokens_of_the_device_and_run_on_the_host(models, one, name, spec, on_host):
    got = run_cpu_experts(models / name, spec)
    assert got["tokens"] == one[name][0]
    assert got["on_host"] == on_host
    assert got["devices"] == {"cpu"} and got["graphs"] is None
    assert got["threads"] == {threading.current_thread().name}  # the engine's thread, through the host op table


def test_cpu_experts_hold_fp8_experts_as_the_checkpoint_stores_them(models):
    llm = load(models / "fp8", cpu_experts="all")
    experts = moe_layers(llm)[0]
    assert experts.host is not None and experts.w13.dtype == torch.float8_e4m3fn


def test_cpu_experts_spec():
    assert parse_cpu_experts("all", 4) == frozenset(range(4))
    assert parse_cpu_experts(" ALL ", 2) == frozenset({0, 1})
    assert parse_cpu_experts("0-2,5", 8) == frozenset({0, 1, 2, 5})
    assert parse_cpu_experts(" 3 , 3-3,1", 8) == frozenset({1, 3})
    assert parse_cpu_experts(None, 8) == parse_cpu_experts("", 8) == frozenset()
    for spec, message in [("8", "layer 8 is past the model's last layer (8 layers: 0-7)"),
                          ("0-9", "layer 9 is past"), ("3-1", "runs backwards"), ("a", "'a' is not a layer index"),
                          ("1-", "'1-' is not"), ("1,,2", "'' is not"), ("1-2-3", "'1-2-3' is not"),
                          ("-1", "'-1' is not")]:
        with pytest.raises(ChituError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_cpu_experts(spec, 8)


def test_a_bad_spec_fails_the_engine_and_layers_need_their_index(models):
    with pytest.raises(ChituError, match="layer 7 is past the model's last layer"):
        load(models / "qwen2_moe", cpu_experts="7")
    ops = resolve_ops("cpu", {})
    comm = SimpleNamespace(rank=0, world_size=1, all_reduce=lambda x: x)
    ctx = BuildContext(ops, None, comm, torch.float32, torch.device("cpu"), cpu_experts=CPUExperts(frozenset({0}), ops))
    with pytest.raises(ModelLoadError, match="without layer_idx"):
        FusedMoE(4, 16, 8, ctx, 2)
    assert FusedMoE(4, 16, 8, ctx, 2, layer_idx=0).host is ctx.cpu_experts
    assert FusedMoE(4, 16, 8, ctx, 2, layer_idx=1).host is None
