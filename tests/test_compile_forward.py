"""``compile_forward`` (contract 1.7's ``Backend.compile_forward``): on the CPU, torch.compile of a tiny
Llama's forward, compiled while the engine starts, gives what the eager forward gives."""

import pytest

from builders import build_model
from chitu_core import LLM, SamplingParams
from chitu_core.backend import Backend
from test_models import PROMPTS, batched_last_logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile") / "hf"
    build_model(path, "llama")
    opts = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=128, max_num_seqs=8)
    return LLM(str(path), **opts), LLM(str(path), compile_forward=True, **opts)


def test_the_compiled_forward_matches_the_eager_one(pair):
    eager, compiled = pair
    assert "forward" in vars(compiled.engine.model) and "forward" not in vars(eager.engine.model)  # wrapped
    assert compiled.engine.stats.num_steps == 0 and not compiled.engine.has_unfinished()  # the warm-up left no trace
    a, b = batched_last_logits(eager, PROMPTS), batched_last_logits(compiled, PROMPTS)
    assert ((a - b).pow(2).sum() / a.pow(2).sum()).item() <= 1e-10
    batch, params = [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=12, temperature=0)
    assert [o.outputs[0].token_ids for o in eager.generate(batch, params)] == \
           [o.outputs[0].token_ids for o in compiled.generate(batch, params)]


def test_two_compiled_models_of_one_class_keep_their_own_graphs(pair, tmp_path):
    """The CPU backend skips Dynamo's guards on the model's modules (each engine compiles a forward of its
    own, and the guards Dynamo keeps still see constants): a second Llama of the same sizes but another
    norm epsilon (a constant inside the graph, held by the modules) must not run the first one's graphs.
    Dropping every guard fails it."""
    eager, _ = pair
    path = tmp_path / "hf"
    build_model(path, "llama", seed=1, rms_norm_eps=0.5)
    opts = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=128, max_num_seqs=8)
    other, other_compiled = LLM(str(path), **opts), LLM(str(path), compile_forward=True, **opts)
    a, b = batched_last_logits(other, PROMPTS), batched_last_logits(other_compiled, PROMPTS)
    assert ((a - b).pow(2).sum() / a.pow(2).sum()).item() <= 1e-10
    params = SamplingParams(max_tokens=12, temperature=0)
    for first, second in ((eager, pair[1]), (other, other_compiled)):
        batch = [{"prompt_token_ids": p} for p in PROMPTS]
        assert [o.outputs[0].token_ids for o in first.generate(batch, params)] == \
               [o.outputs[0].token_ids for o in second.generate(batch, params)]


def test_a_backend_without_a_compiler_runs_the_forward_as_it_is():
    forward = object()
    assert Backend.compile_forward(None, forward) is forward


def test_the_compiled_steps_own_asserts_run_only_when_ops_are_checked(monkeypatch):
    """The CPU's compiled step drops inductor's per-operator size, stride, alignment and scalar asserts,
    except under CHITU_CHECK_OPS=1; the names are inductor's own options (an unknown one makes torch.compile
    raise, so they are checked here against inductor's config)."""
    import torch._inductor.config as inductor_config
    from chitu_cpu.backend import compile_options

    asserts = ("size_asserts", "scalar_asserts", "alignment_asserts")
    assert all(hasattr(inductor_config, name) for name in asserts)
    monkeypatch.delenv("CHITU_CHECK_OPS", raising=False)
    assert [compile_options()[name] for name in asserts] == [False] * 3
    monkeypatch.setenv("CHITU_CHECK_OPS", "1")
    assert [compile_options()[name] for name in asserts] == [True] * 3
