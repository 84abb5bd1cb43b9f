"""chitu-ascend's op mapping against the float64 reference, on the stand-in torch_npu (tests/ascend_standin).

What this proves: every op the plugin maps calls its torch_npu operator with the argument order, shapes,
dtypes and KV-cache layout that operator's documentation gives (the stand-in implements those pages and
refuses what they exclude), and the result is the contract's, by the conformance suite's own cases and
thresholds. A mapping with two arguments swapped fails. What it does not prove: anything about a real NPU
(numerics of its kernels, speed, graphs, HCCL); nothing here has run on one.
"""

import sys
from pathlib import Path

import pytest
import torch

from chitu_core.conformance.case import Target
from chitu_core.conformance.runner import Session, build_cases
from chitu_core.conformance.thresholds import ThresholdBook
from chitu_core.ops.checks import checked_ops
from chitu_core.ops.table import resolve_ops

REPO = Path(__file__).resolve().parents[1]
PATHS = [str(REPO / "tests" / "ascend_standin"), str(REPO / "plugins" / "ascend")]
torch_npu = AscendPagedAttention = AscendBackend = None  # set by the fixture below


@pytest.fixture(scope="module", autouse=True)
def standin():
    """The stand-in (and the plugin) importable for this module's tests only: pytest imports every test
    module before running any, and nothing else may find a torch_npu (transformers, for one, would take it
    for Huawei's and import its NPU attention)."""
    global torch_npu, AscendPagedAttention, AscendBackend
    sys.path[:0] = PATHS
    try:
        import torch_npu as module  # the stand-in
        from chitu_ascend.attention import AscendPagedAttention as attention
        from chitu_ascend.backend import AscendBackend as backend

        torch_npu, AscendPagedAttention, AscendBackend = module, attention, backend
        yield
    finally:
        for path in PATHS:
            sys.path.remove(path)
        for name in [m for m in sys.modules if m.split(".")[0] in ("torch_npu", "chitu_ascend")]:
            del sys.modules[name]
        if hasattr(torch, "npu"):
            del torch.npu


DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPERATORS = {  # op row -> the torch_npu operators its mapping calls
    "rms_norm": ("npu_rms_norm",), "fused_add_rms_norm": ("npu_add_rms_norm",),
    "rotary_embedding": ("npu_rotary_mul",), "silu_and_mul": ("npu_swiglu",),
    "moe_route": ("npu_moe_gating_top_k_softmax",), "fused_experts": ("npu_grouped_matmul", "npu_swiglu"),
    "int8_linear": ("npu_quant_matmul", "npu_weight_quant_batchmatmul"),
    "attention/npu-fia": ("npu_scatter_nd_update_", "npu_fused_infer_attention_score"),
}


def run(ops: str, dtypes=DTYPES, per_row: int = 6):
    """The first ``per_row`` cases of each (row, dtype) matching ``ops``, through the plugin on the stand-in."""
    backend = AscendBackend()
    target = Target(backend, checked_ops(resolve_ops("ascend", backend.native_ops())), torch.device("cpu"),
                    ThresholdBook(backend.tolerances()))
    cases = [c for c in build_cases(target, dtypes, ops) if "long" not in c.label]
    kept = [c for i, c in enumerate(cases)
            if sum((d.row, d.dtype) == (c.row, c.dtype) for d in cases[:i]) < per_row]
    return Session(target, kept).run_all()


def spy(monkeypatch, names) -> dict[str, int]:
    """Count the calls of each stand-in operator in ``names``."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(torch_npu, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch_npu, name, counted)
    return calls


def test_the_stand_in_is_what_the_backend_sees():
    assert torch_npu.IS_STANDIN and torch.npu is torch_npu.npu
    backend = AscendBackend()
    assert backend.is_available().available and "stand-in" in backend.device_name()
    assert backend.process_group_backend() == "hccl" and backend.device_type == "npu"


@pytest.mark.parametrize("row", OPERATORS)
def test_each_mapped_op_matches_the_reference_through_its_operator(monkeypatch, row):
    calls = spy(monkeypatch, OPERATORS[row])
    dtypes = (torch.bfloat16, torch.float16) if row.startswith("attention") else DTYPES
    results = [r for r in run(row, dtypes) if r.row == row]
    assert results and all(r.status == "pass" and r.source == "native" for r in results), \
        [(r.dtype, r.label, r.status, r.detail) for r in results if r.status != "pass"]
    assert all(calls.values()), f"{row} did not reach {[n for n, c in calls.items() if not c]}"


def test_attention_declines_what_the_operator_lacks():
    results = run("attention*", (torch.float32, torch.bfloat16), per_row=1)
    declined = {(r.row, r.dtype) for r in results if r.status == "unsupported"}
    assert ("attention/npu-fia", "float32") in declined  # the fused attention takes 16-bit queries only
    assert {r.row for r in results if r.status == "unsupported" and r.dtype == "bfloat16"} == {
        "attention/npu-fia/fp8-kv", "attention/npu-fia/softcap", "attention/npu-fia/window",
        "attention/npu-fia/softcap+window", "attention/npu-fia/rotary", "attention/npu-fia/rotary+qk_norm",
        "attention/npu-fia/graph-prefill"}  # the fused operator takes its sequence lengths as host lists


def swapped(real, first: str, second: str):
    """``real`` called with its keyword or positional arguments ``first`` and ``second`` exchanged."""
    import inspect

    params = list(inspect.signature(real).parameters)

    def wrong(*args, **kwargs):
        bound = dict(zip(params, args), **kwargs)
        bound[first], bound[second] = bound[second], bound[first]
        return real(**bound)

    return wrong


WRONG_LAYOUTS = {  # a mapping mistake -> (what to patch, the row whose cases must then fail[, their labels' mark])
    "rotary cos and sin swapped": (lambda mp: mp.setattr(torch_npu, "npu_rotary_mul",
                                                         swapped(torch_npu.npu_rotary_mul, "r1", "r2")),
                                   "rotary_embedding"),
    "attention reads the value cache as keys": (
        lambda mp: mp.setattr(torch_npu, "npu_fused_infer_attention_score",
                              swapped(torch_npu.npu_fused_infer_attention_score, "key", "value")),
        "attention/npu-fia"),
    "cache write stores keys in the value half": (
        lambda mp: mp.setattr(AscendPagedAttention, "write_kv",
                              swapped(AscendPagedAttention.write_kv, "k", "v")),
        "attention/npu-fia"),
    "int8 matmul scales swapped (per channel as per token)": (
        lambda mp: mp.setattr(torch_npu, "npu_quant_matmul",
                              swapped(torch_npu.npu_quant_matmul, "scale", "pertoken_scale")),
        "int8_linear", "W8A8"),  # the W8A16 cases take npu_weight_quant_batchmatmul
}


@pytest.mark.parametrize("mistake", WRONG_LAYOUTS)
def test_a_wrong_argument_order_in_the_mapping_fails(monkeypatch, mistake):
    patch, row, *mark = WRONG_LAYOUTS[mistake]
    patch(monkeypatch)
    results = [r for r in run(row, (torch.bfloat16,), per_row=4) if r.row == row and (mark or [""])[0] in r.label]
    assert results and all(r.status == "fail" for r in results), [(r.label, r.status) for r in results]
