"""The Triton-capable backends (NVIDIA, Hygon, MetaX) on the core's ``TritonBackend``: detection never
picks the wrong one, and the Hygon and MetaX plugins install alone and say why they are unavailable.

Detection is checked by faking what each vendor's PyTorch build reports (``torch.version.cuda`` /
``hip``, device names, AMD-style gcn architectures) on this CPU-only machine: for each stack exactly
the vendor's backend is available. Nothing here proves the kernels on the vendors' devices (none is
reachable here); that is the plugins' READMEs' status table.
"""

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import chitu_core.kernels.triton.backend as triton_backend

REPO = Path(__file__).resolve().parents[1]
for plugin in ("hygon", "muxi"):  # imported from the checkout (CI installs neither)
    sys.path.insert(0, str(REPO / "plugins" / plugin))
HygonBackend = importlib.import_module("chitu_hygon.backend").HygonBackend
MuxiBackend = importlib.import_module("chitu_muxi.backend").MuxiBackend
NvidiaBackend = importlib.import_module("chitu_nvidia.backend").NvidiaBackend

STACKS = {  # name -> (torch.version.cuda, torch.version.hip, device name, gcn arch, capability)
    "nvidia-h100": ("12.8", None, "NVIDIA H100 80GB HBM3", "", (9, 0)),
    "nvidia-a100": ("12.8", None, "NVIDIA A100-SXM4-80GB", "", (8, 0)),
    "nvidia-v100": ("12.8", None, "Tesla V100-SXM2-32GB", "", (7, 0)),
    "metax-c500": ("11.6", None, "MetaX C500", "", (8, 0)),
    "metax-4000": ("11.6", None, "4000", "", (8, 0)),
    "nvidia-rtx-4000": ("12.8", None, "NVIDIA RTX 4000 Ada Generation", "", (8, 9)),
    "hygon-k100": (None, "6.2.41134", "K100_AI", "gfx928", (9, 2)),
    "hygon-bw": (None, "6.3.0", "BW1000", "gfx936", (9, 3)),
    "amd-mi300x": (None, "6.2.41134", "AMD Instinct MI300X", "gfx942:sramecc+:xnack-", (9, 4)),
    "cpu-only": (None, None, None, "", None),
}
EXPECTED = {"nvidia-h100": "nvidia", "nvidia-a100": "nvidia", "nvidia-v100": None, "metax-c500": "muxi",
            "metax-4000": "muxi", "nvidia-rtx-4000": "nvidia", "hygon-k100": "hygon", "hygon-bw": "hygon",
            "amd-mi300x": None, "cpu-only": None}


def fake_stack(monkeypatch, stack: str) -> None:
    cuda, hip, name, arch, capability = STACKS[stack]
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(triton_backend, "triton_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=0: SimpleNamespace(name=name, gcnArchName=arch))


@pytest.mark.parametrize("stack", STACKS)
def test_each_stack_is_claimed_by_its_vendors_backend_alone(monkeypatch, stack):
    fake_stack(monkeypatch, stack)
    monkeypatch.delenv(triton_backend.EMULATE_ENV, raising=False)
    verdicts = {cls.name: cls().is_available() for cls in (NvidiaBackend, HygonBackend, MuxiBackend)}
    available = [name for name, v in verdicts.items() if v.available]
    assert available == ([EXPECTED[stack]] if EXPECTED[stack] else []), verdicts
    for name, v in verdicts.items():  # every refusal says what it saw
        assert v.available or v.reason, name


def test_emulation_skips_only_the_vendor_checks_of_the_backend_it_names(monkeypatch):
    fake_stack(monkeypatch, "nvidia-h100")
    monkeypatch.setenv(triton_backend.EMULATE_ENV, "hygon")
    assert HygonBackend().is_available().available and not MuxiBackend().is_available().available
    assert NvidiaBackend().is_available().available  # the device's own backend is unaffected
    fake_stack(monkeypatch, "cpu-only")
    assert "no device is visible" in HygonBackend().is_available().reason  # a device is still needed


def test_the_vendors_kernel_configurations_differ_where_their_devices_do():
    hygon_attn, _ = HygonBackend().attention_classes()
    muxi_attn, _ = MuxiBackend().attention_classes()
    nvidia_attn, _ = NvidiaBackend().attention_classes()
    assert hygon_attn.tiles.warps * 2 == nvidia_attn.tiles.warps  # 64-wide wavefronts: half the warps
    assert not hygon_attn.supports_fp8_kv_cache and not muxi_attn.supports_fp8_kv_cache  # no FP8 units
    assert {hygon_attn.name, muxi_attn.name, nvidia_attn.name} == {"triton-dcu", "triton-maca", "triton"}
    for backend in (HygonBackend(), MuxiBackend()):  # soft FP8: the bytes decoded in registers
        assert backend.extra_ops()["fp8_linear"].__name__ == "fp8_linear_bytes"
        assert backend.quant_preferences("fp8") == {"act_quant": False}


def test_hygon_and_metax_install_alone_and_say_why_they_are_unavailable(tmp_path):
    """pip installs each with --no-deps (no vendor stack, torch untouched); the inventory lists it with
    an actionable reason on this CPU-only machine."""
    target = tmp_path / "site"
    for plugin in ("hygon", "muxi"):
        src = shutil.copytree(REPO / "plugins" / plugin, tmp_path / plugin,
                              ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                        "--disable-pip-version-check", "--target", str(target), str(src)], check=True)
    assert not list(target.glob("torch*")), "a plugin brought torch"
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "chitu_core.plugins", "--json"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout
    backends = {b["name"]: b for b in json.loads(out)["backends"]}
    assert "not a ROCm/HIP build" in backends["hygon"]["reason"] and "DTK" in backends["hygon"]["reason"]
    assert "not MetaX's MACA build" in backends["muxi"]["reason"]
    assert not backends["hygon"]["available"] and not backends["muxi"]["available"]
