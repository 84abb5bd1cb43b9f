"""The HF directory loader: both config.json spellings, sharded checkpoints, and clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from builders import build_model
from chitu_core import LLM, SamplingParams
from chitu_core.errors import ModelLoadError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny llama3-scaled model and its greedy reference continuation."""
    path = tmp_path_factory.mktemp("llama3")
    hf = build_model(path, "llama3")
    ref = hf.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    return path, ref[0, 5:].tolist()


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def generate(path) -> list[int]:
    return LLM(path, device="cpu", dtype="float32", load_progress=False).generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def test_current_config_spelling(saved):
    path, ref = saved
    assert "rope_parameters" in json.loads((path / "config.json").read_text())
    assert generate(path) == ref


def test_legacy_rope_scaling_spelling(saved, tmp_path):
    """config.json as transformers 4.x wrote it: rope_theta + rope_scaling with "type"."""
    path = copy_model(saved[0], tmp_path / "legacy")
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    (path / "config.json").write_text(json.dumps(cfg))
    assert generate(path) == saved[1]


def test_sharded_checkpoint_with_index(saved, tmp_path):
    src = saved[0]
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    path = tmp_path / "sharded"
    path.mkdir()
    shutil.copy(src / "config.json", path)
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / file, metadata={"format": "pt"})
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert generate(path) == saved[1]


def test_unknown_architecture_names_installed_ones(saved, tmp_path):
    path = copy_model(saved[0], tmp_path / "unknown")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FancyForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'FancyForCausalLM' is not supported") as exc:
        generate(path)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(exc.value)


def rewrite_weights(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(saved, tmp_path):
    path = copy_model(saved[0], tmp_path / "missing")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor\(s\) the model needs: model\.layers\.1\.mlp\.up_proj\.weight"):
        generate(path)


def test_shape_mismatch_names_tensor_and_shapes(saved, tmp_path):
    path = copy_model(saved[0], tmp_path / "shape")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*shape \[16, 64\].*expects \[32, 64\]"):
        generate(path)


def test_unexpected_tensor_is_named(saved, tmp_path):
    path = copy_model(saved[0], tmp_path / "extra")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.mystery.weight": torch.ones(3)}))
    with pytest.raises(ModelLoadError, match=r"does not know.*model\.layers\.0\.mystery\.weight"):
        generate(path)


def test_truncated_safetensors(saved, tmp_path):
    path = copy_model(saved[0], tmp_path / "truncated")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is truncated: .* but only \d+ are present"):
        generate(path)
    file.write_bytes(data[:5])
    with pytest.raises(ModelLoadError, match="too short for a header"):
        generate(path)


def test_index_naming_absent_shard(saved, tmp_path):
    path = copy_model(saved[0], tmp_path / "badindex")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00009.safetensors"}}))
    with pytest.raises(ModelLoadError, match="lists shard.*model-00009.safetensors"):
        generate(path)


@pytest.mark.parametrize("layout", ["not-a-dir", "no-config", "no-weights"])
def test_bad_directories(tmp_path, saved, layout):
    path = tmp_path / "m"
    if layout == "no-config":
        path.mkdir()
        shutil.copy(saved[0] / "model.safetensors", path)
        match = "has no config.json"
    elif layout == "no-weights":
        path.mkdir()
        shutil.copy(saved[0] / "config.json", path)
        match = r"no \*\.safetensors weights"
    else:
        match = "is not a directory"
    with pytest.raises(ModelLoadError, match=match):
        generate(path)
