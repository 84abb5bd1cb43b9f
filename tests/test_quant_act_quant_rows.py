"""The 8-bit methods' ``act_quant`` as a number of rows (contract 1.17): 16-bit activations below it,
quantized activations from it, bit for bit the two fixed forms; bad values refused in one line; the
NVIDIA backend's preference by compute capability."""

import pytest
import torch

from chitu_core.errors import ChituError
from chitu_core.layers.linear import ColumnParallelLinear
from chitu_core.quantization.activations import quantizes_activations
from chitu_core.quantization.fp8 import Fp8Method
from chitu_core.quantization.int8 import Int8Method
from test_quant_fp8_int8 import ctx, finish, load

CASES = [("fp8", Fp8Method, {"weight_block_size": [128, 128]}), ("fp8", Fp8Method, {"weight_block_size": None}),
         ("int8", Int8Method, {})]


@pytest.mark.parametrize("method,cls,options", CASES, ids=["fp8-block", "fp8-channel", "int8"])
def test_rows_option_takes_each_fixed_form_by_row_count(method, cls, options):
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(64, 256, generator=gen) / 16
    layers = {}
    for act_quant in (False, True, 3):
        layer = ColumnParallelLinear(256, 64, ctx(method, {**options, "act_quant": act_quant}))
        load(layer, cls(options).quantize(w))
        finish(layer)
        layers[act_quant] = layer
    for rows, form in ((1, False), (2, False), (3, True), (5, True)):
        x = torch.randn(rows, 256, generator=gen)
        got = layers[3](x)
        assert torch.equal(got, layers[form](x)), (rows, form)
        assert not torch.equal(got, layers[not form](x)), rows  # the two forms differ here, so the test can fail


def test_rows_count_every_leading_dimension():
    x = torch.zeros(2, 3, 8)  # six rows
    assert [quantizes_activations(v, x) for v in (False, True, 6, 7)] == [False, True, True, False]


@pytest.mark.parametrize("cls", [Fp8Method, Int8Method])
@pytest.mark.parametrize("value", [0, -4, 2.5, "yes", None])
def test_bad_act_quant_is_one_line_naming_method_and_value(cls, value):
    with pytest.raises(ChituError, match=rf"^quantization method '{cls.name}': option act_quant is {value!r}; "):
        cls({"act_quant": value})


@pytest.mark.parametrize("cuda,capability,want", [(False, (9, 0), False), (True, (8, 0), False),
                                                  (True, (8, 9), 32), (True, (9, 0), 32)])
def test_nvidia_quantizes_fp8_activations_from_32_rows_where_it_multiplies_fp8(monkeypatch, cuda, capability, want):
    from chitu_nvidia import backend as nvidia

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    prefs = nvidia.NvidiaBackend().quant_preferences
    assert prefs("fp8") == {"act_quant": want}
    assert prefs("int8") == {"act_quant": True} and prefs("awq") == {}
