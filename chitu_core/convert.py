"""``python -m chitu_core.convert MODEL OUTPUT --quantization fp8|int8|int4``: quantize a 16-bit HF
checkpoint once, into a directory the engine then loads as a quantized checkpoint.

Which tensors are quantized is the model's own answer. Its class (from the model plugin) is built on
torch's ``meta`` device, which allocates nothing, and a checkpoint tensor is quantized exactly when it
is the ``weight`` of one of its linear layers (``LinearBase``, found through ``map_weight_name``).
Everything else (embeddings, LM head, norms, MoE routers, and, for now, the routed MoE experts, which
``FusedMoE`` cannot hold quantized yet) is copied in its own dtype and listed in the config's ignore
field; tensors the model skips (``CausalLM.skip_weight``) are left out.

The method and its options are the in-situ choice of ``--quantization`` (``quantization.select.IN_SITU``).
Each linear weight ``X.weight`` becomes the tensors ``QuantMethod.quantize`` returns, named ``X.<key>``
(``X.weight`` and ``X.weight_scale_inv`` for fp8), so that loading the result computes what quantizing
in situ does. config.json gets the ``quantization_config`` the format's own producers write
(``CHECKPOINT_FORMATS``); tokenizer files, generation_config.json and the other small files are copied.

Streaming: one tensor at a time is read, quantized on ``--device`` and added to safetensors shards of at
most ``--max-shard-size`` (with an index json where there are several, as ``save_pretrained`` writes).
All of it goes into a hidden directory beside OUTPUT, renamed to OUTPUT at the end: an interrupted run
leaves no OUTPUT behind, and an existing one (replaced only with ``--force``) stays until then.
"""

import argparse
import json
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from chitu_core.distributed.communicator import Communicator
from chitu_core.engine.engine import build_attention
from chitu_core.errors import ChituError
from chitu_core.layers.context import BuildContext
from chitu_core.layers.linear import LinearBase
from chitu_core.loader.hf import INDEX_FILE, HFModelDir, open_model_dir, read_header
from chitu_core.model import CausalLM
from chitu_core.ops.table import resolve_ops
from chitu_core.plugins.discovery import hook_registry, load_model_class
from chitu_core.quantization import QuantMethod
from chitu_core.quantization.registry import all_quant_methods
from chitu_core.quantization.select import IN_SITU

DEFAULT_MAX_SHARD_BYTES = 2 << 30
FLOAT_DTYPES = {"F16", "BF16", "F32"}  # safetensors dtype names of the weights convert quantizes
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.\d+\.")


@dataclass
class Ignored:
    """Modules left unquantized, by checkpoint name: ``modules`` one by one, ``experts`` the
    ``….experts`` module of each MoE layer whose routed experts all stay unquantized."""

    modules: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)


def _fp8_config(options: Mapping[str, Any], ignored: Ignored) -> dict[str, Any]:
    """DeepSeek-V3's / transformers' fine-grained FP8 (``FineGrainedFP8Config``)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": list(options["weight_block_size"]),
            "modules_to_not_convert": ignored.modules + ignored.experts}


def _awq_config(options: Mapping[str, Any], ignored: Ignored) -> dict[str, Any]:
    """AutoAWQ's GEMM format."""
    return {"quant_method": "awq", "bits": 4, "group_size": options["group_size"],
            "zero_point": options["zero_point"], "version": "gemm",
            "modules_to_not_convert": ignored.modules + ignored.experts}


def _int8_config(options: Mapping[str, Any], ignored: Ignored) -> dict[str, Any]:
    """compressed-tensors' int-quantized W8A8: int8 weights per output channel, int8 activations per
    token (dynamic). Its ``ignore`` matches module names exactly, or by a ``re:`` regex: experts by one
    regex a layer."""
    def args(strategy: str, dynamic: bool) -> dict[str, Any]:
        return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": strategy,
                "dynamic": dynamic}

    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": args(options.get("strategy", "channel"), False),
                                          "input_activations": args("token", True), "output_activations": None}},
            "ignore": ignored.modules + [f"re:{re.escape(e)}\\." for e in ignored.experts],
            "kv_cache_scheme": None}


# method name -> its checkpoint's quantization_config, from the method's options and the ignored modules.
CHECKPOINT_FORMATS: dict[str, Callable[[Mapping[str, Any], Ignored], dict[str, Any]]] = {
    "fp8": _fp8_config,
    "awq": _awq_config,
    "int8": _int8_config,
}


# --- which tensors -------------------------------------------------------------------------------


class _NoAttentionBackends:
    """A backend that declares no attention: ``build_attention`` then builds the core's reference."""

    def attention_backends(self) -> dict:
        return {}

    def mla_attention_backends(self) -> dict:
        return {}


def build_skeleton(model_dir: HFModelDir) -> CausalLM:
    """The model of ``model_dir`` from its plugin, unquantized, every tensor on the ``meta`` device."""
    cls = load_model_class(model_dir.architecture)
    meta = torch.device("meta")
    dtype = model_dir.config_dtype() or torch.bfloat16
    with meta:  # tables computed at construction (RoPE's) are meta as well: nothing is allocated
        attention = build_attention(_NoAttentionBackends(), cls.kv_geometry(model_dir.config, 1), None, dtype, meta)
        ctx = BuildContext(resolve_ops("reference", {}), attention, Communicator.single(), dtype, meta)
        return cls(model_dir.config, ctx)


@dataclass
class Plan:
    """What happens to each checkpoint tensor: quantized, dropped, or (the rest) copied as it is."""

    quantize: set[str]  # checkpoint names of the linear layers' weights
    drop: set[str]  # tensors the model skips (stale RoPE tables, DeepSeek-V3's multi-token-prediction layer)
    ignored: Ignored
    num_tensors: int


def plan_checkpoint(model_dir: HFModelDir, method: QuantMethod, quantization: str) -> Plan:
    """Find the linear weights to quantize, checking that they are floating point, that every tensor
    is one of the model's, and that the format can hold the model's fused layers as our loader puts them."""
    model = build_skeleton(model_dir)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}  # tied ones too
    linears = {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
    _check_fused_parts(linears, method, quantization)
    plan = Plan(set(), set(), Ignored(), 0)
    not_float, unknown = [], []
    for file in model_dir.weight_files:
        for name, info in read_header(file).items():
            plan.num_tensors += 1
            if model.skip_weight(name):
                plan.drop.add(name)
                continue
            param, _ = model.map_weight_name(name)
            module, _, leaf = param.rpartition(".")
            if param not in params:
                unknown.append(name)
            elif module in linears and leaf == "weight" and name.endswith(".weight"):
                plan.quantize.add(name)
                if info["dtype"] not in FLOAT_DTYPES:
                    not_float.append(f"{file.name}: tensor {name!r} is stored as {info['dtype']}")
            elif name.endswith(".weight"):
                expert = _EXPERT.match(name)
                kept, into = (expert["experts"], plan.ignored.experts) if expert else \
                    (name.removesuffix(".weight"), plan.ignored.modules)
                if kept not in into:
                    into.append(kept)
    if not_float:
        raise ChituError(f"{not_float[0]}, not a 16- or 32-bit float: is this checkpoint quantized already? "
                         "convert reads 16-bit checkpoints only")
    if unknown:
        raise ChituError(f"the checkpoint has {len(unknown)} tensor(s) {model_dir.architecture} has no parameter "
                         f"for, e.g. {', '.join(unknown[:3])}: is this checkpoint quantized already (convert reads "
                         "16-bit checkpoints only), or is config.json's architecture wrong?")
    return plan


def _check_fused_parts(linears: Mapping[str, LinearBase], method: QuantMethod, quantization: str) -> None:
    """A fused layer (qkv_proj, gate_up_proj) loads each checkpoint part at its offset along the
    outputs; a format whose tensors pack several outputs into one element (a 128-row FP8 block scale)
    can hold it only where every offset starts a whole element."""
    for name, layer in linears.items():
        parts = getattr(layer, "parts", None) or {}
        holder = nn.Module()
        try:  # the method checks the layer's shape suits its format (whole 4-bit groups along K, ...)
            method.create_checkpoint_weights(holder, layer.in_features, layer.out_features, layer.dtype,
                                             torch.device("meta"))
        except ChituError as exc:
            raise ChituError(f"{name} cannot be stored as {method.name}: {exc}") from None
        for pname, param in holder.named_parameters():
            pack = Fraction(getattr(param, "out_pack", 1))
            for part, (offset, *_) in parts.items():
                if getattr(param, "out_dim", None) is not None and (offset / pack).denominator != 1:
                    raise ChituError(
                        f"{name}: its part {part!r} starts at output {offset}, inside one of the {pack}-output "
                        f"elements of the {method.name} tensor {pname!r}, so a checkpoint of this format cannot "
                        f"hold this model's fused layers; quantize while loading instead (--quantization "
                        f"{quantization} with the 16-bit checkpoint)")


# --- writing ---------------------------------------------------------------------------------------


class ShardWriter:
    """Tensors into safetensors shards of at most ``max_bytes`` each (a larger tensor gets one of its
    own), named as ``save_pretrained`` names them once the last is written (``finish``)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[Path] = []
        self.shard_of: dict[str, int] = {}  # tensor name -> shard number
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.shard_of or name in self.pending:
            raise ChituError(f"two tensors of the converted checkpoint are both named {name!r}")
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        file = self.directory / f"shard-{len(self.files):05d}.partial"
        save_file(self.pending, file, metadata={"format": "pt"})
        self.shard_of.update(dict.fromkeys(self.pending, len(self.files)))
        self.files.append(file)
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        """Write the last shard, name them all, and write the index if there are several; returns their count."""
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for file, final in zip(self.files, names):
            file.rename(self.directory / final)
        if n > 1:
            weight_map = {tensor: names[i] for tensor, i in self.shard_of.items()}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return n


@dataclass
class Converted:
    """What ``convert`` wrote."""

    path: Path
    method: str
    quantized: int  # linear weights quantized
    kept: int  # tensors copied as they are
    dropped: int  # tensors the model skips, left out
    shards: int
    total_bytes: int


def convert(model: str | Path, output: str | Path, quantization: str, *, device: str = "cpu", force: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True) -> Converted:
    """Quantize the 16-bit checkpoint in ``model`` with ``--quantization``'s method into ``output`` (see
    the module docstring). Refuses to replace an existing ``output`` unless ``force``."""
    if quantization not in IN_SITU:
        raise ChituError(f"unknown --quantization {quantization!r}; choose one of {', '.join(IN_SITU)}")
    src, out = Path(model).expanduser(), Path(output).expanduser()
    model_dir = open_model_dir(src)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config") is not None:
        fmt = config["quantization_config"].get("quant_method")
        raise ChituError(f"{src} is quantized already (its config.json's quantization_config is {fmt!r}); "
                         "convert reads 16-bit checkpoints only")
    method = _method(quantization)
    _check_output(src, out, force)
    dev = _device(device)
    plan = plan_checkpoint(model_dir, method, quantization)
    config["quantization_config"] = CHECKPOINT_FORMATS[method.name](method.options, plan.ignored)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_sibling(out, "partial")
    try:
        shards = ShardWriter(tmp, max_shard_bytes)
        with tqdm(total=plan.num_tensors, desc=f"Quantizing ({quantization})", unit="tensor",
                  disable=not progress) as bar:
            _write_weights(model_dir, plan, method, dev, shards, bar)
        num_shards = shards.finish()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in sorted(src.iterdir()):
            if file.is_file() and file.name != "config.json" and not file.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(file, tmp / file.name)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kept = plan.num_tensors - len(plan.quantize) - len(plan.drop)
    return Converted(out, method.name, len(plan.quantize), kept, len(plan.drop), num_shards, shards.total_bytes)


@torch.no_grad()
def _write_weights(model_dir: HFModelDir, plan: Plan, method: QuantMethod, device: torch.device,
                   shards: ShardWriter, bar: tqdm) -> None:
    """Each checkpoint tensor, one at a time: quantized on ``device``, copied, or dropped, as ``plan`` says."""
    for file in model_dir.weight_files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in plan.quantize:
                    stem = name.removesuffix("weight")
                    for key, value in method.quantize(f.get_tensor(name).to(device)).items():
                        shards.add(stem + key, value.to("cpu"))
                elif name not in plan.drop:
                    shards.add(name, f.get_tensor(name))
                bar.update(1)


def _method(quantization: str) -> QuantMethod:
    """The method ``--quantization`` quantizes with, with its in-situ options."""
    hook_registry()  # quantization methods from hook plugins
    name, options = IN_SITU[quantization]
    methods = all_quant_methods()
    if name not in methods:
        raise ChituError(f"--quantization {quantization} quantizes with method {name!r}, which is not installed "
                         f"(installed: {', '.join(sorted(methods))})")
    if name not in CHECKPOINT_FORMATS:
        raise ChituError(f"quantization method {name!r} has no checkpoint format convert can write; it writes "
                         f"{', '.join(sorted(CHECKPOINT_FORMATS))}")
    return methods[name](dict(options))


def _check_output(src: Path, out: Path, force: bool) -> None:
    if out.resolve() == src.resolve():
        raise ChituError(f"the output {out} is the model directory itself; write the quantized checkpoint elsewhere")
    if out.exists() and not force:
        raise ChituError(f"{out} exists already; pass --force to replace it, or choose another output directory")
    if out.exists() and not out.is_dir():
        raise ChituError(f"{out} exists and is not a directory; remove it or choose another output directory")


def _device(name: str) -> torch.device:
    """The torch device of backend ``name`` ("auto": the highest-priority available one)."""
    from chitu_core.plugins.discovery import get_backend

    backend = get_backend(name)
    backend.set_device(0)
    return backend.device(0)


def _hidden_sibling(out: Path, kind: str) -> Path:
    """A new directory ``.NAME.XXXXXXXX.kind`` beside ``out``, with the permissions the umask gives
    (as the output directory's own; tempfile's would be private to this user)."""
    while True:
        path = out.parent / f".{out.name}.{secrets.token_hex(4)}.{kind}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first (and back if that fails), then removed."""
    if not out.exists():
        tmp.rename(out)
        return
    aside = _hidden_sibling(out, "old")
    out.rename(aside / out.name)
    try:
        tmp.rename(out)
    except BaseException:
        (aside / out.name).rename(out)
        raise
    shutil.rmtree(aside, ignore_errors=True)


# --- command line ----------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """"2GiB", "500MB", "1048576" -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match[2].lower() not in _UNITS or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2GiB, 500MB or a number of bytes")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chitu_core.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="HF model directory with a 16-bit checkpoint (config.json + *.safetensors)")
    parser.add_argument("output", help="directory to write the quantized checkpoint to")
    parser.add_argument("--quantization", required=True, choices=list(IN_SITU),
                        help="fp8: FP8 e4m3 in 128x128 blocks; int8: int8 per channel (W8A8, compressed-tensors); "
                        "int4: 4-bit in groups of 128 (AWQ GEMM)")
    parser.add_argument("--device", default="cpu", help="backend to quantize on: a name `python -m chitu_core.plugins` lists, or auto (default: cpu)")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES, metavar="SIZE",
                        help="largest safetensors shard, e.g. 2GiB (the default) or 500MB")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        done = convert(args.model, args.output, args.quantization, device=args.device, force=args.force,
                       max_shard_bytes=args.max_shard_size, progress=not args.quiet)
    except ChituError as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"convert: interrupted; {args.output} was not written", file=sys.stderr)
        return 130
    print(f"wrote {done.path}: {done.quantized} linear weights quantized ({done.method}), {done.kept} tensors kept, "
          f"{done.total_bytes / 2**30:.2f} GiB in {done.shards} shard(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
