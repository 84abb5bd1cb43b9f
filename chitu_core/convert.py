"""``python -m chitu_core.convert MODEL OUTPUT --quantization fp8|int8|int4|none [--tp N]``: quantize a
16-bit HF checkpoint once, and/or split it for N tensor-parallel ranks, into a directory the engine
then loads as it is.

Which tensors are quantized is the model's own answer. Its class (from the model plugin) is built on
torch's ``meta`` device, which allocates nothing, and a checkpoint tensor is quantized exactly when it
is the ``weight`` of one of its linear layers (``LinearBase``, found through ``map_weight_name``), or
one routed expert's projection (``experts.{e}.gate_proj.weight``, loaded into a ``FusedMoE``) where the
method holds experts (``QuantMethod.holds_experts``: fp8). Everything else (embeddings, LM head, norms,
MoE routers, and the routed experts of a method that holds none: int8, int4) is copied in its own
dtype and listed in the config's ignore field; tensors the model skips (``CausalLM.skip_weight``) are
left out.

The method and its options are the in-situ choice of ``--quantization`` (``quantization.select.IN_SITU``).
Each such weight ``X.weight`` becomes the tensors ``QuantMethod.quantize`` returns, named ``X.<key>``
(``X.weight`` and ``X.weight_scale_inv`` for fp8; an expert's gate, up and down each on its own, as
DeepSeek-V3's FP8 checkpoints store them), so that loading the result computes what quantizing in situ
does. In situ, fp8 quantizes each expert's gate and up as one [2I, H] matrix, whose 128-row blocks are
gate's or up's alone only where I is a multiple of 128; that is also what ``FusedMoE`` needs to load
such a checkpoint, so convert refuses other sizes (``_check_experts``). config.json gets the
``quantization_config`` the format's own producers write (``CHECKPOINT_FORMATS``); tokenizer files,
generation_config.json and the other small files are copied.

Streaming: one tensor at a time is read, quantized on ``--device`` and added to safetensors shards of at
most ``--max-shard-size`` (with an index json where there are several, as ``save_pretrained`` writes).
All of it goes into a hidden directory beside OUTPUT, renamed to OUTPUT at the end: an interrupted run
leaves no OUTPUT behind, and an existing one (replaced only with ``--force``) stays until then.

``--tp N`` (N > 1) pre-shards: each tensor, once quantized, is split into the part each rank holds and
written to ``rank-{r}/`` (its own shards and index); config.json (with ``"chitu_tensor_parallel":
{"size": N}``) and the small files stay at the top (``loader.hf``). The parts are the loaders' own:
the model is built on ``meta`` for each rank as the engine builds it to load the result, and a
checkpoint tensor's part is its parameter's ``local_part`` (``layers.weights.set_loader``), or the
whole tensor for a replicated parameter; fused layers' parts (q/k/v, gate/up) and each expert's
projections keep their checkpoint names. Every tensor's split is tried on empty tensors before
anything is written.
"""

import argparse
import json
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from chitu_core.convert_parts import (
    RankParts,
    ShardWriter,
    SkeletonBackend,
    build_skeleton,
)
from chitu_core.errors import ChituError
from chitu_core.layers.linear import LinearBase
from chitu_core.layers.moe import FusedMoE
from chitu_core.loader.hf import (
    TENSOR_PARALLEL_FIELD,
    HFModelDir,
    open_model_dir,
    rank_dir,
    read_header,
)
from chitu_core.plugins.discovery import hook_registry
from chitu_core.quantization import QuantMethod
from chitu_core.quantization.registry import all_quant_methods
from chitu_core.quantization.select import (
    IN_SITU,
    select_quantization,
)

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


@dataclass
class Plan:
    """What happens to each checkpoint tensor: quantized, dropped, or (the rest) copied as it is."""

    quantize: set[str]  # checkpoint names of the linear layers' weights and, where the method holds them, experts'
    drop: set[str]  # tensors the model skips (stale RoPE tables, DeepSeek-V3's multi-token-prediction layer)
    ignored: Ignored
    num_tensors: int


def plan_checkpoint(model_dir: HFModelDir, method: QuantMethod | None, quantization: str) -> Plan:
    """Find the weights to quantize (none where ``method`` is None), checking that they are floating
    point, that every tensor is one of the model's, and that the format can hold the model's fused
    layers and experts as our loader puts them."""
    model = build_skeleton(model_dir)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}  # tied ones too
    linears = {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
    experts = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)} \
        if method is not None and method.holds_experts else {}
    if method is not None:
        _check_fused_parts(linears, method, quantization)
        _check_experts(experts, method)
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
            elif method is not None and name.endswith(".weight") and (
                    module in linears and leaf == "weight" or module in experts and leaf in ("w13", "w2")):
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


def _check_experts(layers: Mapping[str, FusedMoE], method: QuantMethod) -> None:
    """The format holds each MoE layer's experts as ``FusedMoE`` loads them: the method makes the
    layer's parameters, and refuses sizes it cannot hold (fp8: gate's and up's rows on whole 128-row
    blocks, so that I is a multiple of 128; then each block is gate's or up's, as in situ, where the
    [2I, H] matrix is quantized whole)."""
    for name, layer in layers.items():
        holder = nn.Module()
        holder.tp_size = layer.tp_size  # as FusedMoE: the method checks a rank's share
        try:
            method.create_expert_weights(holder, layer.num_experts, layer.hidden_size, layer.local_inter,
                                         torch.float32, torch.device("meta"))
        except ChituError as exc:
            raise ChituError(f"{name}: its routed experts cannot be stored as {method.name}: {exc}") from None


def _meta_outputs(model_dir: HFModelDir, plan: Plan, method: QuantMethod | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The converted checkpoint's tensors, by name, as empty ``meta`` tensors of their shapes."""
    meta = torch.device("meta")
    for file in model_dir.weight_files:
        for name, info in read_header(file).items():
            if name in plan.quantize:
                holder = nn.Module()
                out_features, in_features = info["shape"]
                method.create_checkpoint_weights(holder, in_features, out_features, torch.float32, meta)
                for key, param in holder.named_parameters():
                    yield name.removesuffix("weight") + key, param
            elif name not in plan.drop:
                yield name, torch.empty(info["shape"], device=meta)


# --- writing ---------------------------------------------------------------------------------------


@dataclass
class Converted:
    """What ``convert`` wrote."""

    path: Path
    method: str  # "unquantized" for --quantization none
    quantized: int  # weights quantized (linear layers', routed experts' projections)
    kept: int  # tensors copied as they are
    dropped: int  # tensors the model skips, left out
    shards: int  # safetensors files, over every rank
    total_bytes: int
    tp: int = 1  # tensor-parallel ranks it is split for


def convert(model: str | Path, output: str | Path, quantization: str | None = None, *, tp: int = 1,
            device: str = "cpu", force: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            progress: bool = True) -> Converted:
    """Quantize the 16-bit checkpoint in ``model`` with ``--quantization``'s method (None or "none":
    as it is) and split it for ``tp`` tensor-parallel ranks, into ``output`` (see the module
    docstring). Refuses to replace an existing ``output`` unless ``force``."""
    quantization = None if quantization == "none" else quantization
    if quantization is not None and quantization not in IN_SITU:
        raise ChituError(f"unknown --quantization {quantization!r}; choose one of {', '.join(IN_SITU)}")
    if not isinstance(tp, int) or tp < 1:
        raise ChituError(f"--tp {tp!r}: the tensor-parallel size is a positive integer")
    if quantization is None and tp == 1:
        raise ChituError(f"nothing to do: give --quantization ({', '.join(IN_SITU)}), --tp N (N > 1), or both")
    src, out = Path(model).expanduser(), Path(output).expanduser()
    model_dir = open_model_dir(src)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config") is not None:
        fmt = config["quantization_config"].get("quant_method")
        raise ChituError(f"{src} is quantized already (its config.json's quantization_config is {fmt!r}); "
                         "convert reads 16-bit checkpoints only")
    if model_dir.presharded:
        raise ChituError(f"{src} is pre-sharded already (for {model_dir.sharded_for} tensor-parallel ranks); "
                         "convert reads an unsharded checkpoint")
    method = _method(quantization) if quantization is not None else None
    _check_output(src, out, force)
    dev = _device(device) if method is not None else torch.device("cpu")
    plan = plan_checkpoint(model_dir, method, quantization)
    if method is not None:
        config["quantization_config"] = CHECKPOINT_FORMATS[method.name](method.options, plan.ignored)
    ranks = None
    if tp > 1:
        quant = select_quantization(SimpleNamespace(quantization_config=config.get("quantization_config")), None,
                                    SkeletonBackend())
        ranks = RankParts(model_dir, quant, tp)
        if method is not None:
            _check_fused_parts(ranks.linears(), method, quantization)
        for name, tensor in _meta_outputs(model_dir, plan, method):  # every split tried before anything is written
            ranks.split(name, tensor)
        config[TENSOR_PARALLEL_FIELD] = {"size": tp}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_sibling(out, "partial")
    try:
        dirs = [tmp] if tp == 1 else [rank_dir(tmp, rank) for rank in range(tp)]
        for d in dirs:
            d.mkdir(exist_ok=True)
        writers = [ShardWriter(d, max_shard_bytes) for d in dirs]
        desc = (f"Quantizing ({quantization})" if quantization else "Splitting") + (f" for {tp} ranks" if tp > 1 else "")
        with tqdm(total=plan.num_tensors, desc=desc, unit="tensor", disable=not progress) as bar:
            _write_weights(model_dir, plan, method, dev, writers, ranks, bar)
        num_shards = sum(w.finish() for w in writers)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in sorted(src.iterdir()):
            if file.is_file() and file.name != "config.json" and not file.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(file, tmp / file.name)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kept = plan.num_tensors - len(plan.quantize) - len(plan.drop)
    return Converted(out, method.name if method else "unquantized", len(plan.quantize), kept, len(plan.drop),
                     num_shards, sum(w.total_bytes for w in writers), tp)


@torch.no_grad()
def _write_weights(model_dir: HFModelDir, plan: Plan, method: QuantMethod | None, device: torch.device,
                   writers: list[ShardWriter], ranks: RankParts | None, bar: tqdm) -> None:
    """Each checkpoint tensor, one at a time: quantized on ``device``, copied, or dropped, as ``plan``
    says; then whole into the one writer, or each rank's part into its writer (``ranks``)."""
    for file in model_dir.weight_files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in plan.quantize:
                    stem = name.removesuffix("weight")
                    outputs = {stem + key: value.to("cpu")
                               for key, value in method.quantize(f.get_tensor(name).to(device)).items()}
                elif name not in plan.drop:
                    outputs = {name: f.get_tensor(name)}
                else:
                    outputs = {}
                for out_name, tensor in outputs.items():
                    parts = [tensor] if ranks is None else ranks.split(out_name, tensor)
                    for writer, part in zip(writers, parts):
                        # a slice is copied, so that the shard being written holds no more than its parts
                        writer.add(out_name, part.clone() if part.numel() < tensor.numel() else part)
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
    parser.add_argument("output", help="directory to write the converted checkpoint to")
    parser.add_argument("--quantization", choices=[*IN_SITU, "none"],
                        help="fp8: FP8 e4m3 in 128x128 blocks; int8: int8 per channel (W8A8, compressed-tensors); "
                        "int4: 4-bit in groups of 128 (AWQ GEMM); none (the default): as it is, with --tp")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="split for N tensor-parallel ranks: rank r's weights in OUTPUT/rank-r, which the engine "
                        "loads on exactly N ranks (default: 1, unsplit)")
    parser.add_argument("--device", default="cpu", help="backend to quantize on: a name `python -m chitu_core.plugins` lists, or auto (default: cpu)")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES, metavar="SIZE",
                        help="largest safetensors shard, e.g. 2GiB (the default) or 500MB")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        done = convert(args.model, args.output, args.quantization, tp=args.tp, device=args.device, force=args.force,
                       max_shard_bytes=args.max_shard_size, progress=not args.quiet)
    except ChituError as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"convert: interrupted; {args.output} was not written", file=sys.stderr)
        return 130
    what = f"{done.quantized} linear weights quantized ({done.method}), {done.kept} tensors kept" if done.quantized \
        else f"{done.kept} tensors"
    split = f", split for {done.tp} tensor-parallel ranks" if done.tp > 1 else ""
    print(f"wrote {done.path}: {what}{split}, {done.total_bytes / 2**30:.2f} GiB in {done.shards} shard(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
