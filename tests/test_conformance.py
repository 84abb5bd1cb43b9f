"""The conformance suite: its metrics, its guards against planted faults, and whole runs.

In process: each metric's rules (NaN, infinities, ties, unwritten elements, impossible draws), the
threshold declarations, and backends with one planted fault each (a wrong op, a write into an
operand, a read past an operand, an unwritten output element, a KV write outside its slots or outside
the cache), whose cases must fail with the fault named while a clean control passes.

End to end, as CI runs them (`python -m chitu_core.conformance` in a subprocess, from a directory
outside the checkout): the CPU backend; the example vendor plugin of examples/vendor-plugin,
installed with `pip install --target`; copies of it with a wrong op and with out-of-bounds writes
planted; the pytest entry (`pytest --pyargs chitu_core.conformance --backend NAME`). And the
thresholds doc is the one the code generates.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chitu_core.attention.reference import ReferenceAttention, paged_attention
from chitu_core.conformance.case import Target
from chitu_core.conformance.compare import compare, compare_argmax, compare_draws
from chitu_core.conformance.runner import Session, build_cases
from chitu_core.conformance.thresholds import Threshold, ThresholdBook, thresholds_markdown
from chitu_core.ops import OP_NAMES, reference
from chitu_core.ops.table import resolve_ops
from chitu_cpu.backend import CpuBackend

REPO = Path(__file__).resolve().parents[1]
VENDOR = REPO / "examples" / "vendor-plugin"
# The models distribution's architectures: each one's model case runs on its own conformance_config().
IN_TREE_ARCHITECTURES = list(tomllib.loads((REPO / "models" / "pyproject.toml").read_text())
                             ["project"]["entry-points"]["chitu_core.models"])
IGNORED = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
NAN, INF = float("nan"), float("inf")

# ----- metrics -----


def test_nan_never_passes_even_against_a_nan_reference():
    loose = Threshold("close", rtol=1.0, atol=1.0)
    for want in (torch.tensor([1.0, 2.0]), torch.tensor([1.0, NAN])):
        verdict = compare(torch.tensor([1.0, NAN]), want, loose)
        assert not verdict.ok and "1 of 2 elements are NaN (first at [1]" in verdict.detail
    assert not compare(torch.tensor([NAN]), torch.tensor([1.0]), Threshold("nmse", limit=1.0, rtol=1.0)).ok


def test_infinities_must_match_in_sign_and_place():
    exact = Threshold("exact")
    assert compare(torch.tensor([-INF, 1.0, INF]), torch.tensor([-INF, 1.0, INF]), exact).ok
    for got in ([INF, 1.0, INF], [1.0, -INF, INF], [-INF, 1.0, 3.0]):
        verdict = compare(torch.tensor(got), torch.tensor([-INF, 1.0, INF]), Threshold("close", rtol=1.0, atol=1.0))
        assert not verdict.ok and "infinities differ" in verdict.detail, got


def test_close_reports_the_worst_share_of_the_tolerance():
    verdict = compare(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), Threshold("close", rtol=0.1, atol=0.0))
    assert not verdict.ok and verdict.error == pytest.approx(2.5) and "element [1] is 2.5" in verdict.detail
    verdict = compare(torch.tensor([1.0, 2.1]), torch.tensor([1.0, 2.0]), Threshold("close", rtol=0.1, atol=0.0))
    assert verdict.ok and verdict.error == pytest.approx(0.5) and verdict.bound == 1.0


def test_nmse_cannot_hide_one_unwritten_element():
    want = torch.randn(100, 1000, dtype=torch.float64)
    want[17, 400] = 2.5
    got = want.clone()
    got[17, 400] = 0.0  # unwritten: NMSE is about 6e-5, under a loose limit
    threshold = Threshold("nmse", limit=1e-4, rtol=0.03)
    verdict = compare(got, want, threshold)
    assert not verdict.ok and verdict.error < threshold.limit and "element [17, 400] is 0" in verdict.detail
    assert compare(want.float(), want, threshold).ok


def test_exact_counts_differing_elements():
    verdict = compare(torch.tensor([[1, 2], [3, 5]]), torch.tensor([[1, 2], [4, 6]]), Threshold("exact"))
    assert (verdict.ok, verdict.error) == (False, 2.0) and "first at [1, 0]: got 3, reference 4" in verdict.detail


def test_argmax_ties_take_the_lowest_index_unless_a_tolerance_is_declared():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0 - 1e-9, 0.0, 1.0]], dtype=torch.float64)
    exact = Threshold("argmax")
    assert compare_argmax(torch.tensor([1, 0]), scores, exact).ok
    verdict = compare_argmax(torch.tensor([2, 0]), scores, exact)
    assert not verdict.ok and "row 0: got 2" in verdict.detail and "reference 1" in verdict.detail
    assert not compare_argmax(torch.tensor([1, 1]), scores, exact).ok  # a near-tie is not a tie
    assert compare_argmax(torch.tensor([2, 1]), scores, Threshold("argmax", rtol=1e-6)).ok
    assert not compare_argmax(torch.tensor([1, 5]), scores, exact).ok  # out of range


def test_draws_of_an_impossible_token_fail_whatever_the_limit():
    probs = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert compare_draws(torch.tensor([5010, 4990, 0]), probs, Threshold("zscore", limit=5.0)).ok
    verdict = compare_draws(torch.tensor([5000, 4999, 1]), probs, Threshold("zscore", limit=1e9))
    assert not verdict.ok and "drew token 2 1 times, though its probability is 0" in verdict.detail
    verdict = compare_draws(torch.tensor([5600, 4400, 0]), probs, Threshold("zscore", limit=5.0))
    assert not verdict.ok and verdict.error == pytest.approx(12.0)


def test_declared_thresholds_beat_defaults_op_before_family():
    book = ThresholdBook({("attention", torch.bfloat16): {"limit": 1e-4},
                          ("rms_norm", torch.float32): Threshold("close", rtol=1e-5, atol=1e-5),
                          ("norm", torch.float32): {"rtol": 1e-4}})
    assert book.get("attention/acme", "attention", torch.bfloat16) == (Threshold("nmse", limit=1e-4, rtol=3e-2), True)
    assert book.get("attention/acme", "attention", torch.float32)[1] is False
    assert book.get("rms_norm", "norm", torch.float32) == (Threshold("close", rtol=1e-5, atol=1e-5), True)
    assert book.get("fused_add_rms_norm", "norm", torch.float32)[0].rtol == 1e-4
    assert [d["key"] for d in book.declarations()] == ["attention", "rms_norm", "norm"]
    for bad, message in [({("attention", torch.float32): Threshold("close")}, "changes the metric"),
                         ({("attention", torch.float32): {"metric": "close"}}, "declare limit, rtol or atol"),
                         ({("softmax", torch.float32): {"rtol": 1.0}}, "names no family or op"),
                         ({("sampler", torch.bfloat16): {"limit": 6.0}}, "names no family or op")]:
        with pytest.raises(ValueError, match=message):
            ThresholdBook(bad)


def test_default_declarations_decline_collectives_that_need_a_device_per_rank():
    backend = CpuBackend()
    one, two = {"world_size": 2, "device_count": 1}, {"world_size": 2, "device_count": 2}
    assert backend.supports("all_reduce", torch.float32, {**one, "process_group_backend": "gloo"})
    assert not backend.supports("all_reduce", torch.float32, {**one, "process_group_backend": "other"})
    assert backend.supports("all_reduce", torch.bfloat16, {**two, "process_group_backend": "other"})
    assert not backend.supports("rms_norm", torch.float16, {"shape": [2, 8], "eps": 1e-6})


def test_thresholds_doc_is_the_generated_table():
    doc = (REPO / "docs" / "conformance-thresholds.md").read_text()
    assert doc == thresholds_markdown(), "regenerate: python -m chitu_core.conformance --thresholds-table > docs/conformance-thresholds.md"


# ----- planted faults, in process -----


def rms_norm_without_eps(x, weight, eps):
    return reference.rms_norm(x, weight, 0.0)


def silu_and_mul_in_place(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate, inplace=True) * up


def silu_and_mul_reading_past_its_operand(x):
    half = x.shape[-1] // 2
    up_one_late = x.as_strided((*x.shape[:-1], half), x.stride(), x.storage_offset() + (half + 1) * x.stride(-1))
    return F.silu(x[..., :half]) * up_one_late


def rms_norm_leaving_the_last_row_unwritten(x, weight, eps):
    out = torch.empty(x.shape, dtype=x.dtype).fill_(0.0)
    out.view(-1, x.shape[-1])[:-1] = reference.rms_norm(x, weight, eps).reshape(-1, x.shape[-1])[:-1]
    return out


class WritesPastItsSlots(ReferenceAttention):
    name = "past-slots"

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=None):
        values = kv_cache.view(2, -1, *kv_cache.shape[3:])[1]
        values[(meta.slot_mapping + 1).clamp(max=values.shape[0] - 1)] = 0.5  # off by one, then the right writes
        return paged_attention(q, k, v, kv_cache, meta, scale, kv_scale)


class WritesPastTheCache(ReferenceAttention):
    name = "past-cache"

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=None):
        out = paged_attention(q, k, v, kv_cache, meta, scale, kv_scale)
        kv_cache.as_strided((kv_cache.numel() + 3,), (1,), kv_cache.storage_offset())[-1] = 1.0
        return out


class PlantedBackend(CpuBackend):
    def __init__(self, ops=None, attention=ReferenceAttention):
        self.ops, self.attention = ops or {}, attention

    def native_ops(self):
        return self.ops

    def attention_backends(self):
        return {self.attention.name: self.attention}


def run_in_process(backend: PlantedBackend, ops: str, dtypes=(torch.float32,)):
    """The first 8 float32 cases of each row matching ``ops`` (for attention: no long contexts)."""
    target = Target(backend, resolve_ops("planted", backend.native_ops()), torch.device("cpu"), ThresholdBook())
    cases = build_cases(target, dtypes, ops)
    cases = [c for i, c in enumerate(cases) if sum(d.row == c.row for d in cases[:i]) < 8]
    return Session(target, cases).run_all()


PLANTED = {
    "wrong op": (dict(ops={"rms_norm": rms_norm_without_eps}), "rms_norm", r"times its tolerance"),
    "write into its operand": (dict(ops={"silu_and_mul": silu_and_mul_in_place}), "silu_and_mul",
                             r"^silu_and_mul wrote into its operand `x`: \d+ elements of the operand"),
    "read past its operand": (dict(ops={"silu_and_mul": silu_and_mul_reading_past_its_operand}), "silu_and_mul",
                            r"elements are NaN .*read outside its operand"),
    "unwritten output": (dict(ops={"rms_norm": rms_norm_leaving_the_last_row_unwritten}), "rms_norm",
                         r"times its tolerance"),
    "KV write past its slots": (dict(attention=WritesPastItsSlots), "attention*",
                                r"a write outside the new tokens' slots|where no new token goes"),
    "KV write past the cache": (dict(attention=WritesPastTheCache), "attention*",
                                r"attention wrote 1 elements outside the KV cache tensor"),
}


@pytest.mark.parametrize("fault", PLANTED)
def test_planted_fault_fails_its_cases(fault):
    kwargs, ops, detail = PLANTED[fault]
    results = run_in_process(PlantedBackend(**kwargs), ops)
    failed = [r for r in results if r.status == "fail"]
    assert failed and all(re.search(detail, r.detail) for r in failed), [r.detail for r in failed]
    if fault == "wrong op":  # eps matters where mean(x**2) is near eps: that case must be among the failures
        assert any("eps=0.001" in r.label for r in failed)
    else:  # every case fails but the variant, fused-RoPE and graph rows, which an attention with forward alone declines
        declined = [r for r in results if r.status == "unsupported"]
        variants = ({"softcap", "window", "softcap+window", "rotary", "rotary+qk_norm", "graph-prefill"}
                    if fault.startswith("KV") else set())
        assert {r.row.rsplit("/", 1)[1] for r in declined} == variants
        assert len(failed) + len(declined) == len(results), [r.label for r in results if r.status != "fail"]


def test_the_unplanted_control_passes():
    results = run_in_process(PlantedBackend(), "rms_norm,silu_and_mul,attention*")
    assert {(r.row, r.status) for r in results} == {("rms_norm", "fallback"), ("silu_and_mul", "fallback"),
                                                    ("attention/reference", "pass"),
                                                    ("attention/reference/fp8-kv", "pass"),
                                                    ("attention/reference/f16-kv", "pass"),
                                                    ("attention/reference/bf16-kv", "pass"),
                                                    ("attention/reference/softcap", "pass"),
                                                    ("attention/reference/window", "pass"),
                                                    ("attention/reference/softcap+window", "pass"),
                                                    ("attention/reference/rotary", "unsupported"),  # no fused RoPE
                                                    ("attention/reference/rotary+qk_norm", "unsupported"),
                                                    ("attention/reference/graph-prefill", "unsupported")}  # 1.16


# ----- end to end -----


def _pip_target(target: Path, source: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
           "--disable-pip-version-check", "--target", str(target), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return target


def _vendor_copy(tmp: Path, name: str, plant: dict[str, list[tuple[str, str]]]) -> Path:
    """A copy of the example plugin with text replacements (file -> [(old, new)]), installed; returns the target."""
    src = shutil.copytree(VENDOR, tmp / f"{name}-src", ignore=IGNORED)
    for file, edits in plant.items():
        path = src / "acme_chitu" / file
        text = path.read_text()
        for old, new in edits:
            assert text.count(old) == 1, (file, old)
            text = text.replace(old, new)
        path.write_text(text)
    return _pip_target(tmp / name, src)


def conformance(cwd: Path, *args: str, paths: tuple[Path, ...] = ()) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m chitu_core.conformance ARGS` with ``paths`` on PYTHONPATH."""
    return finish(start(cwd, *args, paths=paths))


def start(cwd: Path, *args: str, paths: tuple[Path, ...] = (), threads: int | None = None) -> subprocess.Popen:
    """`python -m chitu_core.conformance ARGS` started (``threads``: its OMP_NUM_THREADS)."""
    env = {k: v for k, v in os.environ.items() if k != "CHITU_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen([sys.executable, "-m", "chitu_core.conformance", "--quiet", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a ``start``ed run, within 300 s."""
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def matrix_rows(markdown: str) -> dict[str, list[str]]:
    """op -> [source, a cell per dtype] of the support matrix (the first table of the report)."""
    table = markdown.split("\n| op | source |", 1)[1].split("\n\n", 1)[0]
    return {m[1]: m[2].split(" | ") for m in re.finditer(r"^\| `([^`]+)` \| (.*) \|$", table, re.M)}


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cwd")


@pytest.fixture(scope="module")
def whole_suite(outside, acme) -> dict[str, tuple[int, str, str]]:
    """The two whole-suite runs, the CPU backend's and the example vendor plugin's, side by side on one core
    each: the module's longest waits (on a 2-core machine about 70 s together, 103 one after the other)."""
    runs = {"cpu": start(outside, "--backend", "cpu", "--format", "json", "--output", str(outside / "cpu.json"),
                         threads=1),
            "acme": start(outside, "--backend", "acme", paths=(acme,), threads=1)}
    return {name: finish(proc) for name, proc in runs.items()}


def test_cpu_backend_passes_the_whole_suite(outside, whole_suite):
    code, out, err = whole_suite["cpu"]
    assert code == 0, out + err
    report = json.loads((outside / "cpu.json").read_text())
    env, cases = report["environment"], report["cases"]
    assert {env[k] for k in ("backend", "device", "chitu_core")} == {"cpu", "cpu:0", "0.1.0"}
    assert env["torch"] == torch.__version__ and env["commit"]
    # One declaration: its packed 4-bit linears multiply in bfloat16 (chitu_cpu.packed).
    assert [(d["key"], d["dtype"]) for d in env["declared_thresholds"]] == [("quant_matmul", "float32")]
    assert {c["status"] for c in cases} <= {"pass", "fallback", "unsupported", "skipped"}
    # Every in-tree architecture declares conformance_config(): none is skipped.
    assert [c["row"] for c in cases if c["status"] == "skipped"] == []
    rows = matrix_rows(out)  # the markdown matrix goes to stdout even when the report goes to a file
    assert set(OP_NAMES) | {"attention/sdpa", "sampler", "all_reduce", "send_recv", "quant/unquantized"} <= set(rows)
    for arch in IN_TREE_ARCHITECTURES:
        for what in ("logits", "greedy"):
            source, f32, bf16, f16 = rows[f"model/{arch}/{what}"]
            assert (source, f16) == ("native", "unsupported"), (arch, what)
            assert f32.startswith("pass (") and bf16.startswith("pass ("), (arch, what, f32, bf16)
        # The reference model against transformers (the core's reference ops: a fallback row).
        assert rows[f"model/{arch}/transformers"][1].startswith("fallback ("), arch
    fallbacks = [op for op in OP_NAMES if op not in CpuBackend().native_ops()]
    for op in OP_NAMES:
        source, f32, bf16, f16 = rows[op]
        assert source == ("fallback" if op in fallbacks else "native"), op
        assert f32.startswith("fallback (" if op in fallbacks else "pass ("), (op, f32)
        assert f16 in ("unsupported", "—"), (op, f16)
    assert rows["apply_min_p"][2:] == ["—", "—"] and rows["attention/sdpa"][3] == "unsupported"
    assert all(c["time_us"] is None for c in cases)


def test_perf_mode_times_every_case_it_runs(outside):
    out_file = outside / "perf.json"
    code, out, err = conformance(outside, "--backend", "cpu", "--perf", "--warmup", "1", "--repeats", "2", "--ops",
                                 "rms_norm,linear,all_reduce", "--dtypes", "float32", "--format", "json",
                                 "--output", str(out_file))
    assert code == 0, out + err
    cases = json.loads(out_file.read_text())["cases"]
    assert {c["row"] for c in cases} == {"rms_norm", "linear", "all_reduce"}
    assert all(c["time_us"] > 0 and c["gbps"] > 0 for c in cases)
    assert all(c["tflops"] > 0 for c in cases if c["row"] == "linear")
    assert all(c["tflops"] is None for c in cases if c["row"] != "linear")
    assert "## Performance" in out and "| `all_reduce` | float32 | 1048576 |" in out


def test_parts_merge_into_the_whole_runs_matrix(outside):
    def run(*args):
        code, out, err = conformance(outside, "--backend", "cpu", "--dtypes", "float32,bfloat16", *args)
        assert code == 0, out + err
        return out

    for name, ops in (("norms", "rms_norm,layer_norm"), ("acts", "silu_and_mul")):
        run("--ops", ops, "--format", "json", "--output", str(outside / f"{name}.json"))
    whole = run("--ops", "rms_norm,layer_norm,silu_and_mul")
    code, merged, err = conformance(outside, "--merge", str(outside / "norms.json"), str(outside / "acts.json"))
    assert code == 0, err
    assert matrix_rows(merged) == matrix_rows(whole) and len(matrix_rows(whole)) == 3
    # Parts of another backend (here: its name changed) are refused, with both environments named.
    other = json.loads((outside / "acts.json").read_text())
    other["environment"]["backend"] = "acme"
    (outside / "other.json").write_text(json.dumps(other))
    code, _, err = conformance(outside, "--merge", str(outside / "norms.json"), str(outside / "other.json"))
    assert code == 2 and "'backend': 'acme'" in err and "merge the parts of one run only" in err


@pytest.fixture(scope="module")
def acme(tmp_path_factory) -> Path:
    """The example vendor plugin, installed as is."""
    return _vendor_copy(tmp_path_factory.mktemp("acme"), "acme", {})


def test_example_vendor_plugin_passes_with_fallbacks_and_declarations(whole_suite):
    code, out, err = whole_suite["acme"]
    assert code == 0, out + err
    assert out.startswith("# Conformance: backend `acme` (acme-chitu-backend 0.1.0)\n")
    rows = matrix_rows(out)
    for op in OP_NAMES:
        native = op in ("rms_norm", "silu_and_mul", "greedy_sample")
        assert rows[op][0] == ("native" if native else "fallback"), op
        assert rows[op][1].startswith("pass (" if native else "fallback ("), (op, rows[op])
    source, f32, bf16, f16 = rows["attention/acme-paged"]
    # Head dims 32, 80 and 96 are declined by supports(); bfloat16 runs under the declared threshold (†).
    assert (source, f16) == ("native", "unsupported")
    assert f32.startswith("pass (") and f32.endswith(", 3/17 unsupported")
    assert bf16.startswith("pass (") and bf16.endswith("≤ 1e-04), 3/17 unsupported †")
    assert "| `attention` | bfloat16 | nmse 5e-05, each element within 0.03 of max abs ref | nmse 0.0001" in out
    assert re.search(r"^\d+ cases: \d+ pass, \d+ fallback, \d+ unsupported, 0 skipped, 0 fail$", out, re.M)


def test_planted_wrong_op_fails_and_is_named(outside, tmp_path):
    wrong = _vendor_copy(tmp_path, "wrong", {"ops.py": [(".mean(dim=-1, keepdim=True) + eps)", ".mean(dim=-1, keepdim=True))")]})
    code, out, _ = conformance(outside, "--backend", "acme", "--ops", "rms_norm,silu_and_mul,greedy_sample",
                               "--dtypes", "float32", paths=(wrong,))
    assert code == 1
    rows = matrix_rows(out)
    assert rows["rms_norm"][0] == "native" and rows["rms_norm"][1].startswith("**FAIL** ")
    assert rows["silu_and_mul"][1].startswith("pass (") and rows["greedy_sample"] == ["native", "pass (exact)"]
    failures = out.split("## Failures\n\n", 1)[1].strip().splitlines()
    assert failures and all(line.startswith("- `rms_norm` [float32] ") for line in failures)
    assert any("eps=0.001" in line and "times its tolerance" in line for line in failures)


def test_planted_out_of_bounds_writes_are_caught(outside, tmp_path):
    plant = {"attention.py": [("        slots[slot_mapping, 1] = v.to(kv_cache.dtype)\n",
                               "        slots[slot_mapping + 1, 1] = v.to(kv_cache.dtype)\n"
                               "        slots[slot_mapping, 1] = v.to(kv_cache.dtype)\n")],
             "ops.py": [("return gate * torch.sigmoid(gate) * up", "return gate.mul_(torch.sigmoid(gate)) * up")]}
    bad = _vendor_copy(tmp_path, "oob", plant)
    code, out, _ = conformance(outside, "--backend", "acme", "--ops", "silu_and_mul,attention*,greedy_sample",
                               "--dtypes", "float32", paths=(bad,))
    assert code == 1
    rows = matrix_rows(out)
    assert rows["silu_and_mul"] == ["native", "**FAIL** 6/6"] and rows["greedy_sample"] == ["native", "pass (exact)"]
    assert rows["attention/acme-paged"][1].startswith("**FAIL** ")
    failures = out.split("## Failures\n\n", 1)[1].strip().splitlines()
    assert any(re.match(r"- `silu_and_mul` \[float32\] .*: silu_and_mul wrote into its operand `x`", f) for f in failures)
    assert any(re.match(r"- `attention/acme-paged` \[float32\] .*(a write outside the new tokens' slots|"
                        r"where no new token goes)", f) for f in failures), failures


def test_pytest_entry_runs_the_suite_and_prints_the_matrix(outside):
    def pytest_run(*args):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                               "chitu_core.conformance", *args], cwd=outside, capture_output=True, text=True, timeout=300)
        return proc.returncode, proc.stdout

    code, out = pytest_run("--backend", "cpu", "--conformance-ops", "rms_norm,embedding",
                           "--conformance-dtypes", "float32,float16")
    assert code == 0, out
    assert re.search(r"^12 passed, 12 skipped", out, re.M), out
    assert "| `rms_norm` | native | pass (" in out and "| `embedding` | native | pass (exact) | unsupported |" in out
    code, out = pytest_run()
    assert code == 0 and re.search(r"^1 skipped", out, re.M), out
    code, out = pytest_run("--backend", "nonexistent")
    assert code != 0 and "no backend named 'nonexistent' is installed" in out
