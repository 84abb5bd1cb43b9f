"""Conformance and plugin hardening (issue 17): each check here fails without the change it pins.

Plugins come from distributions made on the fly: a module and a ``.dist-info`` with its entry points
in a temporary directory put on sys.path (or PYTHONPATH), which ``importlib.metadata`` and stevedore
find as they find an installed one. Names are unique per test, so no import is cached across tests.
"""

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from stevedore.extension import ExtensionManager

from chitu_core.attention.reference import ReferenceAttention, paged_attention
from chitu_core.backend import Backend
from chitu_core.conformance.case import Target
from chitu_core.conformance.collective_cases import collective_source
from chitu_core.conformance.report import environment, markdown
from chitu_core.conformance.runner import Session, build_cases, load_target
from chitu_core.conformance.thresholds import ThresholdBook
from chitu_core.errors import BackendNotFound, BackendUnavailable, PluginError
from chitu_core.ops import OP_NAMES
from chitu_core.ops.checks import OUTPUTS, OpContractError, checked_ops
from chitu_core.ops.table import resolve_ops, with_checks_if_asked
from chitu_core.plugins import get_backend
from chitu_core.plugins.inventory import inventory
from chitu_core.version import CONTRACT_VERSION, ContractWarning, __version__, check_contract
from chitu_cpu.backend import CpuBackend
from test_conformance import PlantedBackend

REPO = Path(__file__).resolve().parents[1]


def fake_dist(root: Path, dist: str, module: str, source: str, backends: dict[str, str]) -> Path:
    """Write module ``module`` and the .dist-info of ``dist`` 0.1.0 registering ``backends`` (name -> class)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[chitu_core.backends]\n" + "".join(f"{n} = {module}:{cls}\n" for n, cls in backends.items()))
    return root


BACKENDS = '''
import torch
from chitu_core.backend import Availability
from chitu_cpu.backend import CpuBackend


class Raising(CpuBackend):
    name, contract_version, priority = "{p}raise", "1.0", 100

    def is_available(self):
        raise RuntimeError("driver exploded")


class Unavailable(CpuBackend):
    name, contract_version, priority = "{p}off", "1.0", 100

    def is_available(self):
        return Availability(False, "no Acme card found")


class Newer(CpuBackend):
    name, contract_version, priority = "{p}newer", "1.99", -5


class Major(CpuBackend):
    name, contract_version, priority = "{p}major", "2.0", -5


class WrongShapes(CpuBackend):
    """silu_and_mul returns its input, apply_temperature drops the last column: each is blamed on the next op."""
    name, contract_version, priority = "{p}wrong", "1.3", -5

    def native_ops(self):
        return {{**super().native_ops(), "silu_and_mul": lambda x: x.clone(),
                "apply_temperature": lambda logits, t: logits[:, :-1].float().clone()}}

    def fusion_max_tokens(self):
        return 0  # no step takes the CPU's fused rms_norm_linear (which has its own SiLU): layers call silu_and_mul
'''


@pytest.fixture
def acme(tmp_path, monkeypatch, request) -> str:
    """The prefix of this test's fake backends, from distribution acme-chitu-backend, on sys.path."""
    prefix = "acme" + re.sub(r"\W", "", request.node.name)[-12:].lower()
    names = {f"{prefix}{k}": v for k, v in (("raise", "Raising"), ("off", "Unavailable"), ("newer", "Newer"),
                                            ("major", "Major"), ("wrong", "WrongShapes"))}
    root = fake_dist(tmp_path / "site", "acme-chitu-backend", f"{prefix}_backends", BACKENDS.format(p=prefix), names)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})  # stevedore lists a group once per process
    monkeypatch.delenv("CHITU_PLUGINS", raising=False)
    return prefix


ORIGIN = "acme-chitu-backend 0.1.0"

# --- 1: padding slots outside graphs -------------------------------------------------------------


class WrapsPaddingSlots(ReferenceAttention):
    """Writes every row at its slot as a plain index would: slot -1 wraps to the cache's last slot."""

    name = "wraps"

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=None):
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        flat[0][meta.slot_mapping.long()] = k.to(flat.dtype)
        flat[1][meta.slot_mapping.long()] = v.to(flat.dtype)
        return paged_attention(q, k, v, kv_cache, meta, scale, kv_scale)


def run(backend: Backend, ops: str, keep=lambda case: True):
    target = Target(backend, checked_ops(resolve_ops(backend.name, backend.native_ops())), torch.device("cpu"),
                    ThresholdBook())
    cases = [c for c in build_cases(target, (torch.float32,), ops) if keep(c)]
    return target, Session(target, cases).run_all()


def test_attention_writing_padding_slots_fails_the_padded_cases():
    _, results = run(PlantedBackend(attention=WrapsPaddingSlots), "attention/wraps",
                     lambda c: "long" not in c.label)
    padded = [r for r in results if "pad" in r.label]
    others = [r for r in results if "pad" not in r.label]
    assert len(padded) == 2 and others
    # Without the padded plans the suite would pass this backend: no other case has a negative slot.
    assert {r.status for r in others} == {"pass"}, [(r.label, r.detail) for r in others if r.status != "pass"]
    for r in padded:
        assert r.status == "fail" and re.fullmatch(r"step 2 \(padded \w+ batch\): attention wrote into blocks "
                                                   r"\[\d+\] where no new token goes .*", r.detail), r.detail


def test_the_cpu_attention_passes_the_padded_cases():
    _, results = run(CpuBackend(), "attention*", lambda c: "pad" in c.label)
    graph = [r for r in results if r.row.endswith("/graph-prefill")]  # contract 1.16's layout: not declared here
    padded = [r for r in results if r not in graph]
    # one with variants, one with a float16 cache
    assert len(padded) == 5 and {r.status for r in padded} == {"pass"}, [r.detail for r in padded]
    assert len(graph) == 3 and {r.status for r in graph} == {"unsupported"}


# --- 2: op outputs checked against the contract ----------------------------------------------------


def test_every_op_of_the_contract_has_an_output_rule():
    assert set(OUTPUTS) == set(OP_NAMES)


def test_an_op_with_a_wrong_shape_is_named_in_its_own_case():
    def rms_norm(x, weight, eps):
        return x[..., 1:].clone()

    _, results = run(PlantedBackend(ops={"rms_norm": rms_norm}), "rms_norm")
    assert results and {r.status for r in results} == {"fail"}
    assert re.fullmatch(r"op 'rms_norm' \(native, from cpu\) broke its contract: its output has shape \[1, 0\], "
                        r"the contract gives \[1, 1\]", results[0].detail), results[0].detail


def test_the_suite_names_the_op_that_broke_the_contract_not_the_next_one(acme):
    target = load_target(f"{acme}wrong")
    results = Session(target, build_cases(target, (torch.float32,), "sampler")).run_all()
    assert [r.status for r in results] == ["fail"]
    assert results[0].detail == (f"op 'apply_temperature' (native, from {acme}wrong) broke its contract: its output "
                                 "has shape [20064, 39], the contract gives [20064, 40]")


@pytest.mark.parametrize("bad, problem", [
    (lambda x: x, "has shape [3, 8], the contract gives [3, 4]"),
    (lambda x: x[..., 4:], "shares memory with an input (ops return new tensors)"),
    (lambda x: torch.zeros(1, 1).expand(3, 4), "has stride 0 in a dimension of size > 1"),
    (lambda x: x[..., :4].to(torch.bfloat16), "has dtype torch.bfloat16, the contract gives torch.float32"),
    (lambda x: (x[..., :4].clone(),), "is a tuple, not a tensor"),
], ids=["shape", "view", "expanded", "dtype", "tuple"])
def test_run_time_checks_under_chitu_check_ops(monkeypatch, bad, problem):
    ops = resolve_ops("planted", {"silu_and_mul": bad})
    monkeypatch.delenv("CHITU_CHECK_OPS", raising=False)
    assert with_checks_if_asked(ops) is ops  # the default: nothing wrapped, nothing checked
    monkeypatch.setenv("CHITU_CHECK_OPS", "1")
    checked = with_checks_if_asked(ops)
    assert checked.sources == ops.sources and checked.fallbacks() == ops.fallbacks()
    assert torch.allclose(checked.rms_norm(torch.ones(3, 8), torch.ones(8), 1e-6), torch.ones(3, 8))
    with pytest.raises(OpContractError) as info:
        checked.silu_and_mul(torch.randn(3, 8))
    assert str(info.value).startswith("op 'silu_and_mul' (native, from planted) broke its contract: its output ")
    assert problem in str(info.value)


def test_the_engine_checks_its_ops_under_chitu_check_ops(acme, tiny_llama, monkeypatch):
    from chitu_core import LLM, SamplingParams

    def generate(device: str) -> list[int]:
        llm = LLM(tiny_llama[0], device=device, dtype="float32", load_progress=False)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return llm.generate({"prompt_token_ids": list(range(10))}, params)[0].outputs[0].token_ids

    monkeypatch.delenv("CHITU_CHECK_OPS", raising=False)
    with pytest.raises(Exception) as unchecked:  # the down projection is blamed
        generate(f"{acme}wrong")
    assert "silu_and_mul" not in str(unchecked.value) and not isinstance(unchecked.value, OpContractError)
    monkeypatch.setenv("CHITU_CHECK_OPS", "1")
    with pytest.raises(OpContractError, match=r"^op 'silu_and_mul' \(native, from acme\w+wrong\) broke its "
                                              r"contract: its output has shape \[\d+, (\d+)\], the contract "
                                              r"gives \[\d+, \d+\]$"):
        generate(f"{acme}wrong")
    assert len(generate("cpu")) == 4  # the CPU backend keeps its contract under the checks


# --- 3: --strict ------------------------------------------------------------------------------------


def plugins_cli(tmp_path: Path, *args: str, extra: Path | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "CHITU_PLUGINS"}
    if extra is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run([sys.executable, "-m", "chitu_core.plugins", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode


def test_strict_exits_non_zero_when_a_plugin_failed_to_load(tmp_path):
    broken = fake_dist(tmp_path / "site", "acme-broken", "acme_broken_plugin",
                       "raise ImportError('libacme.so.1: cannot open shared object file')\n",
                       {"acmebroken": "Broken"})
    assert plugins_cli(tmp_path, "--strict", extra=broken) == 1
    assert plugins_cli(tmp_path, extra=broken) == 0  # the default stays informative
    assert plugins_cli(tmp_path, "--strict") == 0


# --- 4, 7: is_available() raising; install hints from the entry point's distribution -----------------


@pytest.mark.filterwarnings("ignore::chitu_core.version.ContractWarning")  # the inventory loads every fake
def test_is_available_raising_makes_the_backend_unavailable_naming_it(acme):
    reason = f"is_available() of backend '{acme}raise' from {ORIGIN} raised RuntimeError: driver exploded"
    assert get_backend("auto").name != f"{acme}raise"  # priority 100, but unavailable: no crash
    with pytest.raises(BackendUnavailable) as info:
        get_backend(f"{acme}raise")
    assert str(info.value) == f"backend '{acme}raise' (from {ORIGIN}) is installed but cannot run here: {reason}"
    row = next(b for b in inventory()["backends"] if b["name"] == f"{acme}raise")
    assert (row["loaded"], row["available"], row["reason"]) == (True, False, reason)


def test_install_hints_name_the_distribution_not_a_guess(acme):
    with pytest.raises(BackendUnavailable) as info:
        get_backend(f"{acme}off")
    assert str(info.value) == f"backend '{acme}off' (from {ORIGIN}) is installed but cannot run here: no Acme card found"
    with pytest.raises(BackendNotFound) as missing:
        get_backend(f"{acme}gone")
    assert "pip install chitu-" not in str(missing.value)
    assert f"no backend named '{acme}gone' is installed (installed backends: " in str(missing.value)
    assert str(missing.value).endswith("; install the distribution that provides it (this project's own backends "
                                       "are published as chitu-<name>)")


# --- 5: contract versions -------------------------------------------------------------------------


def test_a_newer_minor_loads_with_a_warning_naming_plugin_and_versions(acme):
    with pytest.warns(ContractWarning) as caught:
        assert get_backend(f"{acme}newer").name == f"{acme}newer"
    assert str(caught[0].message) == (
        f"backend '{acme}newer' from {ORIGIN} targets chitu-core contract 1.99, newer than the contract "
        f"{CONTRACT_VERSION} of the installed chitu-core {__version__}; it is loaded, but what it relies on from "
        f"contracts 1.{int(CONTRACT_VERSION.split('.')[1]) + 1} to 1.99 is missing here: upgrade chitu-core")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_contract("backend", "old", ORIGIN, "1.0")
        check_contract("backend", "same", ORIGIN, CONTRACT_VERSION)


def test_a_newer_major_is_refused_in_one_line(acme):
    with pytest.raises(PluginError) as info:
        get_backend(f"{acme}major")
    assert "\n" not in str(info.value)
    assert str(info.value) == (
        f"backend '{acme}major' from {ORIGIN} targets chitu-core contract 2.0, but the installed chitu-core "
        f"{__version__} implements contract {CONTRACT_VERSION}; install a release of acme-chitu-backend built for "
        f"contract 1.x, or a chitu-core that implements 2.0")


# --- 6: every fallback marked as such ---------------------------------------------------------------


def test_a_sampler_partly_served_by_the_reference_is_not_native():
    target, results = run(CpuBackend(), "sampler")
    assert [(r.source, r.status) for r in results] == [("native+fallback", "fallback")]
    assert "| `sampler` | native+fallback | fallback (z-score " in markdown(results, environment(target))
    _, results = run(PlantedBackend(), "sampler")  # every sampling op the reference's
    assert [(r.source, r.status) for r in results] == [("fallback", "fallback")]


def test_collectives_on_the_default_process_group_are_a_fallback():
    class DefaultGroup(CpuBackend):
        process_group_backend = Backend.process_group_backend

    assert collective_source(DefaultGroup()) == "fallback"
    assert collective_source(CpuBackend()) == "native"


# --- 8: building from the repository leaves the tree clean -------------------------------------------

DISTRIBUTIONS = [REPO, REPO / "models", REPO / "plugins" / "cpu", REPO / "plugins" / "nvidia"]


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` (but caches) with its modification and change times."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), directory)] = (st.st_mtime_ns, st.st_ctime_ns)
    return out


def _git_status(directory: Path) -> set[str]:
    proc = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "--", "."],
                          cwd=directory, capture_output=True, text=True, timeout=30)
    return set(proc.stdout.splitlines()) if proc.returncode == 0 else set()


def _pip_install(source: Path, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                           "--disable-pip-version-check", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=120)


def test_every_distribution_builds_with_the_same_out_of_tree_backend():
    copies = {d: (d / "_chitu_build.py").read_text() for d in DISTRIBUTIONS}
    assert len(set(copies.values())) == 1, "the _chitu_build.py copies differ"
    for d in DISTRIBUTIONS:
        text = (d / "pyproject.toml").read_text()
        assert 'build-backend = "_chitu_build"' in text and 'backend-path = ["."]' in text, d
        assert "include _chitu_build.py" in (d / "MANIFEST.in").read_text().splitlines(), d


def test_installing_from_the_repository_writes_nothing_into_it(tmp_path):
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        pytest.skip("pip is not available to this interpreter")
    source = REPO / "plugins" / "cpu"
    files, status = _snapshot(source), _git_status(source)
    proc = _pip_install(source, tmp_path / "target")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _git_status(source) == status
    assert _snapshot(source) == files, "the install wrote into plugins/cpu"
    installed = {p.name for p in (tmp_path / "target").iterdir()}
    assert installed == {"chitu_cpu", "chitu_cpu-0.1.0.dist-info"}  # the build backend is not installed
    # The control: the same install through setuptools' own backend leaves build/ and an egg-info behind.
    plain = tmp_path / "plain"
    shutil.copytree(source, plain, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pyproject = plain / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('build-backend = "_chitu_build"', 'build-backend = '
                                                       '"setuptools.build_meta"').replace('backend-path = ["."]', ""))
    assert _pip_install(plain, tmp_path / "plain-target").returncode == 0
    assert {"build", "chitu_cpu.egg-info"} <= {p.name for p in plain.iterdir()}
