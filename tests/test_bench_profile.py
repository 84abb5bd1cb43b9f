"""`python -m chitu_core.bench profile`: a decode step's time by module. On the CPU backend the time is host
time; the bytes are exact (weights, the KV of the step's contexts, the embedding rows of its tokens), and a
module's own time leaves out the modules nested in it."""

import json
import time

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from chitu_core.bench.breakdown import _Ranges, attribute, find_sites, site_group
from chitu_core.bench.configs import CONFIGS
from chitu_core.bench.report import render
from test_bench import bench, tiny_dir  # noqa: F401  (the fixture)

BATCH, INPUT, STEPS, WARMUP = 2, 16, 3, 3


@pytest.fixture(scope="module")
def result(tiny_dir):  # noqa: F811
    out = bench("profile", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--batch-size", str(BATCH),
                "--input-len", str(INPUT), "--steps", str(STEPS), "--json")
    return json.loads(out)


def test_rows_have_the_modules_bytes(result):
    c = CONFIGS["tiny"]
    layers, hidden, heads, kv_heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = hidden // heads
    rows = {r["site"]: r for r in result["rows"]}
    qkv = rows["model.layers.*.self_attn.qkv_proj"]
    assert qkv["calls"] == layers and qkv["kind"] == "QKVParallelLinear"
    assert qkv["bytes"] == layers * (heads + 2 * kv_heads) * head_dim * hidden * 4
    assert rows["model.layers.*.mlp.down_proj"]["bytes"] == layers * c["intermediate_size"] * hidden * 4
    # Before profiled step s each sequence holds INPUT + 1 (prefill's token) + WARMUP + s tokens.
    contexts = BATCH * sum(INPUT + 1 + WARMUP + s for s in range(STEPS)) / STEPS
    assert rows["model.layers.*.self_attn.attn"]["bytes"] == round(layers * 2 * kv_heads * head_dim * 4 * contexts)
    assert rows["model.embed_tokens"]["bytes"] == BATCH * hidden * 4  # the tokens' rows, not the table
    assert rows["lm_head"]["bytes"] == c["vocab_size"] * hidden * 4  # the head reads its whole table
    assert rows["lm_head"]["calls"] == 1 and rows["model.norm"]["calls"] == 1
    assert result["time"] == "host" and result["batch"] == BATCH and result["steps"] == STEPS
    assert sum(r["us"] for r in result["rows"]) + result["other_us"] == pytest.approx(result["step_us"], rel=1e-3)
    assert sum(r["share"] for r in result["rows"]) < 1
    assert all(r["gbps"] == pytest.approx(r["bytes"] / r["us"] / 1e3, rel=1e-2) for r in result["rows"] if r["us"] > 1)


def test_report_shows_the_breakdown(result, tmp_path):
    (tmp_path / "breakdown-tiny-b2.json").write_text(json.dumps(result))
    page = render(tmp_path)
    assert "## Decode step by module (`breakdown-tiny-b2.json`" in page
    assert "| `model.layers.*.self_attn.qkv_proj` | QKVParallelLinear | 2 |" in page


def test_in_situ_quantization_profiles_the_quantized_bytes(tiny_dir, result, tmp_path):  # noqa: F811
    out = json.loads(bench("profile", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--batch-size",
                           "1", "--input-len", str(INPUT), "--steps", "1", "--quantization", "int8", "--json"))
    assert out["quantization"].startswith("int8 (in situ)") and result["quantization"] == "unquantized"
    q8, f32 = ({r["site"]: r["bytes"] for r in x["rows"]} for x in (out, result))
    c = CONFIGS["tiny"]
    down = c["intermediate_size"] * c["hidden_size"]  # int8 weights and a float32 scale per output channel
    assert q8["model.layers.*.mlp.down_proj"] == c["num_hidden_layers"] * (down + 4 * c["hidden_size"])
    assert f32["model.layers.*.mlp.down_proj"] == c["num_hidden_layers"] * down * 4
    (tmp_path / "breakdown-tiny-int8-b1.json").write_text(json.dumps(out))
    assert f"cpu float32, weights {out['quantization']}: " in render(tmp_path)


def test_a_modules_own_time_leaves_out_the_modules_inside_it():
    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            time.sleep(0.2)  # long beside the outer module's own host time, even on a loaded machine
            return x * self.weight

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.inner = Slow()

        def forward(self, x):
            return self.inner(x * self.scale)

    model = nn.Sequential(Outer())
    sites = find_sites(model)
    assert set(sites) == {"0", "0.inner"}
    model(torch.ones(4))  # first calls' one-time costs out of the profile
    ranges = _Ranges(sites)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.ones(4))
    ranges.remove()
    per_site, _ = attribute(prof.events(), device=False)
    assert len(per_site["0"]) == len(per_site["0.inner"]) == 1
    outer, inner = per_site["0"][0], per_site["0.inner"][0]  # microseconds: the sleep is the inner module's
    assert inner > 200_000 and outer < inner / 4
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks  # the hooks are gone


def test_site_names_of_every_layer_share_a_group():
    assert site_group("model.layers.7.mlp.down_proj") == "model.layers.*.mlp.down_proj"
    assert site_group("model.layers.12.self_attn.attn") == "model.layers.*.self_attn.attn"
    assert site_group("lm_head") == "lm_head"


class _Event:
    """A kineto event as ``attribute_device`` reads it."""

    def __init__(self, name, start, end, device=False, annotation=False):
        self._args = name, start, end, device, annotation

    def name(self):
        return self._args[0]

    def start_ns(self):
        return self._args[1]

    def end_ns(self):
        return self._args[2]

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self._args[3] else torch.autograd.DeviceType.CPU

    def is_user_annotation(self):
        return self._args[4]


def test_device_kernels_go_to_the_innermost_range_that_holds_them():
    from chitu_core.bench.breakdown import PREFIX, attribute_device

    events = [_Event(PREFIX + "attn", 0, 10_000), _Event(PREFIX + "attn.qkv", 1_000, 4_000),
              _Event(PREFIX + "mlp", 12_000, 20_000), _Event(PREFIX + "attn", 30_000, 40_000),
              _Event("triton_kernel_a", 1_500, 3_500, device=True),  # in qkv, nested in attn
              _Event("triton_kernel_b", 5_000, 8_000, device=True),  # attn's own
              _Event("gemm", 13_000, 19_000, device=True), _Event("gemm", 31_000, 33_000, device=True),
              _Event("sample", 25_000, 26_000, device=True),  # outside every site
              _Event(PREFIX + "mlp", 12_000, 20_000, device=True, annotation=True)]  # a device-side annotation: not a kernel
    per_site, outside = attribute_device(events)
    assert dict(per_site) == {"attn": [3.0, 2.0], "attn.qkv": [2.0], "mlp": [6.0]}
    assert outside == 1.0
