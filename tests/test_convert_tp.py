"""``python -m chitu_core.convert --tp N``: a checkpoint split for N tensor-parallel ranks ahead of time.

A tiny random Llama (heads of 128 so that FP8 blocks and 4-bit groups fit each rank's q, k, v and
gate/up; a vocabulary of 509, which two ranks split unevenly) is converted for two ranks with
``--quantization none``, fp8, int8 and int4, a dense DeepSeek-V3 (latent attention, replicated
LoRA projections) with none, and a Qwen3-MoE (4 routed experts of intermediate size 256: 128 rows a
rank, one FP8 block) with none and fp8. Checked exactly: the layout (config.json at the top with the
sharding recorded, the small files once, rank-r/ with its weights), each rank's tensors named as the
unsplit checkpoint's and shaped as the format's published layout gives for that rank's slice of the
weight (``test_convert.LAYOUTS``, written out by hand), each equal bit for bit to its slice of the
unsplit conversion; then two gloo ranks on CPU load the pre-sharded directory and the unsplit one into
the same parameters, and so give equal last-token logits and greedy tokens. A world size other than
the directory's is a one-line error; a model convert cannot split (a head count the ranks do not
divide, a fused part or a rank's share of the experts that starts inside an FP8 block) is refused
before anything is written.
"""

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from builders import build_model, save_tokenizer
from test_communicator import free_port
from test_convert import LAYOUTS, save_random, tensors

from chitu_core import LLM, SamplingParams
from chitu_core.convert import convert, main
from chitu_core.errors import ChituError, ModelLoadError
from chitu_core.loader.hf import open_model_dir

FORMATS = {"none": "none", "fp8": "fp8", "int8": "int8", "int4": "awq"}  # --quantization -> format written
LLAMA = {"vocab_size": 509, "hidden_size": 512, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2}
PROMPTS = [[1, 2, 3, 4, 5], [7] * 9, list(range(10, 40))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    build_model(path, "llama", **LLAMA)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def converted(llama, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """--quantization -> (converted for two ranks, converted unsplit); none's unsplit one is the original.
    none is written in shards of at most 1 MB, so that each rank gets several and an index."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for q in FORMATS:
        small = {"max_shard_bytes": 10**6} if q == "none" else {}
        convert(llama, root / f"{q}-tp2", q, tp=2, progress=False, **small)
        whole = llama if q == "none" else convert(llama, root / q, q, progress=False).path
        out[q] = root / f"{q}-tp2", whole
    return out


def expected_local_shapes(whole: dict[str, torch.Tensor], fmt: str, rank: int) -> dict[str, tuple[int, ...]]:
    """Each tensor of rank ``rank`` of two: a linear's tensors as the format lays out that rank's slice
    of the weight ([N/2, K] for q, k, v, gate and up; [N, K/2] for o and down), the embedding and LM head
    rows [0, 255) or [255, 509), everything else whole."""
    out = {}
    for name, t in whole.items():
        if name.endswith("_layernorm.weight") or name == "model.norm.weight":
            out[name] = tuple(t.shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = ((255, 254)[rank], 512)
    n = {"q": 512, "k": 256, "v": 256, "o": 512, "gate": 512, "up": 512, "down": 512}
    for layer in range(2):
        for proj, rows in n.items():
            stem = f"model.layers.{layer}.{'mlp' if proj in ('gate', 'up', 'down') else 'self_attn'}.{proj}_proj."
            local = (rows // 2, 512) if proj not in ("o", "down") else (rows, 256)
            layout = LAYOUTS[fmt](*local) if fmt != "none" else {"weight": (torch.float32, local)}
            out |= {stem + key: shape for key, (_, shape) in layout.items()}
    return out


@pytest.mark.parametrize("quantization", list(FORMATS))
def test_each_rank_holds_exactly_its_slice_of_the_unsplit_conversion(converted, llama, quantization):
    split, unsplit = converted[quantization]
    assert sorted(p.name for p in split.iterdir()) == sorted(
        [p.name for p in llama.iterdir() if not p.name.startswith("model")] + ["rank-0", "rank-1"])
    for name in ("tokenizer.json", "generation_config.json"):
        assert (split / name).read_bytes() == (llama / name).read_bytes()
    config, reference = (json.loads((p / "config.json").read_text()) for p in (split, unsplit))
    assert config == {**reference, "chitu_tensor_parallel": {"size": 2}}

    whole = tensors(unsplit)
    parts = [tensors(split / f"rank-{r}") for r in range(2)]
    for rank, part in enumerate(parts):
        assert {n: tuple(t.shape) for n, t in part.items()} == expected_local_shapes(whole, FORMATS[quantization], rank)
    assert_slices(whole, parts)
    if quantization == "none":  # 1 MB shards: several a rank, with their index
        for rank in range(2):
            files = sorted(p.name for p in (split / f"rank-{rank}").iterdir())
            n = len(files) - 1
            assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] + [
                "model.safetensors.index.json"]
    else:
        assert all(sorted(p.name for p in (split / f"rank-{r}").iterdir()) == ["model.safetensors"] for r in range(2))


def assert_slices(whole: dict[str, torch.Tensor], parts: list[dict[str, torch.Tensor]]) -> None:
    """Each rank's tensor is, bit for bit, its slice of the unsplit one: along the one dimension where
    their shapes differ, rank r's starting after rank 0's."""
    for rank, part in enumerate(parts):
        for name, t in part.items():
            full = whole[name]
            assert t.dtype == full.dtype, name
            dims = [d for d in range(t.dim()) if t.shape[d] != full.shape[d]]
            assert len(dims) <= 1, name
            if dims:
                dim = dims[0]
                full = full.narrow(dim, rank * parts[0][name].shape[dim], t.shape[dim])
            assert torch.equal(t.view(torch.uint8), full.contiguous().view(torch.uint8)), (rank, name)


# --- a MoE model --------------------------------------------------------------------------------------

MOE = {"vocab_size": 509, "hidden_size": 256, "head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
       "intermediate_size": 256, "moe_intermediate_size": 256, "num_experts": 4, "num_experts_per_tok": 2,
       "norm_topk_prob": True, "num_hidden_layers": 2, "mlp_only_layers": [1], "max_position_embeddings": 512}


def build_qwen3_moe(path: Path, **overrides) -> Path:
    """A random Qwen3-MoE (layer 0 MoE, layer 1 dense; heads of 128, so FP8 blocks fit each rank's q,
    k and v)."""
    import transformers as tf

    return save_random(tf.Qwen3MoeConfig(**{**MOE, **overrides}), path)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """--quantization (none, fp8) -> (the Qwen3-MoE converted for two ranks, converted unsplit); none's
    unsplit one is the original."""
    root = tmp_path_factory.mktemp("moe")
    src = build_qwen3_moe(root / "src")
    return {q: (convert(src, root / f"{q}-tp2", q, tp=2, progress=False).path,
                src if q == "none" else convert(src, root / q, q, progress=False).path) for q in ("none", "fp8")}


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_each_rank_holds_its_slice_of_every_expert(moe, quantization):
    split, unsplit = moe[quantization]
    whole = tensors(unsplit)
    parts = [tensors(split / f"rank-{r}") for r in range(2)]
    fmt = FORMATS[quantization]
    for rank, part in enumerate(parts):
        assert part.keys() == whole.keys()
        for e in range(4):  # gate and up: rows [128 r, 128 (r + 1)); down: those columns
            for proj, local in (("gate", (128, 256)), ("up", (128, 256)), ("down", (256, 128))):
                stem = f"model.layers.0.mlp.experts.{e}.{proj}_proj."
                layout = LAYOUTS[fmt](*local) if fmt != "none" else {"weight": (torch.float32, local)}
                assert {key: (part[stem + key].dtype, tuple(part[stem + key].shape)) for key in layout} == layout
    assert_slices(whole, parts)


# --- two ranks load it ------------------------------------------------------------------------------


def _load(path: Path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", load_progress=False, num_threads=1, kv_cache_memory=8 << 20)


def _rank_run(rank: int, port: int, cases: dict[str, tuple[str, str]], out: str) -> None:
    """On each rank, for each case: the pre-sharded and the unsplit directory's parameters, last-token
    logits and greedy tokens, and the files this rank's engine reads; saved to ``out``.rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist
    from test_models import batched_last_logits

    results = {}
    for case, (split, unsplit) in cases.items():
        runs = []
        for path in (split, unsplit):
            llm = _load(Path(path))
            model = llm.engine.model
            state = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
            tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
            runs.append((state, batched_last_logits(llm, PROMPTS), tokens, llm.engine.tokenizer is not None))
            del llm
        files = [str(f.relative_to(split)) for f in open_model_dir(split).for_rank(rank, 2).weight_files]
        results[case] = runs, files
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[Path, Path]:
    """A dense DeepSeek-V3 (latent attention, q LoRA) and its conversion for two ranks."""
    from test_deepseek import build_deepseek

    path = tmp_path_factory.mktemp("deepseek")
    build_deepseek(path / "src", "v3-dense-neox")
    return convert(path / "src", path / "tp2", tp=2, progress=False).path, path / "src"


def test_two_ranks_load_the_presharded_directory_as_the_unsplit_one(converted, deepseek, moe, tmp_path):
    cases = {q: (str(split), str(unsplit)) for q, (split, unsplit) in converted.items()}
    cases["deepseek"] = tuple(map(str, deepseek))
    cases |= {f"moe-{q}": (str(split), str(unsplit)) for q, (split, unsplit) in moe.items()}
    mp.spawn(_rank_run, args=(free_port(), cases, str(tmp_path / "out")), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"out.{rank}")
        for case, (runs, _) in results.items():
            (state, logits, tokens, tokenizer), (state1, logits1, tokens1, _) = runs
            assert state.keys() == state1.keys()
            assert [n for n in state if not torch.equal(state[n], state1[n])] == [], (case, rank)
            assert torch.equal(logits, logits1), (case, rank, (logits - logits1).abs().max())
            assert tokens == tokens1 and len(tokens[0]) == GREEDY.max_tokens, (case, rank)
            assert tokenizer == (case in FORMATS), (case, rank)  # read from the top of the directory
        files = {case: f for case, (_, f) in results.items()}
        assert files["fp8"] == [f"rank-{rank}/model.safetensors"]
        assert files["none"][0] == f"rank-{rank}/model-00001-of-{len(files['none']):05d}.safetensors"


# --- refusals ---------------------------------------------------------------------------------------


def test_a_world_size_other_than_the_directorys_is_a_one_line_error(converted):
    split, _ = converted["fp8"]
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(split))} is pre-sharded for 2 tensor-parallel ranks "
                                             r"\(python -m chitu_core.convert --tp 2\) but this run has 1: run it on "
                                             r"2 ranks, or convert the original checkpoint again without --tp$"):
        _load(split)
    with pytest.raises(ModelLoadError, match=r"^.* is pre-sharded for 2 tensor-parallel ranks \(python -m "
                                             r"chitu_core.convert --tp 2\) but this run has 3: run it on 2 ranks, or "
                                             r"convert the original checkpoint again with --tp 3$"):
        open_model_dir(split).for_rank(0, 3)
    with pytest.raises(ChituError, match=r"is pre-sharded already \(for 2 tensor-parallel ranks\); convert reads an "
                                         r"unsharded checkpoint$"):
        convert(converted["none"][0], split.parent / "again", "fp8")


def test_what_convert_cannot_split_is_refused_before_anything_is_written(llama, tmp_path):
    build_qwen3_moe(tmp_path / "moe", moe_intermediate_size=128)  # 64 rows a rank: half an FP8 block
    convert(tmp_path / "moe", tmp_path / "fits-moe", "fp8", progress=False)  # unsplit, 128 rows: it fits
    with pytest.raises(ChituError, match=r"^Qwen3MoeForCausalLM cannot be split over 2 tensor-parallel ranks: fp8 MoE "
                                         r"experts: 64 intermediate rows per rank \(moe intermediate size 128 over 2 "
                                         r"tensor-parallel rank\(s\)\) is not a multiple of the checkpoint's 128x128"):
        convert(tmp_path / "moe", tmp_path / "out", "fp8", tp=2, progress=False)
    with pytest.raises(ChituError, match=r"^LlamaForCausalLM cannot be split over 3 tensor-parallel ranks: "
                                         r"num_attention_heads=4 is not divisible by the tensor-parallel size 3$"):
        convert(llama, tmp_path / "out", "fp8", tp=3, progress=False)
    build_model(tmp_path / "small", "llama", hidden_size=256, intermediate_size=256)  # 4 heads of 64, 2 kv heads
    convert(tmp_path / "small", tmp_path / "fits", "fp8", progress=False)  # unsplit, v starts at row 384: it fits
    with pytest.raises(ChituError, match=r"^model.layers.0.self_attn.qkv_proj: its part 'v' starts at output 192, "
                                         r"inside one of the 128-output elements of the fp8 tensor 'weight_scale_inv'"):
        convert(tmp_path / "small", tmp_path / "out", "fp8", tp=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fits", "fits-moe", "moe", "small"]
    with pytest.raises(ChituError, match=r"^nothing to do: give --quantization \(fp8, int8, int4\), --tp N \(N > 1\), "
                                         r"or both$"):
        convert(llama, tmp_path / "out", "none")


def test_the_command_line(llama, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(llama), str(out), "--tp", "2", "--quiet"]) == 0
    assert re.fullmatch(rf"wrote {re.escape(str(out))}: 21 tensors, split for 2 tensor-parallel ranks, 0\.\d\d GiB "
                        r"in 2 shard\(s\)\n", capsys.readouterr().out)
    assert main([str(llama), str(tmp_path / "q"), "--tp", "2", "--quantization", "int8", "--quiet"]) == 0
    assert re.fullmatch(r"wrote .*: 14 linear weights quantized \(int8\), 7 tensors kept, split for 2 "
                        r"tensor-parallel ranks, 0\.\d\d GiB in 2 shard\(s\)\n", capsys.readouterr().out)
