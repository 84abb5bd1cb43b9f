"""The light tokenizer (tokenizers + jinja2) against transformers' AutoTokenizer on the same
directories, the GGUF cache's config read without transformers, and a default-model run that never
imports transformers."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from builders import build_chat_model, save_tokenizer
from chitu_core.layers.rotary import rope_config
from chitu_core.loader.gguf import resolve_model
from chitu_core.loader.hf import JsonConfig, open_model_dir
from chitu_core.loader.tokenizer import LightTokenizer
from chitu_core.quantization.select import checkpoint_quant_config

TEXTS = [
    "Hello world", "", " ", "  lots   of\n\n\n spaces\t\tand tabs  ", "émoji 😀👍🏽 东京 Zürich naïve", "\u200b\u00a0zero width",
    "def f(x):\n    return {'a': [x ** 2, None]}  # code\n", "<|im_start|>user\nhi<|im_end|>\n", "a<|im_end|>b <s></s>",
    "The quick brown fox jumps over the lazy dog.", "can't won't I'm you're it's . , ! ?", "\r\n\r\nwindows\r\n", "1234567890 3.14159",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "system", "content": "x"}, {"role": "user", "content": "y", "name": None}],
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

TOOL_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{% if tools %}<tools>{{ tools | tojson }}\n{{ tools[0] | tojson(indent=2) }}</tools>\n{% endif %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
    "{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{{ ns.n }} {{ greeting | default('none') }} {{ strftime_now('%Y') }}"
    "{% if add_generation_prompt %}{% generation %}assistant:{% endgeneration %}{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """The embedded default's converted directory (in a temporary cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHITU_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return Path(resolve_model(None, keep_quantized=True))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """builders' tiny chat model: a trained byte-level BPE, <s>/</s>, a ChatML template, config.json."""
    path = tmp_path_factory.mktemp("chat-model")
    build_chat_model(path)
    return path


@pytest.fixture(scope="module")
def tokenizer_only(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer-only")
    save_tokenizer(path)
    return path


def pair(path: Path):
    light = LightTokenizer.load(path)
    assert light is not None, LightTokenizer.decline_reason(path)
    return light, AutoTokenizer.from_pretrained(path)


def assert_same(light, hf, conversations=CONVERSATIONS, **chat_kwargs):
    assert len(light) == len(hf)
    assert (light.bos_token_id, light.eos_token_id, light.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert light.special_tokens_map == hf.special_tokens_map
    assert sorted(light.all_special_ids) == sorted(hf.all_special_ids)
    assert light.chat_template == hf.chat_template
    for text in TEXTS:
        for special in (True, False):
            assert light.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), (text, special)
        ids = hf.encode(text) + [hf.eos_token_id, 0, 1, len(hf) - 1]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)
        assert [light.decode([i]) for i in ids] == [hf.decode([i]) for i in ids]
    for conv in conversations:
        for gen in (True, False):
            got = light.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **chat_kwargs)
            assert got == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **chat_kwargs)
            assert light.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, **chat_kwargs) == \
                hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=False, **chat_kwargs)


def test_the_embedded_default_matches_transformers(smollm2):
    assert_same(*pair(smollm2))


def test_builders_chat_model_matches_transformers(chat_model):
    assert_same(*pair(chat_model))


def test_a_tokenizer_without_config_json_matches_transformers(tokenizer_only):
    assert_same(*pair(tokenizer_only))


def test_a_template_with_tools_and_transformers_globals(smollm2, tmp_path):
    path = shutil.copytree(smollm2, tmp_path / "tools", ignore=shutil.ignore_patterns("*.safetensors"))
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    light, hf = pair(path)
    for tools in (None, TOOLS):
        assert_same(light, hf, tools=tools, greeting="hej")
    with pytest.raises(Exception, match="no tool role"):
        light.apply_chat_template([{"role": "tool", "content": "x"}])


def test_named_templates_pick_tool_use_with_tools(smollm2, tmp_path):
    path = shutil.copytree(smollm2, tmp_path / "named", ignore=shutil.ignore_patterns("*.safetensors"))
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE)
    light, hf = pair(path)
    assert isinstance(light.chat_template, dict) and light.chat_template == hf.chat_template
    assert_same(light, hf, tools=TOOLS)


def edited(src: Path, dst: Path, **config) -> Path:
    """A copy of ``src``'s tokenizer files with tokenizer_config.json fields set (None: removed)."""
    path = shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("config", [
    {"split_special_tokens": True},
    {"clean_up_tokenization_spaces": True},
    {"add_bos_token": True, "add_eos_token": True},
    {"pad_token": "<pad>", "extra_special_tokens": ["<tool>", "<|im_start|>"]},
    {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{{ messages[0]['content'] }}!"},
    {"added_tokens_decoder": {"400": {"content": "<new>", "special": False, "normalized": True, "lstrip": False,
                                      "rstrip": False, "single_word": False}}},
])
def test_config_behaviours_match_transformers(chat_model, tmp_path, config):
    assert_same(*pair(edited(chat_model, tmp_path / "edited", **config)))


@pytest.mark.parametrize("config, model_type", [
    ({"tokenizer_class": "LlamaTokenizer"}, "llama"),
    ({"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}, "llama"),
    ({}, "phi3"),
])
def test_where_transformers_does_more_the_model_dir_falls_back(chat_model, tmp_path, config, model_type):
    path = edited(chat_model, tmp_path / "declined", **config)
    shutil.copy(chat_model / "model.safetensors", path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    assert LightTokenizer.load(path) is None and LightTokenizer.decline_reason(path)
    if "auto_map" not in config and model_type == "llama":
        tok = open_model_dir(path).tokenizer()
        assert not isinstance(tok, LightTokenizer) and hasattr(tok, "backend_tokenizer")


def test_the_gguf_cache_config_reads_without_transformers(smollm2):
    model_dir = open_model_dir(smollm2)
    config, reference = model_dir.config, AutoConfig.from_pretrained(smollm2)
    assert isinstance(config, JsonConfig) and model_dir.architecture == "LlamaForCausalLM"
    assert model_dir.config_dtype() == reference.dtype
    assert rope_config(config) == rope_config(reference)
    assert checkpoint_quant_config(config) == checkpoint_quant_config(reference)
    for key, value in reference.to_dict().items():
        if key not in ("dtype", "_name_or_path", "id2label"):  # JSON keys are strings; no model reads labels
            assert getattr(config, key) == value, key


def test_an_hf_directory_keeps_autoconfig_and_gets_the_light_tokenizer(chat_model):
    model_dir = open_model_dir(chat_model)
    assert not isinstance(model_dir.config, JsonConfig) and isinstance(model_dir.tokenizer(), LightTokenizer)


# The prompt's greedy steps up to "Paris" each lead by over a nat, whatever the machine's vector width
# (tests/test_embedded_server.py says why not "What is the capital of France?").
NO_TRANSFORMERS = """
import sys
from chitu_core.engine.llm import LLM
from chitu_core.loader.gguf import default_model_file
from chitu_core.loader.tokenizer import LightTokenizer
from chitu_core.sampling.params import SamplingParams

llm = LLM(str(default_model_file()), num_threads=2, load_progress=False, max_model_len=512)
out = llm.chat([{"role": "user", "content": "Name the capital of France."}], SamplingParams(temperature=0, max_tokens=12))
assert isinstance(llm.tokenizer, LightTokenizer), llm.tokenizer
assert llm.engine.eos_token_ids == {2}, llm.engine.eos_token_ids
assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "transformers")
assert not loaded, loaded[:5]
print("ok")
"""


def test_the_default_model_runs_without_importing_transformers(tmp_path):
    """A first start (the GGUF converted in a child process) and a second one (a cache hit)."""
    env = {**os.environ, "CHITU_CACHE_DIR": str(tmp_path / "cache")}
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", NO_TRANSFORMERS], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
    assert len(list((tmp_path / "cache" / "gguf").glob("*/chitu-gguf.json"))) == 1


def test_a_script_without_a_main_guard_converts_once(tmp_path):
    """The conversion's child is a fresh interpreter, not a spawn that re-runs the caller's script (which
    would load the model again in the child and wait for the parent's lock)."""
    script = tmp_path / "script.py"
    script.write_text("from chitu_core import LLM\nfrom chitu_core.loader.gguf import default_model_file\n"
                      "LLM(str(default_model_file()), num_threads=2, load_progress=False)\nprint('loaded')\n")
    env = {**os.environ, "CHITU_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "loaded", run.stderr[-3000:]


def test_a_conversion_that_fails_in_its_child_says_why(tmp_path):
    bad = tmp_path / "bad.gguf"  # a whole header that names an architecture the converter refuses
    code = ("import sys, gguf; w = gguf.GGUFWriter(sys.argv[1], 'bert'); w.write_header_to_file(); "
            "w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()\n"
            "from chitu_core.loader.gguf import resolve_model\n"
            "try:\n    resolve_model(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)")
    env = {**os.environ, "CHITU_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", code, str(bad)], env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.startswith(f"ModelLoadError converting {bad} failed (in a child process): ModelLoadError: {bad} "
                                 "holds GGUF architecture 'bert'"), (run.stdout, run.stderr[-2000:])


@pytest.mark.parametrize("generation, expected", [
    ({"eos_token_id": [2, 7]}, {2, 7}), ({"eos_token_id": 5}, {5}), ({"bos_token_id": 1}, {3}), (None, {3}), ("{not json", {3}),
])
def test_eos_ids_read_generation_config_json(tmp_path, generation, expected):
    from types import SimpleNamespace

    from chitu_core.loader.hf import eos_token_ids

    if generation is not None:
        (tmp_path / "generation_config.json").write_text(generation if isinstance(generation, str) else json.dumps(generation))
    assert eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=3)) == expected
