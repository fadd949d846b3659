"""Boot-safe GPU access checks (checks.check_gpu_boot) on fake host trees: /proc/devices, /dev, nvidia-modprobe,
modules-load.d and the unit directories under checks.HOST_ROOT. No NVIDIA driver can exist here; the files the
checks read are what a box shows (the /proc/devices text is one of a box with driver 5xx: majors 195, 234-237).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deploy_tool import checks, render
from tests.support.configs import example_dict, load_dict

GPU_IDS = ("gpu-device-classes", "nvidia-uvm-not-at-boot", "nvidia-modprobe-missing", "nvidia-persistenced-absent")

PROC_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
  5 /dev/tty
195 nvidia-frontend
234 nvidia-nvswitch
235 nvidia-caps
236 nvidia-uvm
237 nvidia-nvlink

Block devices:
  8 sd
259 blkext
"""


def _host(root: Path, *, devices: str | None = PROC_DEVICES, modprobe: bool = True, uvm_conf: bool = True,
           persistenced: bool = True, nodes: tuple[str, ...] = ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1")) -> Path:
    (root / "proc").mkdir(parents=True)
    if devices is not None:
        (root / "proc" / "devices").write_text(devices)
    (root / "dev").mkdir()
    for n in nodes:
        (root / "dev" / n).write_text("")
    if modprobe:
        exe = root / render.NVIDIA_MODPROBE.lstrip("/")
        exe.parent.mkdir(parents=True)
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    if uvm_conf:
        (root / "etc" / "modules-load.d").mkdir(parents=True)
        (root / "etc" / "modules-load.d" / "nvidia.conf").write_text("# CUDA\nnvidia-uvm\n")
    if persistenced:
        (root / "lib" / "systemd" / "system").mkdir(parents=True)
        (root / "lib" / "systemd" / "system" / render.NVIDIA_PERSISTENCED).write_text("[Service]\n")
    return root


def _run(tmp: Path, monkeypatch: pytest.MonkeyPatch, root: Path, example: str = "two-2080ti",
         on_box: bool = True) -> dict[str, checks.Finding]:
    monkeypatch.setattr(checks, "HOST_ROOT", str(root))
    cfg = load_dict(tmp / "cfg", example_dict(example))
    found = checks.run_checks(cfg, inspect_files=False, on_box=on_box)
    gpu = [f for f in found if f.id in GPU_IDS]
    assert len({f.id for f in gpu}) == len(gpu)  # one finding per id, box-wide
    return {f.id: f for f in gpu}


def test_a_well_prepared_box_gets_only_the_explanation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-modprobe in place, nvidia-uvm loaded at boot, nvidia-persistenced installed: only the info that
    explains the class form, with what /proc/devices lists."""
    got = _run(tmp_path, monkeypatch, _host(tmp_path / "host"))
    assert set(got) == {"gpu-device-classes"}
    f = got["gpu-device-classes"]
    assert f.severity == "info" and f.backend is None
    for piece in ("ftllm-dflash, llamacpp-tensor", "char-nvidia-uvm", "silently drops", "/dev/nvidia-uvm",
                  "lists nvidia-frontend, nvidia-uvm, nvidia-caps", "not nvidia, nvidiactl"):
        assert piece in f.message, (piece, f.message)


def test_missing_nvidia_modprobe_is_a_warning_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got = _run(tmp_path, monkeypatch, _host(tmp_path / "host", modprobe=False, nodes=("nvidiactl", "nvidia0")))
    f = got["nvidia-modprobe-missing"]
    assert f.severity == "warning"
    for piece in (f"{render.NVIDIA_MODPROBE} does not exist", "NoNewPrivileges=yes", "cold boot",
                  "missing: /dev/nvidia-uvm, /dev/nvidia1"):
        assert piece in f.message, (piece, f.message)
    assert "apt install nvidia-modprobe" in f.fix


def test_uvm_not_loaded_at_boot_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No modules-load.d entry: warned, saying whether the module is loaded now; /etc/modules counts too."""
    got = _run(tmp_path, monkeypatch, _host(tmp_path / "host", uvm_conf=False))
    f = got["nvidia-uvm-not-at-boot"]
    assert f.severity == "warning" and "loaded now" in f.message and "before any ExecStartPre" in f.message
    assert "/etc/modules-load.d/nvidia-uvm.conf" in f.fix
    no_uvm = PROC_DEVICES.replace("236 nvidia-uvm\n", "")
    got = _run(tmp_path / "b", monkeypatch, _host(tmp_path / "host2", uvm_conf=False, devices=no_uvm))
    assert "not loaded now" in got["nvidia-uvm-not-at-boot"].message
    assert "(not nvidia, nvidiactl, nvidia-uvm:" in got["gpu-device-classes"].message
    root = _host(tmp_path / "host3", uvm_conf=False)
    (root / "etc").mkdir()
    (root / "etc" / "modules").write_text("# /etc/modules\nloop\nnvidia_uvm  # for CUDA\n")
    assert "nvidia-uvm-not-at-boot" not in _run(tmp_path / "c", monkeypatch, root)


def test_absent_persistenced_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got = _run(tmp_path, monkeypatch, _host(tmp_path / "host", persistenced=False))
    f = got["nvidia-persistenced-absent"]
    assert f.severity == "info" and "orders nothing here (harmless)" in f.message
    assert "enable nvidia-persistenced" in f.fix


def test_unreadable_proc_devices_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got = _run(tmp_path, monkeypatch, _host(tmp_path / "host", devices=None))
    assert "/proc/devices cannot be read here" in got["gpu-device-classes"].message


def test_not_on_the_box_or_cpu_only_stays_quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A laptop checking the box's config (not the box), and a cpu-only config on the box: no GPU finding."""
    bare = _host(tmp_path / "host", devices=None, modprobe=False, uvm_conf=False, persistenced=False, nodes=())
    assert _run(tmp_path / "a", monkeypatch, bare, on_box=False) == {}
    assert _run(tmp_path / "b", monkeypatch, bare, example="cpu-demo") == {}


def test_findings_are_not_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare host warns but never refuses: a switch's preflight stops on errors only."""
    bare = _host(tmp_path / "host", devices=None, modprobe=False, uvm_conf=False, persistenced=False, nodes=())
    got = _run(tmp_path, monkeypatch, bare)
    assert set(got) == set(GPU_IDS)
    assert {f.severity for f in got.values()} <= {"info", "warning"}


def test_the_machine_itself_by_default() -> None:
    """Without a test's tree the checks read this machine's own files."""
    assert checks.HOST_ROOT == "/" and checks._host("/proc/devices") == Path("/proc/devices")
    assert os.path.exists(checks._host("/proc/devices"))
