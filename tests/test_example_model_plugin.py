"""The example out-of-tree model plugin of examples/model-plugin (IBM Granite), as a user installs it.

A copy of the example is installed with `pip install --target` into a temporary directory that goes
on sys.path, so chitu-core finds its `chitu_core.models` entry point as it finds any plugin's. Then,
on a small random Granite config whose four multipliers all differ from 1 (so each one matters),
saved as a safetensors checkpoint: `chitu_core.LLM` on the CPU backend in float32 against
transformers on the same weights (last-token logits within NMSE 1e-5, 32-token greedy continuations
identical), and the model conformance case, which runs the example because its class declares
`conformance_config()`, with a planted fault it must catch.
"""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

from builders import TINY
from chitu_core import LLM, SamplingParams
from chitu_core.conformance.case import Target
from chitu_core.conformance.runner import Session, build_cases
from chitu_core.conformance.thresholds import ThresholdBook
from chitu_core.plugins.discovery import MODELS_GROUP, backend_ops, entries, load_model_class
from chitu_cpu.backend import CpuBackend
from test_models import PROMPTS, batched_last_logits
from test_models_phi_glm import TOKENS, save_random

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "model-plugin"
ARCH = "GraniteForCausalLM"
NEW_TOKENS = 32
MULTIPLIERS = dict(embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=4.0)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example installed into a fresh target directory on sys.path (a copy: the build leaves the tree clean).

    An in-tree architecture is loaded first, as an earlier test or a running process would have: the
    group's entry points are then already listed once, before the example is on sys.path.
    """
    load_model_class("LlamaForCausalLM")
    tmp = tmp_path_factory.mktemp("model-plugin")
    src = shutil.copytree(EXAMPLE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
           "--disable-pip-version-check", "--target", str(target), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))
    for name in [m for m in sys.modules if m.split(".")[0] == "chitu_example_model"]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def pair(installed, tmp_path_factory):
    path = tmp_path_factory.mktemp("granite")
    hf = save_random(path, tf.GraniteConfig(**TINY, tie_word_embeddings=True, **MULTIPLIERS, **TOKENS))
    return hf, LLM(path, device="cpu", dtype="float32", load_progress=False)


def test_the_entry_point_registers_the_architecture(installed):
    entry = next(e for e in entries(MODELS_GROUP) if e.name == ARCH)
    assert (entry.origin, entry.target) == ("chitu-example-model 0.1.0", "chitu_example_model.granite:GraniteForCausalLM")
    cls = load_model_class(ARCH)
    assert cls.__module__ == "chitu_example_model.granite" and Path(sys.modules[cls.__module__].__file__).is_relative_to(installed)


def test_served_by_the_example(pair):
    hf, llm = pair
    assert hf.config.architectures == [ARCH] and type(llm.engine.model).__module__ == "chitu_example_model.granite"


def test_last_token_logits_match_transformers(pair):
    hf, llm = pair
    ours = batched_last_logits(llm, PROMPTS)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    nmse = ((ours - ref).pow(2).sum() / ref.pow(2).sum()).item()
    assert nmse <= 1e-5, f"logits NMSE {nmse:.3g}"


def test_greedy_continuations_match_transformers(pair):
    hf, llm = pair
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        assert len(ref) == NEW_TOKENS and out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens"


def run_model_case(dtypes=(torch.float32,)) -> dict[tuple[str, str], str]:
    backend = CpuBackend()
    target = Target(backend, backend_ops(backend), torch.device("cpu"), ThresholdBook(backend.tolerances()))
    results = Session(target, build_cases(target, dtypes, f"model/{ARCH}/*")).run_all()
    return {(r.row.rsplit("/", 1)[1], r.dtype): (r.status, r.detail) for r in results}


def test_the_model_conformance_case_runs_the_example(installed):
    results = run_model_case((torch.float32, torch.bfloat16))
    assert {k: s for k, (s, _) in results.items()} == {
        ("logits", "float32"): "pass", ("greedy", "float32"): "pass", ("transformers", "float32"): "fallback",
        ("logits", "bfloat16"): "pass", ("greedy", "bfloat16"): "pass"}


def test_the_conformance_case_catches_a_model_that_ignores_a_multiplier(installed, monkeypatch):
    """Forgetting logits_scaling: the backend still agrees with the reference, transformers does not."""
    cls = load_model_class(ARCH)
    monkeypatch.setattr(cls, "compute_logits", lambda self, hidden: self.lm_head(hidden))
    results = run_model_case()
    assert results[("logits", "float32")][0] == results[("greedy", "float32")][0] == "pass"
    status, detail = results[("transformers", "float32")]
    assert status == "fail" and "NMSE" in detail, detail


def test_an_architecture_without_conformance_config_gets_one_skipped_row_saying_why(monkeypatch):
    """The model case's other path: a class that inherits conformance_config() (its parent's family, not
    its own) is not run on the parent's config; one row a dtype says what to add."""
    import chitu_core.plugins.discovery as discovery
    from chitu_core.conformance import model_cases
    from chitu_models.llama import LlamaForCausalLM

    class Undeclared(LlamaForCausalLM):
        pass

    monkeypatch.setattr(discovery, "load_model_class", lambda arch: Undeclared)
    cls, config, skip = model_cases._plan("UndeclaredForCausalLM")
    assert cls is Undeclared and config is None
    assert "declares no conformance_config()" in skip and "docs/writing-a-model.md" in skip
    cases = model_cases._cases("UndeclaredForCausalLM", cls, config, skip, (torch.float32, torch.bfloat16))
    assert [(c.row, c.dtype, c.skip) for c in cases] == [("model/UndeclaredForCausalLM", d, skip)
                                                         for d in (torch.float32, torch.bfloat16)]
