"""load_format="dummy": random weights drawn in place from config.json alone, the full-size named
configs they are for, and the config-only directories `bench random-model --config-only` writes."""

import math

import pytest
import torch
from torch import nn

from chitu_core import LLM, SamplingParams
from chitu_core.bench.__main__ import main as bench_main
from chitu_core.bench.configs import CONFIGS
from chitu_core.bench.random_model import hf_config, write_config_only
from chitu_core.errors import ModelLoadError
from chitu_core.loader import dummy
from chitu_core.loader.dummy import fill_dummy_weights
from chitu_core.loader.hf import open_model_dir


class Small(nn.Module):
    """A parameter of each kind the rules tell apart."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.input_layernorm = nn.RMSNorm(16)
        self.proj = nn.Linear(16, 64)  # weight [64, 16], bias [64]
        self.experts = nn.Parameter(torch.empty(4, 8, 64))  # stacked [E, out, in]
        self.norm = nn.RMSNorm(64)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # tied: filled once
        self.packed = nn.Parameter(torch.full((3, 5), 7, dtype=torch.int32), requires_grad=False)
        self.register_buffer("cos_sin", torch.full((4,), 0.5))
        self.after_loading = None

    def process_weights_after_loading(self) -> None:  # as DeepSeek's model splits kv_b_proj there
        self.after_loading = self.proj.weight.detach().clone()


def floating_elements(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.is_floating_point())


def test_fill_is_in_place_within_the_stated_ranges_and_skips_integers():
    model = Small()
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert fill_dummy_weights(model, seed=3) == floating_elements(model) == 32 * 16 + 16 + 64 * 16 + 64 + 4 * 8 * 64 + 64
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers
    bounds = {"embed.weight": 1 / 4, "proj.weight": 1 / 4, "experts": 1 / 8, "proj.bias": 0.02}
    for name, bound in bounds.items():
        p = dict(model.named_parameters())[name].detach()
        assert p.abs().max() <= bound and p.std() > 0, name
        if p.numel() >= 512:  # uniform(-a, a): std a/sqrt(3)
            assert p.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1), name
    for norm in (model.input_layernorm.weight, model.norm.weight):
        assert (norm - 1).abs().max() <= 0.02 and norm.std() > 0
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.packed, torch.zeros(3, 5, dtype=torch.int32))
    assert torch.equal(model.cos_sin, torch.full((4,), 0.5))  # buffers are the config's, not weights
    assert torch.equal(model.after_loading, model.proj.weight)  # the model's own hook ran, after the fill


def test_fill_is_deterministic_per_seed():
    def filled(seed: int) -> dict[str, torch.Tensor]:
        model = Small()
        fill_dummy_weights(model, seed)
        return dict(model.named_parameters())

    a, b, c = filled(0), filled(0), filled(1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(torch.equal(a[n], c[n]) for n in a if a[n].is_floating_point())


def test_fp8_is_drawn_in_float32_chunks_and_cast_in_place(monkeypatch):
    monkeypatch.setattr(dummy, "CHUNK_ELEMENTS", 7)
    model = nn.Module()
    model.weight = nn.Parameter(torch.zeros(10, 64, dtype=torch.float8_e4m3fn), requires_grad=False)
    pointer = model.weight.data_ptr()
    assert fill_dummy_weights(model) == 640
    values = model.weight.float()
    assert model.weight.data_ptr() == pointer
    assert values.isfinite().all() and values.abs().max() <= 1 / 8 and (values != 0).float().mean() > 0.9


NEW_CONFIGS = {  # the real models' parameter counts (tied embeddings once, no MTP layer)
    "qwen3-1.7b": 1_720_574_976,
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_620_634_112,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    "qwen3-30b-a3b": 30_532_122_624,
    "deepseek-v2-lite": 15_706_484_224,
    "deepseek-v3": 671_026_404_352,
}


@pytest.mark.parametrize("name", NEW_CONFIGS)
def test_full_size_configs_build_with_transformers_at_the_real_sizes(name):
    from transformers import AutoModelForCausalLM

    config = hf_config(name)
    assert config.model_type == CONFIGS[name]["model_type"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert model.num_parameters() == NEW_CONFIGS[name]


def test_hf_config_leaves_the_named_config_alone():
    before = {**CONFIGS["deepseek-v3"]["rope_parameters"]}
    hf_config("deepseek-v3")
    assert CONFIGS["deepseek-v3"]["rope_parameters"] == before


@pytest.mark.parametrize("name", NEW_CONFIGS)
def test_config_only_directories_open_without_weights(name, tmp_path):
    write_config_only(name, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json"]
    model_dir = open_model_dir(tmp_path, require_weights=False)
    assert model_dir.weight_files == [] and model_dir.tokenizer() is None
    assert model_dir.architecture == type(hf_config(name)).__name__.removesuffix("Config") + "ForCausalLM"
    assert model_dir.config_dtype() == torch.bfloat16
    assert model_dir.config.num_hidden_layers == CONFIGS[name]["num_hidden_layers"]
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        open_model_dir(tmp_path)


@pytest.fixture(scope="module")
def tiny_config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-config-only")
    assert bench_main(["random-model", "--like", "tiny", "--out", str(path), "--config-only", "--dtype", "float32"]) == 0
    return path


def test_dummy_llm_generates_with_finite_logits(tiny_config_dir):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)

    def run() -> tuple[list[int], list[dict[int, float]]]:
        llm = LLM(model=tiny_config_dir, device="cpu", dtype="float32", load_format="dummy", load_progress=False)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0]
        return out.token_ids, out.logprobs

    tokens, logprobs = run()
    assert len(tokens) == 8 and len(logprobs) == 8
    for step in logprobs:
        values = list(step.values())
        assert all(math.isfinite(v) and v < 0 for v in values) and max(values) > min(values)
    assert run()[0] == tokens  # the same seed draws the same weights


def test_a_config_only_directory_needs_load_format_dummy(tiny_config_dir):
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights.*load_format='dummy'"):
        LLM(model=tiny_config_dir, device="cpu", dtype="float32", load_progress=False)


def test_load_format_is_a_server_flag():
    from chitu_core.serve import load_config

    assert load_config(["--load-format", "dummy"]).load_format == "dummy"
    assert load_config([]).load_format == "auto"
