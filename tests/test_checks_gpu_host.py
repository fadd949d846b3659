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
from tests.support.examples import examples

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


# ------------------------------------------------------------------------------------------------ the box's GPUs
# (checks.check_gpu_box, install's refusal and the unit's SupplementaryGroups=): real character nodes (mknod, major
# 195; opening one fails here, no driver) and /proc/driver/nvidia/gpus/*/information in the driver's own format (as
# read on the H200 of the GPU rehearsal: tests/data/gpu-rehearsal/).

import grp  # noqa: E402
import stat  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from deploy_tool import gpu as gpu_mod  # noqa: E402

BOX_IDS = ("cuda-no-driver", "gpu-missing", "gpu-nodes-closed")
INFO = ("Model: \t\t NVIDIA GeForce RTX 2080 Ti\nIRQ:   \t\t 150\nGPU UUID: \t GPU-{minor}\nVideo BIOS: \t ??.??.??.??.??\n"
        "Bus Type: \t PCIe\nDMA Size: \t 47 bits\nDMA Mask: \t 0x7fffffffffff\nBus Location: \t {bus}\n"
        "Device Minor: \t {minor}\nGPU Excluded:\t No\n")


def _gpu_box(root: Path, *, minors: tuple[int, ...] | None = (0, 1), mode: int = 0o666, gid: int = 0) -> Path:
    """A host tree with the NVIDIA driver's GPU list (None: no driver) and real nodes of the given mode/group."""
    if minors is not None:
        for i, m in enumerate(minors):
            d = root / "proc" / "driver" / "nvidia" / "gpus" / f"0000:0{i + 1}:00.0"
            d.mkdir(parents=True)
            (d / "information").write_text(INFO.format(minor=m, bus=f"0000:0{i + 1}:00.0"))
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for name, minor in [*((f"nvidia{m}", m) for m in (minors or ())), ("nvidiactl", 255)]:
        p = root / "dev" / name
        os.mknod(p, stat.S_IFCHR | mode, os.makedev(195, minor))
        os.chmod(p, mode)
        os.chown(p, 0, gid)
    os.mknod(root / "dev" / "nvidia-uvm", stat.S_IFCHR | mode, os.makedev(238, 0))
    os.chmod(root / "dev" / "nvidia-uvm", mode)
    os.chown(root / "dev" / "nvidia-uvm", 0, gid)
    return root


def _box(tmp: Path, monkeypatch: pytest.MonkeyPatch, root: Path, **cfg_keys: object) -> dict[str, checks.Finding]:
    monkeypatch.setattr(checks, "HOST_ROOT", str(root))
    data = example_dict("two-2080ti")
    for k, v in cfg_keys.items():
        section, key = k.split("__")
        data.setdefault(section, {})[key] = v
    cfg = load_dict(tmp / "cfg", data)
    found = [f for f in checks.run_checks(cfg, inspect_files=False, on_box=True) if f.id in BOX_IDS]
    assert [f.id for f in checks.gpu_box_errors(cfg)] == [f.id for f in found]  # what install refuses
    return {f.id: f for f in found}


def _video_gid() -> tuple[str, int]:
    g = grp.getgrnam("video")
    return g.gr_name, g.gr_gid


def test_a_box_with_its_gpus_open_to_all_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Driver loaded, both GPUs of host.gpus listed by it, nodes 0666 (the usual install): nothing to refuse."""
    assert _box(tmp_path, monkeypatch, _gpu_box(tmp_path / "h")) == {}


def test_no_driver_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got = _box(tmp_path, monkeypatch, _gpu_box(tmp_path / "h", minors=None))
    f = got["cuda-no-driver"]
    assert set(got) == {"cuda-no-driver"} and f.severity == "error"
    assert "/proc/driver/nvidia is missing" in f.message and "ftllm-dflash, llamacpp-tensor" in f.message
    assert "install and load the NVIDIA driver" in f.fix and "device: cpu" in f.fix


def test_a_gpu_the_driver_lacks_is_named_with_what_there_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got = _box(tmp_path, monkeypatch, _gpu_box(tmp_path / "h", minors=(0,)))
    f = got["gpu-missing"]
    assert "GPU 1," in f.message and "(/dev/nvidia1)" in f.message
    assert "0 (NVIDIA GeForce RTX 2080 Ti, 0000:01:00.0)" in f.message and "Device Minor" in f.fix


def test_minors_come_from_the_driver_not_the_directory_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """host.gpus names minors: a box whose driver numbers its two GPUs 2 and 3 lacks GPUs 0 and 1."""
    root = _gpu_box(tmp_path / "h", minors=(2, 3))
    assert [g.minor for g in gpu_mod.driver_gpus(str(root)) or []] == [2, 3]
    assert "GPUs 0, 1, but" in _box(tmp_path, monkeypatch, root)["gpu-missing"].message
    assert _box(tmp_path / "b", monkeypatch, root, host__gpus=[2, 3]) == {}


def test_0660_video_nodes_need_the_group_and_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes 0660 root:video (NVreg_DeviceFileMode=0660): the DynamicUser cannot open them (measured on the H200,
    with or without PrivateUsers=) until host.gpu_group grants the group, which the cuda units then carry."""
    name, gid = _video_gid()
    root = _gpu_box(tmp_path / "h", mode=0o660, gid=gid)
    f = _box(tmp_path, monkeypatch, root)["gpu-nodes-closed"]
    assert f"group {name}" in f.message and "0660" in f.message and "host.gpu_group unset" in f.message
    assert f.fix.startswith(f"set host.gpu_group: {name}")
    assert _box(tmp_path / "b", monkeypatch, root, host__gpu_group=name) == {}
    cfg = load_dict(tmp_path / "c", {**example_dict("two-2080ti"),
                                     "host": {**example_dict("two-2080ti")["host"], "gpu_group": name}})
    for f2 in render.render_all(cfg):
        if f2.kind == "unit" and f2.name.removesuffix(".service") in cfg.backends:
            assert f"SupplementaryGroups={name}" in f2.content.splitlines()


@settings(max_examples=examples(60), deadline=None)
@given(mode=st.integers(0, 0o777), grant=st.sampled_from([None, "video", "render"]), user=st.sampled_from(["dynamic", "root"]))
def test_closed_exactly_when_neither_world_nor_a_granted_group_can_read_and_write(
        tmp_path_factory: pytest.TempPathFactory, mode: int, grant: str | None, user: str) -> None:
    """Over every mode: a node is closed to the service user iff it is not root's to open, its other bits lack
    rw, and its group bits lack rw or its group is not the one granted."""
    root = tmp_path_factory.mktemp("box")
    _, gid = _video_gid()
    _gpu_box(root, mode=mode, gid=gid)
    nodes = gpu_mod.box_nodes((0, 1), str(root))
    assert all(n is not None and n.mode == mode for n in nodes.values())
    closed = gpu_mod.closed_nodes(nodes, groups=[grant] if grant else [])
    world = mode & 0o006 == 0o006
    group = mode & 0o060 == 0o060 and grant == "video"
    assert (closed == []) == (world or group)
    data = example_dict("two-2080ti")
    data["serve"] = {**data.get("serve", {}), "user": user}
    if grant:
        data["host"] = {**data["host"], "gpu_group": grant}
    cfg = load_dict(root / "cfg", data)
    old = checks.HOST_ROOT
    checks.HOST_ROOT = str(root)
    try:
        ids = {f.id for f in checks.gpu_box_errors(cfg)}
    finally:
        checks.HOST_ROOT = old
    assert ("gpu-nodes-closed" in ids) == (user != "root" and not (world or group))


def test_gpu_code_jit_and_missing_on_real_fatbins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A llama-server (here a real nvcc-built library in its place) with only compute_75 PTX on a 9.0 box: the
    first start JITs (info, naming the cache that keeps it); with only an sm_75 cubin nothing runs there (error)."""
    from tests.support import native

    monkeypatch.setattr(checks, "HOST_ROOT", str(_gpu_box(tmp_path / "h", minors=(0,))))
    for gencode, want in (("arch=compute_75,code=compute_75", "gpu-jit-first-start"),
                          ("arch=compute_75,code=sm_75", "gpu-code-missing"),
                          ("arch=compute_90,code=sm_90", None)):
        d = tmp_path / gencode.replace(",", "_").replace("=", "-")
        binary = native.build_cuda_so(d / "llama-server", gencode)
        data = example_dict("two-2080ti")
        data["host"] = {**data["host"], "gpus": [0], "compute_capability": "9.0"}
        data["backends"] = {"llamacpp-tensor": {**data["backends"]["llamacpp-tensor"], "binary": str(binary),
                                                "split_mode": None}}
        data["default_backend"] = "llamacpp-tensor"
        cfg = load_dict(d / "cfg", data)
        found = [f for f in checks.run_checks(cfg, inspect_files=True, on_box=True)
                 if f.id in ("gpu-jit-first-start", "gpu-code-missing")]
        assert [f.id for f in found] == ([want] if want else []), found
        if want == "gpu-jit-first-start":
            assert "PTX: sm_75" in found[0].message and "/var/cache/deploytool-llamacpp-tensor/cuda" in found[0].message
        errs = [f.id for f in checks.gpu_box_errors(cfg)]
        assert ("gpu-code-missing" in errs) == (want == "gpu-code-missing")
