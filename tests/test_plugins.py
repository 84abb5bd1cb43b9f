"""Plugin discovery end to end, on real installed distributions (no mocks).

Every check runs `python -m chitu_core.plugins` or a short script in a subprocess, from a
directory outside the checkout, in one of these environments:

  installed   this interpreter as it is (the three distributions, editable or not);
  fixtures    the same, with the distributions of tests/fixtures/plugins/ first on PYTHONPATH;
  wheels      `python -S`, PYTHONPATH = a `pip install --target` of ./ ./models ./plugins/cpu
              and a link farm of site-packages without any chitu distribution;
  no-cpu      as wheels, with chitu-cpu left out of the target.

The fixture distributions (names and messages below) are installed once per session.
"""

import json
import os
import re
import shutil
import site
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

import chitu_core
from chitu_core.errors import BackendNotFound
from chitu_core.ops.spec import OP_NAMES
from chitu_core.plugins import BACKENDS_GROUP, get_backend
from chitu_core.plugins.discovery import entries

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "plugins"
MODELS = [  # in name order, as the inventory lists them
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Glm4ForCausalLM",
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
]
IGNORED = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")

ABSENT_REASON = "no Absent accelerator found: /dev/absent0 does not exist (install the Absent driver)"
BROKEN_ERROR = (
    "plugin 'broken' (chitu_core.backends) from chitu-test-broken 0.1.0 failed to import: "
    "RuntimeError: libbroken.so.3: cannot open shared object file"
)
FUTURE_ERROR = (
    f"backend 'future' from chitu-test-future 0.1.0 targets chitu-core contract 2.0, but the installed "
    f"chitu-core {chitu_core.__version__} implements contract {chitu_core.CONTRACT_VERSION}; install a release "
    f"of chitu-test-future built for contract {chitu_core.CONTRACT_VERSION.split('.')[0]}.x, "
    f"or a chitu-core that implements 2.0"
)

# Prints {target: outcome} for each argument "backend:NAME" (get_backend) or "model:ARCH"
# (load_model_class), and with "hooks" what the hook plugin fixture changed.
PROBE = r"""
import json, sys
import torch
from chitu_core.plugins import backend_ops, get_backend, load_model_class

out = {}
for arg in sys.argv[1:]:
    kind, _, name = arg.partition(":")
    try:
        if kind == "backend":
            out[arg] = {"backend": get_backend(name).name}
        elif kind == "model":
            out[arg] = {"model": load_model_class(name).__name__}
        else:
            from chitu_core.ops import reference
            from chitu_core.quantization import get_quant_method
            ops = backend_ops(get_backend("cpu"))
            x = torch.randn(3, 16)
            method, layer = get_quant_method("test-dummy")(), torch.nn.Module()
            method.create_weights(layer, 16, 4, torch.float32, torch.device("cpu"))
            layer.weight_t.normal_()
            out[arg] = {
                "source": [ops.sources["gelu_and_mul"].kind, ops.sources["gelu_and_mul"].origin],
                "fn_module": ops.gelu_and_mul.__module__,
                "matches_reference": all(
                    torch.allclose(ops.gelu_and_mul(x, a), reference.gelu_and_mul(x, a), atol=1e-6)
                    for a in ("none", "tanh")
                ),
                "fast_source": backend_ops(get_backend("fast")).sources["gelu_and_mul"].kind,
                "quant_class": type(method).__module__ + "." + type(method).__qualname__,
                "quant_linear_ok": torch.allclose(method.apply(layer, x, None, ops), x @ layer.weight_t),
            }
    except Exception as exc:
        out[arg] = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(out))
"""

NO_CPU_PROBE = r"""
import importlib.metadata, importlib.util, json, sys
from chitu_core import LLM

result = {"chitu_cpu_importable": importlib.util.find_spec("chitu_cpu") is not None,
          "chitu_models_importable": importlib.util.find_spec("chitu_models") is not None,
          "dists": sorted(d.metadata["Name"] for d in importlib.metadata.distributions()
                          if d.metadata["Name"].startswith("chitu"))}
try:
    LLM(model=sys.argv[1], device="cpu")
except Exception as exc:
    result.update(error=type(exc).__name__, message=str(exc))
print(json.dumps(result))
"""

WHEELS_PROBE = r"""
import importlib.metadata, json
import chitu_core, chitu_cpu, chitu_models
print(json.dumps({"files": [m.__file__ for m in (chitu_core, chitu_cpu, chitu_models)],
                  "dists": sorted(d.metadata["Name"] for d in importlib.metadata.distributions()
                                  if d.metadata["Name"].startswith("chitu"))}))
"""


# --- environments -------------------------------------------------------------------------


def _pip_target(target: Path, sources: list[Path]) -> Path:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
           "--disable-pip-version-check", "--target", str(target), *map(str, sources)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return target


def _link_farm(dest: Path, dirs: list[Path], skip: re.Pattern) -> Path:
    """A directory of symlinks to the entries of ``dirs`` (the first dir wins a name) except ``skip``."""
    dest.mkdir()
    for d in dirs:
        for item in d.iterdir():
            if not skip.match(item.name) and not os.path.lexists(dest / item.name):
                (dest / item.name).symlink_to(item)
    return dest


@pytest.fixture(scope="session")
def outside(tmp_path_factory) -> Path:
    """The working directory of every subprocess: not the checkout, so its sources never shadow."""
    return tmp_path_factory.mktemp("cwd")


@pytest.fixture(scope="session")
def third_party(tmp_path_factory) -> Path:
    """This interpreter's site-packages with every chitu distribution, editable finder and .pth removed."""
    candidates = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    site_dirs = [Path(p) for p in dict.fromkeys(sys.path) if os.path.isdir(p) and os.path.realpath(p) in candidates]
    assert site_dirs, f"no site-packages directory on sys.path {sys.path}"
    skip = re.compile(r"(chitu[_-]|__editable__|__pycache__$|.*\.pth$)", re.IGNORECASE)
    return _link_farm(tmp_path_factory.mktemp("third-party") / "lib", site_dirs, skip)


@pytest.fixture(scope="session")
def wheels(tmp_path_factory) -> Path:
    """chitu-core, chitu-models and chitu-cpu installed (non-editable) from a copy of the checkout."""
    src = tmp_path_factory.mktemp("src")
    for item in REPO.iterdir():
        if item.is_file():
            shutil.copy2(item, src / item.name)
    for sub in ("chitu_core", "models", "plugins/cpu"):
        shutil.copytree(REPO / sub, src / sub, ignore=IGNORED)
    return _pip_target(tmp_path_factory.mktemp("wheels"), [src, src / "models", src / "plugins" / "cpu"])


@pytest.fixture(scope="session")
def without_cpu(wheels, tmp_path_factory) -> Path:
    """The wheels target less chitu-cpu (its package and its dist-info)."""
    return _link_farm(tmp_path_factory.mktemp("no-cpu") / "lib", [wheels], re.compile(r"chitu_cpu"))


@pytest.fixture(scope="session")
def fixture_plugins(tmp_path_factory) -> Path:
    """The fixture distributions, built from copies (pip writes build/ and *.egg-info into a source)."""
    src = tmp_path_factory.mktemp("fixture-src")
    dists = [shutil.copytree(d, src / d.name, ignore=IGNORED) for d in sorted(FIXTURES.iterdir()) if d.is_dir()]
    assert [d.name for d in dists] == ["absent", "broken", "fast", "future", "hooks"]
    return _pip_target(tmp_path_factory.mktemp("fixture-plugins"), dists)


def _run(cwd: Path, args: list[str], paths: Sequence[Path] = (), hermetic: bool = False, plugins: str | None = None) -> str:
    """stdout of ``python ARGS`` with ``paths`` first on PYTHONPATH; ``hermetic`` runs ``python -S``
    with only ``paths`` (no site-packages); ``plugins`` sets CHITU_PLUGINS."""
    env = {k: v for k, v in os.environ.items() if k != "CHITU_PLUGINS"}
    inherited = [] if hermetic else [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *inherited])
    if plugins is not None:
        env["CHITU_PLUGINS"] = plugins
    cmd = [sys.executable, *(["-S"] if hermetic else []), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _inventory(cwd: Path, paths: Sequence[Path] = (), **kw) -> dict:
    return json.loads(_run(cwd, ["-m", "chitu_core.plugins", "--json"], paths, **kw))


def _by(rows: list[dict], key: str = "name") -> dict[str, dict]:
    return {r[key]: r for r in rows}


def _text_backends(text: str) -> dict[str, str]:
    """name -> "available" / "unavailable: ..." / "FAILED: ..." from the text form's Backends section."""
    section = text.split("\nBackends:\n", 1)[1].split("\n\n", 1)[0]
    heads = [re.match(r"  (\S+) +\S+ \S+  (?:\[(available|unavailable: .*)\] priority=.*|(FAILED: .*))$", line)
             for line in section.splitlines() if not line.startswith("   ")]
    assert heads and all(heads), section
    return {m[1]: m[2] or m[3] for m in heads}


def _json_states(inv: dict) -> dict[str, str]:
    return {
        b["name"]: f"FAILED: {b['error']}" if not b["loaded"]
        else "available" if b["available"] else f"unavailable: {b['reason']}"
        for b in inv["backends"]
    }


def _cpu_fallbacks() -> list[str]:
    from chitu_cpu.backend import CpuBackend

    return [op for op in OP_NAMES if op not in CpuBackend().native_ops()]


def assert_stock(inv: dict) -> None:
    """What chitu-core + chitu-models + chitu-cpu alone must show (the cpu row as CpuBackend declares it)."""
    from chitu_cpu.backend import CpuBackend

    cpu, declared = _by(inv["backends"])["cpu"], CpuBackend()
    fallbacks = _cpu_fallbacks()
    assert fallbacks and "gelu_and_mul" in fallbacks
    assert {k: cpu[k] for k in ("distribution", "version", "loaded", "available", "reason", "device_type", "priority",
                                "contract_version", "device_count", "process_group_backend", "quant_methods",
                                "graph_runner", "attention", "fallback_ops", "overridden_ops")} == {
        "distribution": "chitu-cpu", "version": "0.1.0", "loaded": True, "available": True, "reason": "",
        "device_type": "cpu", "priority": 0, "contract_version": "1.15", "device_count": 1,
        "process_group_backend": "gloo", "quant_methods": ["awq", "fp8", "gguf", "gptq", "int8", "unquantized"],
        "graph_runner": False,
        "attention": list(declared.attention_backends()), "fallback_ops": fallbacks, "overridden_ops": {},
    }
    assert cpu["ops"] == {op: "fallback" if op in fallbacks else "native" for op in OP_NAMES}
    assert cpu["dtypes"] == [str(d).removeprefix("torch.") for d in declared.supported_dtypes()] and cpu["dtypes"]
    models = [m for m in inv["models"] if m["distribution"] == "chitu-models"]
    assert [(m["architecture"], m["loaded"]) for m in models] == [(a, True) for a in MODELS]
    assert inv["quant_methods"] == BUILT_IN_QUANT
    assert inv["contract_version"] == chitu_core.CONTRACT_VERSION == "1.18"
    assert inv["failures"] == []


BUILT_IN_QUANT = [{"name": n, "origin": "chitu-core"} for n in ("awq", "fp8", "gguf", "gptq", "int8", "unquantized")]


# --- 1, 2, 3: the stock distributions ---------------------------------------------------------


def test_installed_inventory_lists_cpu_models_and_quant_methods(outside):
    inv = _inventory(outside)
    assert_stock(inv)
    text = _run(outside, ["-m", "chitu_core.plugins"])
    assert _text_backends(text) == _json_states(inv)
    assert f"fallback ops (served by the reference): {', '.join(_cpu_fallbacks())}" in text
    assert all(re.search(rf"^  {arch} +chitu-models 0\.1\.0$", text, re.M) for arch in MODELS)


def test_wheels_carry_their_entry_points_and_packages(outside, wheels, third_party):
    paths = [wheels, third_party]
    where = json.loads(_run(outside, ["-c", WHEELS_PROBE], paths, hermetic=True))
    assert [Path(f).relative_to(wheels).parts[0] for f in where["files"]] == ["chitu_core", "chitu_cpu", "chitu_models"]
    assert where["dists"] == ["chitu-core", "chitu-cpu", "chitu-models"]
    inv = _inventory(outside, paths, hermetic=True)
    assert_stock(inv)
    assert [b["name"] for b in inv["backends"]] == ["cpu"]
    assert [m["architecture"] for m in inv["models"]] == MODELS
    assert inv["quant_methods"] == BUILT_IN_QUANT


def test_without_chitu_cpu_llm_says_what_to_install(outside, without_cpu, third_party, tiny_llama):
    paths = [without_cpu, third_party]
    result = json.loads(_run(outside, ["-c", NO_CPU_PROBE, str(tiny_llama[0])], paths, hermetic=True))
    assert result == {
        "chitu_cpu_importable": False,
        "chitu_models_importable": True,
        "dists": ["chitu-core", "chitu-models"],
        "error": "BackendNotFound",
        "message": "no backend named 'cpu' is installed (installed backends: none); install the distribution that "
                   "provides it (this project's own backends are published as chitu-<name>)",
    }
    inv = _inventory(outside, paths, hermetic=True)
    assert inv["backends"] == [] and inv["failures"] == []
    assert [m["architecture"] for m in inv["models"] if m["loaded"]] == MODELS
    text = _run(outside, ["-m", "chitu_core.plugins"], paths, hermetic=True)
    assert "Backends:\n  none (install one, e.g. `pip install chitu-cpu`)\n" in text


# --- 4 to 7: fixture distributions ------------------------------------------------------------


@pytest.fixture(scope="session")
def fixture_inventory(outside, fixture_plugins) -> dict:
    return _inventory(outside, [fixture_plugins])


@pytest.fixture(scope="session")
def fixture_text(outside, fixture_plugins) -> str:
    return _run(outside, ["-m", "chitu_core.plugins"], [fixture_plugins])


@pytest.fixture(scope="session")
def fixture_probe(outside, fixture_plugins) -> dict:
    targets = ["backend:future", "backend:broken", "backend:absent", "backend:fast", "backend:cpu", "backend:auto",
               "backend:nonexistent", "hooks"]
    return json.loads(_run(outside, ["-c", PROBE, *targets], [fixture_plugins]))


def test_fixture_text_shows_the_same_backends_as_json(fixture_inventory, fixture_text):
    states = _json_states(fixture_inventory)
    assert {"absent", "broken", "cpu", "fast", "future"} <= set(states)
    assert _text_backends(fixture_text) == states
    assert f"\n{len(fixture_inventory['failures'])} plugin(s) failed to load (listed above)." in fixture_text


def assert_failed_backend(inv: dict, text: str, name: str, dist: str, error: str) -> None:
    """Backend ``name`` is reported as not loaded with ``error``: in its row, in the failures, in the text."""
    row = {"name": name, "distribution": dist, "version": "0.1.0", "loaded": False, "available": False, "error": error}
    assert _by(inv["backends"])[name] == row
    assert {"group": "chitu_core.backends", "name": name, "distribution": dist, "error": error} in inv["failures"]
    assert f"\n  {name:<10} {dist} 0.1.0  FAILED: {error}\n" in text


def test_newer_contract_is_refused_with_both_versions(fixture_inventory, fixture_text, fixture_probe):
    assert_failed_backend(fixture_inventory, fixture_text, "future", "chitu-test-future", FUTURE_ERROR)
    assert fixture_probe["backend:future"] == {"error": "PluginError", "message": FUTURE_ERROR}


def test_import_failure_is_reported_and_spares_other_backends(outside, fixture_plugins, fixture_inventory,
                                                              fixture_text, fixture_probe):
    assert_failed_backend(fixture_inventory, fixture_text, "broken", "chitu-test-broken", BROKEN_ERROR)
    cpu = _by(fixture_inventory["backends"])["cpu"]
    assert (cpu["loaded"], cpu["available"]) == (True, True)
    assert fixture_probe["backend:broken"] == {"error": "PluginError", "message": BROKEN_ERROR}
    assert fixture_probe["backend:cpu"] == {"backend": "cpu"}
    # "auto" imports every backend, the broken one included, and still finds one.
    only = json.loads(_run(outside, ["-c", PROBE, "backend:auto", "backend:broken"], [fixture_plugins], plugins="cpu,broken"))
    assert only == {"backend:auto": {"backend": "cpu"}, "backend:broken": {"error": "PluginError", "message": BROKEN_ERROR}}


def test_auto_picks_the_highest_priority_available_backend(fixture_inventory, fixture_text, fixture_probe):
    backends = _by(fixture_inventory["backends"])
    assert {k: backends["fast"][k] for k in ("distribution", "loaded", "available", "reason", "priority")} == {
        "distribution": "chitu-test-fast", "loaded": True, "available": True, "reason": "", "priority": 10,
    }
    assert {k: backends["absent"][k] for k in ("distribution", "loaded", "available", "reason", "priority", "device_count")} == {
        "distribution": "chitu-test-absent", "loaded": True, "available": False, "reason": ABSENT_REASON,
        "priority": 20, "device_count": 0,
    }
    assert f"  absent     chitu-test-absent 0.1.0  [unavailable: {ABSENT_REASON}] priority=20" in fixture_text
    # absent (20) outranks fast (10) but cannot run; future (30) is refused.
    assert fixture_probe["backend:auto"] == {"backend": "fast"}
    assert fixture_probe["backend:absent"] == {
        "error": "BackendUnavailable",
        "message": f"backend 'absent' (from chitu-test-absent 0.1.0) is installed but cannot run here: {ABSENT_REASON}",
    }


def test_hook_plugin_overrides_an_op_and_adds_a_quant_method(fixture_inventory, fixture_text, fixture_probe):
    backends = _by(fixture_inventory["backends"])
    cpu = backends["cpu"]
    assert cpu["overridden_ops"] == {"gelu_and_mul": "testhooks"}
    assert cpu["ops"]["gelu_and_mul"] == "override"
    assert cpu["fallback_ops"] == [op for op in _cpu_fallbacks() if op != "gelu_and_mul"]
    assert backends["fast"]["overridden_ops"] == {} and backends["fast"]["ops"]["gelu_and_mul"] == "fallback"
    assert {"name": "test-dummy", "origin": "testhooks"} in fixture_inventory["quant_methods"]
    assert fixture_inventory["hook_plugins"] == [
        {"name": "testhooks", "distribution": "chitu-test-hooks", "version": "0.1.0", "loaded": True}
    ]
    assert "op gelu_and_mul overridden by hook plugin testhooks\n" in fixture_text
    assert re.search(r"^  test-dummy +testhooks$", fixture_text, re.M)
    assert re.search(r"^Hook plugins:\n  testhooks +chitu-test-hooks 0\.1\.0$", fixture_text, re.M)
    assert fixture_probe["hooks"] == {
        "source": ["override", "testhooks"],
        "fn_module": "chitu_test_hooks",
        "matches_reference": True,
        "fast_source": "fallback",
        "quant_class": "chitu_test_hooks.DummyQuant",
        "quant_linear_ok": True,
    }


# --- 8, 9: selection by CHITU_PLUGINS and by name -----------------------------------------------


@pytest.mark.parametrize(
    "plugins, models",
    [("chitu-cpu,chitu-models", MODELS), ("cpu,LlamaForCausalLM", ["LlamaForCausalLM"])],
    ids=["distribution-names", "entry-point-names"],
)
def test_chitu_plugins_limits_what_loads(outside, fixture_plugins, plugins, models):
    inv = _inventory(outside, [fixture_plugins], plugins=plugins)
    assert [b["name"] for b in inv["backends"]] == ["cpu"]
    assert [m["architecture"] for m in inv["models"]] == models
    assert inv["hook_plugins"] == [] and inv["failures"] == []
    assert inv["quant_methods"] == BUILT_IN_QUANT
    assert inv["backends"][0]["overridden_ops"] == {} and "gelu_and_mul" in inv["backends"][0]["fallback_ops"]


def test_chitu_plugins_errors_say_what_it_left_out(outside, fixture_plugins):
    targets = ["backend:fast", "model:Qwen2ForCausalLM", "model:LlamaForCausalLM", "backend:nonexistent"]
    probe = json.loads(_run(outside, ["-c", PROBE, *targets], [fixture_plugins], plugins="cpu,LlamaForCausalLM"))
    assert probe == {
        "backend:fast": {
            "error": "BackendNotFound",
            "message": "backend 'fast' from chitu-test-fast 0.1.0 is installed, but CHITU_PLUGINS=cpu,LlamaForCausalLM "
                       "leaves it out; add fast to CHITU_PLUGINS or unset it",
        },
        "model:Qwen2ForCausalLM": {
            "error": "ModelLoadError",
            "message": "architecture 'Qwen2ForCausalLM' from chitu-models 0.1.0 is installed, but "
                       "CHITU_PLUGINS=cpu,LlamaForCausalLM leaves it out; add Qwen2ForCausalLM to CHITU_PLUGINS or unset it",
        },
        "model:LlamaForCausalLM": {"model": "LlamaForCausalLM"},
        "backend:nonexistent": {
            "error": "BackendNotFound",
            "message": "no backend named 'nonexistent' is installed (installed backends: cpu (CHITU_PLUGINS=cpu,"
                       "LlamaForCausalLM excludes others)); install the distribution that provides it (this project's "
                       "own backends are published as chitu-<name>)",
        },
    }


# Backends of this repository besides cpu that the test environment may have installed.
OTHER_BACKENDS = [e.name for e in entries(BACKENDS_GROUP) if e.name != "cpu" and e.dist_name.startswith("chitu-")
                  and not e.dist_name.startswith("chitu-test-")]


def test_unknown_backend_names_the_package_to_install(monkeypatch, fixture_probe):
    monkeypatch.delenv("CHITU_PLUGINS", raising=False)
    with pytest.raises(BackendNotFound) as info:
        get_backend("nonexistent")
    assert str(info.value).startswith("no backend named 'nonexistent' is installed (installed backends: ")
    assert "cpu" in str(info.value).split("installed backends: ")[1]
    assert fixture_probe["backend:nonexistent"] == {
        "error": "BackendNotFound",
        "message": "no backend named 'nonexistent' is installed (installed backends: "
                   f"{', '.join(sorted(['absent', 'broken', 'cpu', 'fast', 'future', *OTHER_BACKENDS]))}); install the "
                   "distribution that provides it (this project's own backends are published as chitu-<name>)",
    }


# --- misbehaving plugins ----------------------------------------------------------------------

MISBEHAVING = FIXTURES.parent / "misbehaving"


@pytest.fixture(scope="session")
def misbehaving(tmp_path_factory) -> dict[str, Path]:
    src = tmp_path_factory.mktemp("misbehaving-src")
    return {
        name: _pip_target(tmp_path_factory.mktemp(name), [shutil.copytree(MISBEHAVING / name, src / name, ignore=IGNORED)])
        for name in ("rival", "badhooks")
    }


def test_two_distributions_claiming_one_backend_name_are_both_named(outside, misbehaving):
    inv = _inventory(outside, [misbehaving["rival"]])
    cpu = _by(inv["backends"])["cpu"]
    assert not cpu["loaded"]
    assert "name 'cpu' is registered by" in cpu["error"]
    assert "chitu-test-rival 0.2.0" in cpu["error"] and "chitu-cpu" in cpu["error"]
    assert "uninstall all but one of them" in cpu["error"]


def test_failing_hooks_are_named_and_do_not_break_the_listing(outside, misbehaving):
    inv = _inventory(outside, [misbehaving["badhooks"]])
    hooks = _by(inv["hook_plugins"])
    assert hooks["badhooks"]["loaded"] is False
    assert hooks["badhooks"]["error"] == "chitu_quant_methods() failed: RuntimeError: quant kernels missing"
    # Refused for its quant hook, the plugin is unregistered: its op hook never runs, cpu is fine.
    assert _by(inv["backends"])["cpu"]["available"] is True
    assert inv["quant_methods"] == BUILT_IN_QUANT
