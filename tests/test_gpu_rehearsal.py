"""What the GPU rehearsal brought back from a real NVIDIA GPU (scripts/gpu-rehearsal.sh device; the data in
tests/data/gpu-rehearsal/, its README says what ran), read by deploytool's own parsers here, where no GPU exists:
the driver's GPU list, the served process's device descriptors and GPU memory, the llama-server startup log at
-lv 4 (capacity read-back, GPU use) and its one line when CUDA init fails, and what the box's `check` said of
nodes at 0660 root:video.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deploy_tool import gpu
from deploy_tool.box import runtime

DATA = Path(__file__).resolve().parent / "data" / "gpu-rehearsal"


def _step(name: str) -> tuple[int, str]:
    return int((DATA / "steps" / f"{name}.rc").read_text()), (DATA / "steps" / f"{name}.out").read_text()


def _journal() -> str:
    return (DATA / "journal.txt").read_text()


def _server_logs() -> dict[int, str]:
    """The journal's llama-server lines by process, in order."""
    out: dict[int, list[str]] = {}
    for ln in _journal().splitlines():
        m = re.search(r" llama-server\[(\d+)\]: (.*)$", ln)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return {pid: "\n".join(lines) for pid, lines in out.items()}


def test_the_driver_gpu_list_as_the_driver_wrote_it(tmp_path: Path) -> None:
    """/proc/driver/nvidia/gpus/*/information as captured: driver_gpus finds GPU minor 0, and names it as nvidia-smi
    did in the same capture (its `--query-gpu name,...` CSV line)."""
    text = (DATA / "machine.txt").read_text()
    sections = re.findall(r"## /proc/driver/nvidia/gpus/([^/]+)/information\n(.*?)(?=\n## )", text, re.S)
    assert sections, "no GPU information captured"
    for bus, info in sections:
        d = tmp_path / "proc/driver/nvidia/gpus" / bus
        d.mkdir(parents=True)
        (d / "information").write_text(info + "\n")
    smi = re.search(r"^name, driver_version, compute_cap, memory.total \[MiB\]\n([^,\n]+),", text, re.M)
    assert smi, "no nvidia-smi GPU line captured"
    gpus = gpu.driver_gpus(str(tmp_path))
    assert gpus is not None and [(g.minor, g.model) for g in gpus] == [(0, smi.group(1))]
    assert smi.group(1).startswith("NVIDIA H")  # the rehearsal's machines: one H100 or H200


def test_the_served_process_held_its_gpu_and_used_its_memory() -> None:
    """After install: status --deep said the server holds /dev/nvidia0 (from /proc/PID/fd), which the raw fd list
    agrees with, and nvidia-smi's compute-apps CSV gives that host PID its GPU memory."""
    ev = DATA / "evidence" / "installed"
    st = json.loads((ev / "status-deep.json").read_text())
    g = st["gpu"]
    assert g["ok"] and g["required"] == ["/dev/nvidia0"] and "/dev/nvidia0" in g["held"]
    fds = (ev / "device-fds.txt").read_text()
    assert re.search(r"^\s*\d+ /dev/nvidia0$", fds, re.M) and re.search(r"^\s*\d+ /dev/nvidia-uvm$", fds, re.M)
    pid = int((ev / "host-pid.txt").read_text())
    apps = gpu.parse_compute_apps((ev / "compute-apps.csv").read_text())
    assert apps.get(pid, 0) > 100 and g["memory_mib"] == apps[pid]
    assert st["verdict"]["state"] == "serving"


def test_the_cuda_libraries_were_mapped() -> None:
    maps = (DATA / "evidence" / "installed" / "maps.txt").read_text().splitlines()
    names = {Path(p).name.split(".so")[0] for p in maps}
    assert {"libcudart", "libcublas", "libcublasLt", "libcuda"} <= names


def test_the_startup_log_reads_back_its_capacity_on_the_gpu() -> None:
    """The first server's -lv 4 log: no CPU fallback, and the KV read back on CUDA0 for its -c 4096."""
    logs = _server_logs()
    first = logs[min(logs)]
    assert runtime.detect_cpu_fallback("llamacpp", first, "cuda") is None
    cap = runtime.capacity_truth("llamacpp", first, 4096)
    assert cap.ceiling_tokens == 4096 and "CUDA0" in cap.message


def test_every_lost_gpu_start_said_so_in_its_log() -> None:
    """Each server process whose CUDA init failed logged ggml_cuda_init's line; the CPU-fallback check fails it."""
    failed = [t for t in _server_logs().values() if "failed to initialize CUDA" in t]
    assert len(failed) >= 4  # nodev, nouvm, cpu fallback, 0660, the failover's restart
    for t in failed:
        f = runtime.detect_cpu_fallback("llamacpp", t, "cuda")
        assert f is not None and f.status == runtime.FAIL


@pytest.mark.parametrize("step, code, words", [
    ("lost-nodev", 10, ["invalid device: CUDA0"]),
    ("lost-nouvm", 10, ["invalid device: CUDA0"]),
    ("lost-cpu-fallback", 10, ["runs without its GPU", "no process of it holds /dev/nvidia0"]),
    ("lost-0660", 10, ["invalid device: CUDA0"]),
])
def test_each_lost_gpu_rolled_back_and_never_served_on_the_cpu(step: str, code: int, words: list[str]) -> None:
    rc, out = _step(step)
    assert rc == code, out
    for w in words:
        assert w in out, (w, out[-1500:])
    assert "llamacpp-gpu2 was restored and is serving again" in out or "rolling back" in out


def test_the_nodes_made_again_from_nothing_by_the_units_lines() -> None:
    """All four nodes deleted in the sandbox's /dev: the units' nvidia-modprobe lines made them again, with
    nvidia-uvm at 238:0 (the old `-u -c=N` lines moved it), and the server started on the GPU."""
    rc, out = _step("cold-nodes")
    assert rc == 0, out
    nodes = (DATA / "cold-nodes-after.txt").read_text()
    for n, num in (("nvidia0", "195,   0"), ("nvidiactl", "195, 255"), ("nvidia-uvm", "238,   0"),
                   ("nvidia-uvm-tools", "238,   1")):
        assert re.search(rf"^crw-rw-rw- .* {num} .* /dev/{n}$", nodes, re.M), (n, nodes)


def test_check_on_the_box_named_the_0660_nodes_and_the_group_fixed_it() -> None:
    rc, out = _step("check-0660")
    assert rc == 4
    closed = [f for f in json.loads(out)["findings"] if f["id"] == "gpu-nodes-closed"]
    assert len(closed) == 1 and "group video" in closed[0]["message"] and "host.gpu_group: video" in closed[0]["fix"]
    rc, out = _step("group-0660")
    assert rc == 0 and "serving" in out
    groups = (DATA / "evidence" / "group-0660" / "proc-status.txt").read_text()
    assert re.search(r"^Groups:\s.*\b44\b", groups, re.M)  # video, through SupplementaryGroups=


def test_the_failover_after_a_crash_into_a_lost_gpu() -> None:
    """The active server killed while its GPU access is gone: its restart failed CUDA init, the start limit gave up,
    and the failover unit switched to the other backend, which serves from the GPU."""
    events = [json.loads(ln) for ln in (DATA / "history.jsonl").read_text().splitlines()]
    fo = [e for e in events if e["event"] == "failover"]
    assert fo and fo[-1]["result"] == "ok" and fo[-1]["to_backend"] == "llamacpp-gpu2"
    st = json.loads((DATA / "evidence" / "failover" / "status-deep.json").read_text())
    assert st["active_backend"] == "llamacpp-gpu2" and st["gpu"]["ok"]
