"""Transposed dense weights (``Backend.transposed_linear_weights``): the linear layers and an untied
LM head change strides, never values; a tied head keeps the embedding's rows; generation is unchanged."""

import pytest
from chitu_cpu.backend import CpuBackend

from builders import build_model
from chitu_core import LLM, SamplingParams
from chitu_core.layers.embedding import LMHead, VocabEmbedding
from chitu_core.layers.linear import LinearBase


def generate(path, monkeypatch, transposed: bool):
    monkeypatch.setattr(CpuBackend, "transposed_linear_weights", lambda self: transposed)
    llm = LLM(path, device="cpu", dtype="float32", load_progress=False)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [3 + i for i in range(n)]} for n in (5, 19)], params)
    return llm.engine.model, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]


@pytest.mark.parametrize("arch", ["llama", "llama-tied"])
def test_transposed_weights_change_strides_not_results(tmp_path, monkeypatch, arch):
    build_model(tmp_path, arch)
    plain_model, plain = generate(tmp_path, monkeypatch, False)
    model, got = generate(tmp_path, monkeypatch, True)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    head = next(m for m in model.modules() if isinstance(m, LMHead))
    embedding = next(m for m in model.modules() if isinstance(m, VocabEmbedding) and not isinstance(m, LMHead))
    assert embedding.weight.is_contiguous()
    assert head.weight.is_contiguous() == (arch == "llama-tied")
    for (name, p), (_, q) in zip(model.named_parameters(), plain_model.named_parameters(), strict=True):
        assert p.shape == q.shape and p.equal(q), name
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, plain, strict=True):
        assert tokens == want_tokens
        for a, b in zip(logprobs, want_logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
