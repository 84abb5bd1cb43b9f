"""The CPU backend's Q8_0 vocabulary head kernel (``chitu_cpu.gguf_head``) and the tied head that uses it
(``chitu_cpu.packed.Q8_0Head``).

The kernel is held to a float64 product with weights from ``gguf``'s own dequantizer (an independent
decoder of the blocks), by normalized error: float32 x within NMSE_F32 (float32 sums of 32 to 576 products:
observed ~1e-14), bfloat16 x within NMSE_BF16 (y is rounded to bfloat16: observed ~3e-6). A kernel that
takes each row's first scale for every block is far outside both (it is built and checked here).
"""

import numpy as np
import pytest
import torch
from torch import nn

from chitu_core import LLM
from chitu_core.layers.context import StepContext
from chitu_core.loader.gguf import default_model_file
from chitu_core.quantization.gguf import GGUFMethod
from chitu_core.quantization.gguf_blocks import Q4_1, Q8_0, random_blocks
from chitu_cpu import gguf_head
from chitu_cpu.gguf_head import q8_0_head, q8_0_head_op
from chitu_cpu.native import build
from chitu_cpu.packed import ExactTopHead, Q8_0Head, pack_linear

gguf = pytest.importorskip("gguf")

NMSE_F32 = 1e-11
NMSE_BF16 = 1e-5


def _blocks(n: int, k: int, seed: int) -> torch.Tensor:
    return random_blocks(Q8_0, n, k, torch.Generator().manual_seed(seed))


def _reference(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x @ W^T in float64, W from the gguf package's dequantization."""
    w = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q8_0)
    return x.double() @ torch.from_numpy(np.ascontiguousarray(w)).double().t()


def _nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).pow(2).sum() / want.pow(2).sum()).item()


@pytest.mark.parametrize("dtype, bound", [(torch.float32, NMSE_F32), (torch.bfloat16, NMSE_BF16)], ids=str)
@pytest.mark.parametrize("k", [32, 96, 576])
@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_the_kernel_is_the_blocks_exact_product(m, k, dtype, bound):
    # 200 rows: several 64-row chunks, the last a part one, and rows left over after the 4- and 8-row tiles
    blocks = _blocks(200, k, seed=m * 1000 + k)
    x = torch.randn(m, k).to(dtype)
    got = q8_0_head(x, blocks)
    assert got.shape == (m, 200) and got.dtype == dtype
    assert _nmse(got, _reference(x, blocks)) <= bound


def test_rows_of_x_with_a_stride_are_read_as_they_lie():
    blocks, wide = _blocks(64, 96, seed=1), torch.randn(5, 160)
    x = wide[:, 32:128]  # row stride 160
    assert _nmse(q8_0_head(x, blocks), _reference(x, blocks)) <= NMSE_F32


def test_a_kernel_with_a_wrong_scale_fails_the_bound():
    """The bound can tell: every block taking its row's first scale (one misplaced index) is far outside it."""
    wrong = gguf_head._SOURCE.replace("half(p)", "half(p - b * BYTES)").replace("SCALAR", "float")
    assert wrong != gguf_head._SOURCE.replace("SCALAR", "float")
    kernel = build("chitu_q8_0_head_wrong_scale", wrong, ["const float*", "const uint8_t*", "float*"] + ["const int64_t"] * 6)
    blocks = _blocks(64, 96, seed=2)
    for m in (1, 16):
        x, y = torch.randn(m, 96), torch.empty(m, 64)
        kernel(x.data_ptr(), blocks.data_ptr(), y.data_ptr(), m, 64, 96, 96, blocks.stride(0), 1)
        assert _nmse(y, _reference(x, blocks)) > 1e3 * NMSE_BF16


def _tied_head(n: int, k: int, seed: int, qtype: int = Q8_0) -> tuple[GGUFMethod, nn.Module]:
    method, layer = GGUFMethod({"qtype": qtype}), nn.Module()
    method.create_weights(layer, k, n, torch.float32, torch.device("cpu"))
    layer.qweight.data.copy_(random_blocks(qtype, n, k, torch.Generator().manual_seed(seed)))
    layer.tied = nn.Module()  # what LMHead.tie sets: the embedding keeps the blocks anyway
    return method, layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_tied_q8_0_head_reads_the_embeddings_blocks(dtype):
    method, layer = _tied_head(72, 128, seed=3)  # 72 rows: not a multiple of 16, no dense copy either
    head = pack_linear(method, layer, dtype)
    assert isinstance(head, Q8_0Head)
    assert head.tensors()["qweight"].data_ptr() == layer.qweight.data_ptr()  # no copy
    x, bias = torch.randn(2, 3, 128).to(dtype), torch.randn(72).to(dtype)
    got = head(x, bias)
    assert got.shape == (2, 3, 72) and got.dtype == dtype
    want = _reference(x.reshape(6, 128), layer.qweight) + bias.double()
    assert _nmse(got.reshape(6, 72), want) <= (NMSE_F32 if dtype == torch.float32 else NMSE_BF16)
    assert type(pack_linear(*_tied_head(64, 128, 4, Q4_1), dtype)) is ExactTopHead  # other types: packed


def test_in_a_compiled_function_the_head_is_one_opaque_op():
    method, layer = _tied_head(64, 96, seed=5)
    head = pack_linear(method, layer, torch.float32)
    x = torch.randn(4, 96)
    torch._dynamo.reset()
    compiled = torch.compile(lambda h: head(h * 2.0, None), fullgraph=True, dynamic=True)
    assert _nmse(compiled(x), _reference(x * 2.0, layer.qweight)) <= NMSE_F32
    assert _nmse(compiled(x[:1]), _reference(x[:1] * 2.0, layer.qweight)) <= NMSE_F32
    assert q8_0_head_op(x, layer.qweight).shape == (4, 64)


def test_without_a_compiler_a_tied_q8_0_head_is_packed(monkeypatch, caplog):
    """No C++ compiler: one warning that names it, then the int4pack head that recomputes its top logits."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    gguf_head.head_kernel.cache_clear()
    try:
        method, layer = _tied_head(64, 96, seed=6)
        with caplog.at_level("WARNING"):
            head = pack_linear(method, layer, torch.float32)
        assert isinstance(head, ExactTopHead) and "no-such-compiler" in caplog.text
        x = torch.randn(3, 96)
        want = _reference(x, layer.qweight)
        assert torch.equal(head(x, None).argmax(-1), want.argmax(-1))
    finally:
        gguf_head.head_kernel.cache_clear()


@pytest.fixture(scope="module")
def embedded():
    """The embedded SmolLM2 (Q8_0 embedding tied to the head), its linears packed or not."""
    opts = dict(num_threads=2, load_progress=False, max_model_len=256, max_num_seqs=4, dtype="float32")
    return LLM(str(default_model_file()), **opts), LLM(str(default_model_file()), pack_linear=False, **opts)


def test_the_embedded_models_head_gives_the_unpacked_paths_logits(embedded):
    packed, unpacked = embedded
    assert isinstance(packed.engine.model.lm_head.packed, Q8_0Head)
    assert unpacked.engine.model.lm_head.packed is None
    engine = packed.engine
    prompts = [engine.tokenizer.encode(p) for p in ("The capital of France is", "def fib(n):", "1, 1, 2, 3, 5,")]
    from chitu_core import SamplingParams

    requests = [engine.add_request(f"head-{i}", p, SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)]
    token_ids, positions, meta = engine.runner.prepare(engine.scheduler.schedule())
    with torch.inference_mode():
        hidden = engine.model(token_ids, positions, StepContext(meta, engine.runner.kv_caches))
        rows = hidden[meta.query_start_loc[1:].long() - 1]
        got, want = packed.engine.model.compute_logits(rows), unpacked.engine.model.compute_logits(rows)
    for r in requests:
        engine.abort_request(r.request_id)
    assert got.shape == want.shape == (3, engine.model.lm_head.vocab_size)
    assert _nmse(got, want.double()) <= NMSE_F32
    assert torch.equal(got.argmax(-1), want.argmax(-1))
