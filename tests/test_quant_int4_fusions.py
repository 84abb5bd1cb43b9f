"""Contract 1.18: the decode-step fusions over 4-bit weights, as the layers take them (the ops themselves:
conformance, and tests/test_nvidia_pairs_gemv.py for the NVIDIA kernel)."""

import inspect
from types import SimpleNamespace

import torch

from chitu_core import LLM, SamplingParams
from chitu_core.layers.context import BuildContext
from chitu_core.layers.linear import ColumnParallelLinear, RowParallelLinear
from chitu_core.ops import reference
from chitu_core.ops.table import resolve_ops
from chitu_core.quantization.gptq import GPTQMethod
from chitu_core.quantization.select import QuantSpec
from test_models import batched_last_logits
from test_quant_int4 import E2E, _int4_checkpoint


def test_int4_layers_take_the_fusions_a_backend_serves(tmp_path, monkeypatch):
    """Contract 1.18: where the backend serves ``int4_rms_norm_linear`` and ``int4_linear_add`` itself, the
    AWQ layers take them (norm in the QKV and gate/up products with the MLP's activation, adds in o_proj's
    and down's), with the same logits and greedy tokens as the unfused path; GPTQ with act-order (x
    permuted first) keeps the unfused path."""
    from chitu_cpu.backend import CpuBackend

    calls = []

    def spy(name):  # the reference, recording each call's op and activation
        op = getattr(reference, name)

        def run(*args, **kwargs):
            calls.append((name, inspect.signature(op).bind(*args, **kwargs).arguments.get("activation")))
            return op(*args, **kwargs)
        return run

    fused = {name: spy(name) for name in ("int4_rms_norm_linear", "int4_linear_add")}
    native = CpuBackend.native_ops
    hf = _int4_checkpoint(*E2E[0], tmp_path, monkeypatch)
    assert hf.config.hidden_act == "silu"
    prompts = [[1, 2, 3, 4, 5], list(range(10, 43))]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(tmp_path, device="cpu", dtype="float32", load_progress=False)
    unfused_logits = batched_last_logits(llm, prompts)
    unfused_tokens = llm.generate([{"prompt_token_ids": prompts[0]}], greedy)[0].outputs[0].token_ids
    assert not any(layer.self_attn.fuses() or layer.mlp.fuses() for layer in llm.engine.model.model.layers)
    del llm
    monkeypatch.setattr(CpuBackend, "native_ops", lambda self: {**native(self), **fused})
    llm = LLM(tmp_path, device="cpu", dtype="float32", load_progress=False)
    layers = llm.engine.model.model.layers
    assert all(layer.fusions and layer.self_attn.fuses() and layer.mlp.fuses() for layer in layers)
    assert (batched_last_logits(llm, prompts) - unfused_logits).abs().max().item() <= 1e-5
    assert llm.generate([{"prompt_token_ids": prompts[0]}], greedy)[0].outputs[0].token_ids == unfused_tokens
    per_layer = [("int4_rms_norm_linear", None), ("int4_linear_add", None), ("int4_rms_norm_linear", "silu"),
                 ("int4_linear_add", None)]
    assert calls[:4 * len(layers)] == per_layer * len(layers)
    assert not GPTQMethod({"group_size": 32}).fuses(SimpleNamespace(perm=torch.arange(8)), llm.engine.ops)


def test_a_row_split_4bit_layer_keeps_the_unfused_path_under_tensor_parallelism():
    """The one-pass sum of a row-split product (contract 1.13's ``linear_add`` of the fast all-reduce) takes a
    dense weight: a 4-bit row-split layer on two ranks does not take the fusions; a column-split one does, as
    does the dense row-split one."""
    ops = resolve_ops("acme", {"int4_rms_norm_linear": reference.int4_rms_norm_linear,
                               "int4_linear_add": reference.int4_linear_add})
    comm = SimpleNamespace(rank=0, world_size=2, all_reduce=lambda x: x, fuses_linear_all_reduce=lambda: True)

    def ctx(method):
        return BuildContext(ops, None, comm, torch.float32, torch.device("cpu"), QuantSpec(method, {"group_size": 32}))

    assert not RowParallelLinear(128, 64, ctx("awq")).fuses()
    assert ColumnParallelLinear(128, 64, ctx("awq")).fuses()
    assert RowParallelLinear(128, 64, ctx("unquantized")).fuses()
