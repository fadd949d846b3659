"""GPU residency (deploy_tool.gpu, runtime.gpu_residency) on process trees laid out as /proc shows them, the
driver's GPU list, and nvidia-smi's compute-apps CSV; plus the one log line llama-server writes when its CUDA init
fails (as captured on the H200: tests/data/gpu-rehearsal/ and the hardened-unit evidence).
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from deploy_tool import gpu
from deploy_tool.box import runtime
from tests.support.examples import examples


def _proc(root: Path, tree: dict[int, list[int]], fds: dict[int, list[str]], unreadable: tuple[int, ...] = ()) -> str:
    """A /proc with processes `tree` (pid -> children) holding `fds` (pid -> targets of their fd links)."""
    for pid, kids in tree.items():
        task = root / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (task / "children").write_text(" ".join(map(str, kids)) + (" " if kids else ""))
        (root / str(pid) / "stat").write_text(f"{pid} (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n")
        if pid in unreadable:
            continue
        fd = root / str(pid) / "fd"
        fd.mkdir()
        for i, target in enumerate(fds.get(pid, [])):
            os.symlink(target, fd / str(i))
    return str(root)


def test_a_server_holding_its_gpus_through_a_child_is_resident(tmp_path: Path) -> None:
    """The nodes may be held by a child process (ftllm's workers): the whole tree counts."""
    proc = _proc(tmp_path, {10: [11], 11: []}, {10: ["/dev/null", "/dev/nvidiactl", "/dev/nvidia-uvm"],
                                                 11: ["/dev/nvidia0", "/dev/nvidia1", "socket:[1]"]})
    res = runtime.gpu_residency(10, (0, 1), proc=proc)
    assert res.ok and res.known and res.missing == ()
    assert res.held == ("/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl")
    assert runtime.residency_finding(res, "x") is None


def test_ctl_and_uvm_alone_are_a_cpu_fallback(tmp_path: Path) -> None:
    """A process whose CUDA init failed may still hold nvidiactl and nvidia-uvm: only the GPUs' own nodes count."""
    proc = _proc(tmp_path, {10: []}, {10: ["/dev/nvidiactl", "/dev/nvidia-uvm"]})
    res = runtime.gpu_residency(10, (0,), proc=proc)
    f = runtime.residency_finding(res, "llamacpp-tensor")
    assert f is not None and f.status == runtime.FAIL
    assert "runs without its GPU: no process of it holds /dev/nvidia0" in f.message
    assert "fell back to the CPU" in f.message


def test_unreadable_fds_are_unknown_not_a_pass(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {10: []}, {}, unreadable=(10,))
    res = runtime.gpu_residency(10, (0,), proc=proc)
    assert not res.known
    f = runtime.residency_finding(res, "x")
    assert f is not None and f.status == runtime.UNKNOWN and "cannot be read" in f.message


@settings(max_examples=examples(200), deadline=None)
@given(gpus=st.sets(st.integers(0, 7), min_size=1, max_size=4),
       held=st.lists(st.sets(st.integers(0, 7), max_size=4), min_size=1, max_size=3))
def test_resident_exactly_when_the_tree_holds_every_configured_gpu(tmp_path_factory, gpus, held) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("proc")
    pids = list(range(100, 100 + len(held)))
    tree = {p: ([pids[i + 1]] if i + 1 < len(pids) else []) for i, p in enumerate(pids)}
    proc = _proc(root, tree, {p: [f"/dev/nvidia{g}" for g in h] + ["/dev/nvidiactl"] for p, h in zip(pids, held, strict=True)})
    res = runtime.gpu_residency(pids[0], sorted(gpus), proc=proc)
    assert res.ok == (gpus <= set().union(*held))
    assert set(res.missing) == {f"/dev/nvidia{g}" for g in gpus - set().union(*held)}


def test_compute_apps_csv() -> None:
    """nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits (and with units), one line a
    process and GPU: summed per process."""
    assert gpu.parse_compute_apps("14281, 670\n") == {14281: 670}
    assert gpu.parse_compute_apps("11374, 726 MiB\n11374, 100 MiB\nNo running processes found\n") == {11374: 826}
    assert gpu.parse_compute_apps("pid, used_gpu_memory [MiB]\n") == {}


def test_the_cuda_init_failure_line_fails_a_cuda_backend() -> None:
    """The exact line of the H200 runs (nodes closed, class not allowed, uvm broken): a cuda backend fails the check;
    the same log is no finding for a cpu backend."""
    log = ("0.00.003.196 E ggml_cuda_init: failed to initialize CUDA: unknown error\n"
           "0.00.385.497 I srv  llama_server: listening on http://0.0.0.0:8082\n")
    f = runtime.detect_cpu_fallback("llamacpp", log, "cuda")
    assert f is not None and f.status == runtime.FAIL and "unknown error" in f.message
    assert runtime.detect_cpu_fallback("llamacpp", log, "cpu") is None
