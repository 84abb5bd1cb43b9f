"""The quantization contract's seams: parameters that say how they split (every loader slices packed,
grouped, transposed and per-tensor tensors by their marks alone), the choice of method from a
checkpoint or a flag, and layers a checkpoint leaves unquantized."""

from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from chitu_core.ops.table import resolve_ops
from chitu_core.quantization import QuantMethod, UnquantizedMethod, registry
from chitu_core.quantization.params import quant_param
from chitu_core.quantization.select import IN_SITU, QuantSpec, apply_layer_choices, select_quantization

OPS = resolve_ops("reference", {})


class ToyMethod(QuantMethod):
    """Checkpoint tensors of every shape the marks describe: a transposed weight, scales per 4 outputs,
    scales per 3 inputs (the last block partial), a per-tensor scale, and bytes at 3 inputs per 2 bytes."""

    name = "toy-marks"
    kernels = ("linear",)
    checkpoint_formats = ("toy",)

    def create_checkpoint_weights(self, layer, k, n, dtype, device):
        quant_param(layer, "w_t", (k, n), dtype, device, in_dim=0, out_dim=1)
        quant_param(layer, "s_out", (n // 4,), dtype, device, out_dim=0, out_pack=4)
        quant_param(layer, "s_in", (-(-k // 3),), dtype, device, in_dim=0, in_pack=3)
        quant_param(layer, "s_tensor", (n,), dtype, device, out_dim=0)
        quant_param(layer, "raw", (n, k * 2 // 3), torch.uint8, device, out_dim=0, in_dim=1, in_pack=Fraction(3, 2))

    def apply(self, layer, x, bias, ops):
        k = layer.w_t.shape[0]
        w = (layer.w_t.T * layer.s_out.repeat_interleave(4)[:, None] * layer.s_tensor[:, None]
             * layer.s_in.repeat_interleave(3)[None, :k])
        return ops.linear(x, w, bias)


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch):
    """ToyMethod is registered for each test only, so that no other test's registry sees it."""
    monkeypatch.setitem(registry._METHODS, ToyMethod.name, ToyMethod)
    monkeypatch.setitem(registry._ORIGINS, ToyMethod.name, __name__)


def _ctx(rank: int, world: int, spec: QuantSpec) -> BuildContext:
    comm = SimpleNamespace(rank=rank, world_size=world, all_reduce=lambda x: x)
    return BuildContext(OPS, None, comm, torch.float32, torch.device("cpu"), spec)


def _checkpoint(k: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w_t": torch.randn(k, n, generator=gen), "s_out": torch.rand(n // 4, generator=gen) + 0.5,
            "s_in": torch.rand(-(-k // 3), generator=gen) + 0.5, "s_tensor": torch.tensor(1.5 + seed),
            "raw": torch.randint(0, 256, (n, k * 2 // 3), generator=gen, dtype=torch.uint8)}


def _load(layer, tensors: dict[str, torch.Tensor], shard_id=None) -> None:
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        params[name].weight_loader(params[name], t, shard_id)


SPEC = QuantSpec("toy-marks")


@pytest.mark.parametrize("rank", [0, 1])
def test_column_split_slices_every_mark_along_the_outputs(rank):
    k, n = 12, 16
    layer = ColumnParallelLinear(k, n, _ctx(rank, 2, SPEC))
    full = _checkpoint(k, n, 0)
    _load(layer, full)
    rows = slice(8 * rank, 8 * rank + 8)
    assert layer.w_t.equal(full["w_t"][:, rows])
    assert layer.s_out.equal(full["s_out"][2 * rank:2 * rank + 2])
    assert layer.s_in.equal(full["s_in"])  # not split along the inputs
    assert layer.s_tensor.equal(torch.full((8,), 1.5))
    assert layer.raw.equal(full["raw"][rows])


@pytest.mark.parametrize("rank", [0, 1])
def test_row_split_slices_along_the_inputs_in_whole_elements(rank):
    k, n = 12, 8
    layer = RowParallelLinear(k, n, _ctx(rank, 2, SPEC))
    full = _checkpoint(k, n, 0)
    _load(layer, full)
    assert layer.w_t.equal(full["w_t"][6 * rank:6 * rank + 6])
    assert layer.s_in.equal(full["s_in"][2 * rank:2 * rank + 2])
    assert layer.raw.equal(full["raw"][:, 4 * rank:4 * rank + 4])  # 6 inputs = 4 bytes at 3 per 2
    assert layer.s_out.equal(full["s_out"]) and layer.s_tensor.equal(torch.full((8,), 1.5))


def test_a_partial_last_block_is_taken_whole():
    layer = ColumnParallelLinear(10, 8, _ctx(0, 1, SPEC))  # 10 inputs: blocks of 3, 3, 3 and 1
    full = _checkpoint(10, 8, 0)
    full["raw"] = torch.zeros(8, 6, dtype=torch.uint8)  # (10 * 2 // 3 bytes; not a whole block here)
    _load(layer, full)
    assert layer.s_in.shape == (4,) and layer.s_in.equal(full["s_in"])


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_parts_land_at_their_offsets_with_their_own_per_tensor_scales(rank):
    k = 12
    layer = MergedColumnParallelLinear(k, [16, 8], _ctx(rank, 2, SPEC))
    parts = [_checkpoint(k, 16, 0), _checkpoint(k, 8, 1)]
    for i, part in enumerate(parts):
        _load(layer, part, i)
    assert layer.w_t.equal(torch.cat([parts[0]["w_t"][:, 8 * rank:8 * rank + 8],
                                      parts[1]["w_t"][:, 4 * rank:4 * rank + 4]], 1))
    assert layer.s_out.equal(torch.cat([parts[0]["s_out"][2 * rank:2 * rank + 2], parts[1]["s_out"][rank:rank + 1]]))
    assert layer.s_tensor.equal(torch.tensor([1.5] * 8 + [2.5] * 4))


def test_qkv_parts_and_replicated_kv_heads():
    # 4 query heads and 1 kv head of 4 channels on 2 ranks: rank 1 holds query heads 2-3 and the kv head.
    layer = QKVParallelLinear(12, 4, 4, 1, _ctx(1, 2, SPEC))
    parts = {"q": _checkpoint(12, 16, 0), "k": _checkpoint(12, 4, 1), "v": _checkpoint(12, 4, 2)}
    for sid, part in parts.items():
        _load(layer, part, sid)
    assert layer.w_t.equal(torch.cat([parts["q"]["w_t"][:, 8:], parts["k"]["w_t"], parts["v"]["w_t"]], 1))
    assert layer.s_tensor.equal(torch.tensor([1.5] * 8 + [2.5] * 4 + [3.5] * 4))


def test_a_split_inside_a_packed_element_is_an_error_that_says_why():
    layer = ColumnParallelLinear(12, 8, _ctx(1, 4, SPEC))  # 2 outputs a rank, scales cover 4
    with pytest.raises(ModelLoadError, match=r"do not start on a whole element .* packs 4 features per element"):
        _load(layer, _checkpoint(12, 8, 0))


def test_checkpoint_shape_mismatch_names_the_expected_shape():
    layer = ColumnParallelLinear(12, 8, _ctx(0, 1, SPEC))
    bad = _checkpoint(12, 8, 0)
    bad["w_t"] = bad["w_t"][:, :4]
    with pytest.raises(ModelLoadError, match=r"\[12, 4\].*expects \[12, 8\]"):
        _load(layer, bad)


def _backend(methods=("unquantized", "toy-marks"), prefs=None):
    return SimpleNamespace(name="fake", quant_methods=lambda: frozenset(methods),
                           quant_preferences=lambda m: dict(prefs or {}))


def test_select_reads_the_checkpoint_and_merges_the_backends_preferences():
    config = SimpleNamespace(quantization_config={"quant_method": "toy", "ignore": ["lm_head"],
                                                  "modules_to_not_convert": ["mlp.down_proj"]})
    spec = select_quantization(config, None, _backend(prefs={"act_quant": True}))
    assert (spec.method, spec.options, spec.in_situ, spec.ignored) == ("toy-marks", {"act_quant": True}, False,
                                                                        ("lm_head", "mlp.down_proj"))
    assert select_quantization(SimpleNamespace(), None, _backend()) == QuantSpec()


def test_select_errors_name_the_method_the_backend_and_the_fix():
    with pytest.raises(ChituError, match=r"^backend 'fake' does not run quantization method 'toy-marks' \(it runs: "
                                         r"unquantized\); use another device"):
        select_quantization(SimpleNamespace(quantization_config={"quant_method": "toy"}), None,
                            _backend(("unquantized",)))
    with pytest.raises(ChituError, match=r"quant_method 'bitsandbytes', which no installed quantization method reads"):
        select_quantization(SimpleNamespace(quantization_config={"quant_method": "bitsandbytes"}), None, _backend())
    with pytest.raises(ChituError, match=r"already quantized \('toy'\); --quantization int8 quantizes 16-bit"):
        select_quantization(SimpleNamespace(quantization_config={"quant_method": "toy"}), "int8", _backend())


def test_in_situ_names_map_to_methods():
    assert {k: v[0] for k, v in IN_SITU.items()} == {"fp8": "fp8", "int8": "int8", "int4": "awq"}


def test_ignored_layers_are_rebuilt_unquantized_fused_ones_by_their_parts():
    class Block(torch.nn.Module):
        def __init__(self, ctx):
            super().__init__()
            self.qkv_proj = QKVParallelLinear(12, 4, 2, 2, ctx)
            self.o_proj = RowParallelLinear(8, 12, ctx)
            self.gate_up_proj = MergedColumnParallelLinear(12, [8, 8], ctx)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(_ctx(0, 1, SPEC)) for _ in range(2)])
    spec = QuantSpec("toy-marks", ignored=("layers.0.v_proj", "re:layers\\.1\\.o_.*", "up_proj"))
    unfused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    rebuilt = apply_layer_choices(model, spec, unfused)
    assert rebuilt == ["layers.0.qkv_proj", "layers.0.gate_up_proj", "layers.1.o_proj", "layers.1.gate_up_proj"]
    assert isinstance(model.layers[0].qkv_proj.quant, UnquantizedMethod)
    assert model.layers[0].qkv_proj.weight.shape == (24, 12) and not hasattr(model.layers[0].qkv_proj, "w_t")
    assert isinstance(model.layers[1].qkv_proj.quant, ToyMethod) and model.layers[1].qkv_proj.w_t.shape == (12, 24)
    assert model.layers[0].qkv_proj.weight.weight_loader.__name__ == "load_shard"


def test_a_method_written_for_contract_1_0_still_loads_and_applies():
    class Old(QuantMethod):  # overrides create_weights, knows nothing of checkpoint weights or quantize
        name, kernels = "old-style", ("linear",)

        def create_weights(self, layer, k, n, dtype, device):
            layer.register_parameter("weight", torch.nn.Parameter(torch.ones(n, k, dtype=dtype), requires_grad=False))

        def apply(self, layer, x, bias, ops):
            return ops.linear(x, layer.weight, bias)

    layer = ColumnParallelLinear(3, 2, _ctx(0, 1, QuantSpec()))
    layer.set_quant_method(Old())
    layer.quant.process_weights_after_loading(layer)
    assert layer(torch.ones(1, 3)).equal(torch.full((1, 2), 3.0))
