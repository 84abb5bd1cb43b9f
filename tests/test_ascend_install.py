"""chitu-ascend installs alone on a machine without CANN or torch_npu, and says why it cannot run.

pip installs it from a copy of plugins/ascend with --no-deps into a target directory (the vendor stack is
no pip dependency, and torch stays as installed); `python -m chitu_core.plugins` then lists it, without the
stand-in torch_npu on the path, as unavailable with the import error and what to install.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ascend_installs_alone_and_lists_itself_unavailable_with_the_reason(tmp_path):
    src = shutil.copytree(REPO / "plugins" / "ascend", tmp_path / "ascend",
                          ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                    "--disable-pip-version-check", "--target", str(target), str(src)], check=True)
    assert not list(target.glob("torch*")), "the plugin brought torch or torch_npu"
    assert (target / "chitu_ascend" / "backend.py").exists()
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}  # no stand-in here
    probe = "import json, chitu_core.plugins.inventory as i; print(json.dumps({'inv': i.inventory()}))"
    out = json.loads(subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                                    text=True, check=True).stdout)
    ascend = {b["name"]: b for b in out["inv"]["backends"]}["ascend"]
    assert ascend["loaded"] and not ascend["available"] and ascend["distribution"] == "chitu-ascend"
    assert "torch_npu is not importable (ModuleNotFoundError" in ascend["reason"]
    assert "install CANN and the torch_npu wheel" in ascend["reason"]
    assert ascend["device_type"] == "npu" and ascend["process_group_backend"] == "hccl"
    assert "rms_norm" not in ascend["fallback_ops"] and "apply_min_p" in ascend["fallback_ops"]
    text = subprocess.run([sys.executable, "-m", "chitu_core.plugins"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, check=True).stdout
    assert "ascend" in text and "unavailable: torch_npu is not importable" in text
