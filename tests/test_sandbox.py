"""The systemd sandbox itself: real namespaces, real cgroups, real systemd 252 as PID 1 (no mocks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy_tool import proc, procfs
from deploy_tool.errors import SandboxError
from deploy_tool.rehearsal.sandbox import Sandbox
from tests.support.sandbox import SandboxEnv, leftover_cgroups, new_run_dir

pytestmark = pytest.mark.sandbox


@pytest.fixture()
def run_dir() -> Iterator[Path]:
    """A directory for this test's own sandboxes; whatever is still up in it is taken down afterwards."""
    import shutil

    root = new_run_dir("test")
    yield root
    for d in root.iterdir():
        if (d / ".deploytool-sandbox").exists():
            Sandbox(d).down()
    shutil.rmtree(root, ignore_errors=True)


def _state(sb: Sandbox) -> dict[str, int]:
    return json.loads((sb.dir / "state.json").read_text())


def _alive(pid: int) -> bool:
    stat = procfs.read(f"/proc/{pid}/stat")  # None also when the process is reaped between open and read (ESRCH)
    return stat is not None and stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def assert_nothing_left(sb: Sandbox, pids: list[int]) -> None:
    """No process, cgroup or state file of this sandbox remains."""
    assert not [c for c in leftover_cgroups() if sb.cgroup_name in c]
    assert not [p for p in pids if _alive(p)], "sandbox processes still running"
    assert not (sb.dir / "state.json").exists()
    assert sb.status().state == "down"


def test_up_is_isolated_and_down_leaves_nothing(run_dir: Path) -> None:
    """up runs systemd as PID 1 in its own cgroups/namespaces with private mounts; down leaves no trace on the host."""
    p1_cgroup = Path("/proc/1/cgroup").read_text()
    host_mounts = Path("/proc/self/mountinfo").read_text()
    host_units = sorted(os.listdir("/etc/systemd/system"))
    sb = Sandbox(run_dir / "sb")
    t0 = time.monotonic()
    st = sb.up()
    up_s = time.monotonic() - t0
    assert (st.state, st.system_state) in {("up", "running"), ("up", "degraded")}
    assert up_s < 5, f"up took {up_s:.2f} s"
    state = _state(sb)
    pid1, launcher = state["pid"], state["launcher"]
    # PID 1 of its own pid namespace, running the machine's systemd, inside this sandbox's sub-cgroup everywhere
    nspid = [ln for ln in Path(f"/proc/{pid1}/status").read_text().splitlines() if ln.startswith("NSpid:")][0]
    assert nspid.split()[1:] == [str(pid1), "1"]
    assert Path(f"/proc/{pid1}/comm").read_text().strip() == "systemd"
    for line in Path(f"/proc/{pid1}/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if ctrl != "cpuset":
            assert sb.cgroup_name in path, line
    for ns in ("pid", "mnt", "cgroup", "uts", "ipc"):
        assert os.readlink(f"/proc/{pid1}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    assert os.readlink(f"/proc/{pid1}/ns/net") == os.readlink("/proc/self/ns/net")
    # inside: the namespace's own cgroup root, private /run and /dev, read-only /proc/sys and /sys
    run = lambda *c: proc.run(sb.exec_argv(*c)).stdout.strip()  # noqa: E731
    assert run("cat", "/proc/self/cgroup").count(sb.cgroup_name) == 0
    assert run("findmnt", "-no", "FSTYPE", "/run") == "tmpfs"
    assert run("findmnt", "-no", "FSTYPE", "/dev").splitlines()[-1] == "tmpfs"
    assert run("findmnt", "-no", "OPTIONS", "/proc/sys").splitlines()[-1].startswith("ro,")
    assert run("findmnt", "-no", "OPTIONS", "/sys").splitlines()[-1].startswith("ro,")
    assert run("findmnt", "-no", "SOURCE", "/etc/systemd/system").endswith("/sb/etc-systemd-system]")
    assert run("readlink", "/usr/lib/systemd/system/systemd-journald-audit.socket") == "/dev/null"
    assert run("systemctl", "is-active", "systemd-journald.service") == "active"
    assert Path("/proc/self/mountinfo").read_text() == host_mounts  # nothing mounted on the host
    rep = sb.down()
    assert rep.was_up and not rep.forced and rep.stopped_pid == pid1
    assert_nothing_left(sb, [pid1, launcher])
    assert Path("/proc/1/cgroup").read_text() == p1_cgroup
    assert sorted(os.listdir("/etc/systemd/system")) == host_units


def test_down_twice_is_fine(run_dir: Path) -> None:
    """down is idempotent: the second call does nothing and says so (was_up False)."""
    sb = Sandbox(run_dir / "sb")
    sb.up()
    assert sb.down().was_up
    rep = sb.down()
    assert not rep.was_up and rep.removed_cgroups == () and rep.killed_pids == ()


def test_up_when_up_is_a_noop(run_dir: Path) -> None:
    """up on a running sandbox changes nothing and says it is already up."""
    sb = Sandbox(run_dir / "sb")
    first = sb.up()
    again = sb.up()
    assert again.pid == first.pid and "already up" in again.detail
    sb.down()


def test_down_after_sigkill_of_the_launcher(run_dir: Path) -> None:
    """Killing the launcher leaves systemd orphaned; down still finds it (start time checked) and cleans up."""
    sb = Sandbox(run_dir / "sb")
    sb.up()
    st = _state(sb)
    os.kill(st["launcher"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive(st["launcher"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(st["launcher"]) and _alive(st["pid"])
    rep = sb.down()
    assert rep.stopped_pid == st["pid"]
    assert_nothing_left(sb, [st["pid"], st["launcher"]])


def test_stale_sandbox_refused_then_cleaned(run_dir: Path) -> None:
    """With its systemd SIGKILLed the dir is stale: status says so, up/exec refuse, down cleans, up works again."""
    sb = Sandbox(run_dir / "sb")
    sb.up()
    st = _state(sb)
    os.kill(st["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive(st["pid"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    status = sb.status()
    assert status.state == "stale" and "gone" in status.detail
    with pytest.raises(SandboxError, match="stale") as ei:
        sb.up()
    assert "sandbox down" in (ei.value.hint or "")
    with pytest.raises(SandboxError, match="stale"):
        sb.exec_argv("systemctl", "status")
    sb.down()
    assert_nothing_left(sb, [st["pid"], st["launcher"]])
    assert sb.up().state == "up"
    sb.down()


def test_lost_state_file_found_by_cgroup(run_dir: Path) -> None:
    """If state.json is lost (a run killed at the wrong moment), down finds PID 1 through the sandbox's cgroup."""
    sb = Sandbox(run_dir / "sb")
    sb.up()
    st = _state(sb)
    (sb.dir / "state.json").unlink()
    assert sb.status().state == "stale"
    with pytest.raises(SandboxError, match="not up"):
        sb.exec_argv("true")
    rep = sb.down()
    assert rep.was_up and rep.stopped_pid == st["pid"]
    assert_nothing_left(sb, [st["pid"], st["launcher"]])


def test_up_killed_midway_is_cleaned_by_down(run_dir: Path) -> None:
    """A `sandbox up` process SIGKILLed mid-start leaves at most a half-started sandbox that down removes fully."""
    d = run_dir / "sb"
    child = subprocess.Popen([sys.executable, "-m", "deploy_tool", "sandbox", "up", str(d)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not (d / "state.json").exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    child.kill()
    child.wait()
    sb = Sandbox(d)
    pids = []
    if (d / "state.json").exists():
        st = _state(sb)
        pids = [st["pid"], st["launcher"]]
    assert sb.status().state in ("up", "stale")
    sb.down()
    assert_nothing_left(sb, pids)


def test_not_a_sandbox_dir(run_dir: Path, tmp_path: Path) -> None:
    """A directory with other content, a file, or a missing dir is refused by name; nothing is created or changed."""
    other = tmp_path / "project"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for call in (Sandbox(other).up, Sandbox(other).down, Sandbox(other).status):
        with pytest.raises(SandboxError, match="not a deploytool sandbox"):
            call()
    assert os.listdir(other) == ["notes.txt"]
    assert not [c for c in leftover_cgroups() if Sandbox(other).cgroup_name in c]
    with pytest.raises(SandboxError, match="not a directory"):
        Sandbox(other / "notes.txt").down()
    with pytest.raises(SandboxError, match="does not exist"):
        Sandbox(tmp_path / "missing").down()
    (other / ".deploytool-sandbox").write_text("{garbage")
    with pytest.raises(SandboxError, match="damaged"):
        Sandbox(other).status()


def _cli(*args: str, env: dict[str, str] | None = None, nobody: bool = False) -> subprocess.CompletedProcess[str]:
    if nobody:  # as uid 65534, with the checkout reachable wherever it is (a 0700 home too)
        from tests.support.nobody import run_python

        return run_python(["-m", "deploy_tool", *args])
    argv = [sys.executable, "-m", "deploy_tool", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60,
                          cwd=str(Path(__file__).resolve().parents[1]))


def test_cli_not_root_and_missing_tools(tmp_path: Path) -> None:
    """Without root, or without unshare/nsenter on PATH, `sandbox up` fails with one clear line and its exit code."""
    d = tmp_path / "sb"
    r = _cli("sandbox", "up", str(d), env={**os.environ, "PATH": str(tmp_path / "empty-bin")})
    assert r.returncode == 16, r.stderr
    assert "program not found: unshare" in r.stderr and "Traceback" not in r.stderr
    os.chmod(tmp_path, 0o755)
    r = _cli("sandbox", "up", str(d), nobody=True)
    assert r.returncode == 15, r.stderr
    assert "needs root" in r.stderr and "Traceback" not in r.stderr
    assert not d.exists()


def test_cli_status_exec_on_running_sandbox(sandbox_env: SandboxEnv) -> None:
    """`sandbox status --json` reports up; `sandbox exec DIR -- CMD` runs CMD inside and passes its exit code."""
    d = str(sandbox_env.sandbox.dir)
    r = _cli("sandbox", "status", d, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["state"] == "up" and data["pid"] == sandbox_env.sandbox.pid
    r = _cli("sandbox", "exec", d, "--", "systemctl", "is-active", "systemd-journald.service")
    assert (r.returncode, r.stdout.strip()) == (0, "active")
    r = _cli("sandbox", "exec", d, "--", "sh", "-c", "exit 7")
    assert r.returncode == 7


def test_cli_up_down_cycle(run_dir: Path) -> None:
    """`sandbox up`, `status`, `down`, `down` again and `status` through the real CLI, with their exit codes."""
    d = str(run_dir / "sb")
    r = _cli("-n", "sandbox", "up", d)  # a dry run starts nothing, creates nothing
    assert r.returncode == 0 and "would start" in r.stdout and not Path(d).exists(), r.stdout + r.stderr
    r = _cli("sandbox", "up", d)
    assert r.returncode == 0 and "is up" in r.stdout, r.stderr
    assert _cli("sandbox", "status", d).returncode == 0
    r = _cli("sandbox", "down", d, "--dry-run")  # says what it would stop, stops nothing
    assert r.returncode == 0 and "would power its systemd off" in r.stdout, r.stdout + r.stderr
    marker = run_dir / "ran"
    r = _cli("--dry-run", "sandbox", "exec", d, "--", "touch", str(marker))
    assert r.returncode == 0 and "would run:" in r.stdout and not marker.exists(), r.stdout + r.stderr
    assert _cli("sandbox", "status", d).returncode == 0
    r = _cli("sandbox", "down", d)
    assert r.returncode == 0 and "is down" in r.stdout, r.stderr
    r = _cli("sandbox", "down", d)
    assert r.returncode == 0 and "already down" in r.stdout
    r = _cli("sandbox", "status", d)
    assert r.returncode == 15 and ": down" in r.stdout
    r = _cli("sandbox", "exec", d, "--", "true")
    assert r.returncode == 15 and "not up" in r.stderr


def test_half_torn_down_dir_is_stale_until_down(run_dir: Path) -> None:
    """A sandbox dir whose sub-cgroup is left (a teardown cut short) is stale: up refuses; down removes it."""
    sb = Sandbox(run_dir / "sb")
    sb.up()
    sb.down()
    leftover = Path("/sys/fs/cgroup/pids") / sb.cgroup_name
    if not Path("/sys/fs/cgroup/pids").is_dir():  # pure cgroup2 host
        leftover = Path("/sys/fs/cgroup") / sb.cgroup_name
    leftover.mkdir()
    try:
        st = sb.status()
        assert st.state == "stale" and "half torn down" in st.detail and str(leftover) in st.leftover_cgroups
        with pytest.raises(SandboxError, match="stale"):
            sb.up()
        rep = sb.down()
        assert str(leftover) in rep.removed_cgroups and not leftover.exists()
        assert sb.status().state == "down"
    finally:
        if leftover.exists():
            leftover.rmdir()


def test_fixture_restore_removes_what_a_test_left(sandbox_env: SandboxEnv) -> None:
    """The per-test cleanup stops, disables and deletes a test's units and drop-ins, and clears failed units."""
    from tests.support.sandbox import free_port, port_closed, restore, snapshot, wait_http

    sd = sandbox_env.systemd
    snap = snapshot(sandbox_env)
    port = free_port()
    sd.install_file("t-left.service", (f"[Service]\nExecStart=/usr/bin/python3 -m http.server --bind 127.0.0.1 "
                                       f"{port}\n[Install]\nWantedBy=multi-user.target\n").encode())
    sd.install_file("t-fail.service", b"[Service]\nExecStart=/bin/false\n")
    (sandbox_env.unit_dir / "t-left.service.d").mkdir()
    (sandbox_env.unit_dir / "t-left.service.d" / "x.conf").write_text("[Service]\nEnvironment=A=1\n")
    sd.daemon_reload()
    sd.enable("t-left.service")
    sd.start("t-left.service")
    sd.start("t-fail.service")
    assert wait_http(port)
    deadline = time.monotonic() + 5
    while not sd.is_failed("t-fail.service") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sd.is_failed("t-fail.service")
    restore(sandbox_env, snap)
    assert snapshot(sandbox_env) == snap
    assert port_closed(port)
    assert sd.show("t-left.service").load_state == "not-found"
    assert sd.show("t-fail.service").load_state == "not-found"


def test_up_that_times_out_cleans_up_after_itself(run_dir: Path) -> None:
    """An up that does not reach `running` in time fails with a SandboxError and leaves nothing behind."""
    sb = Sandbox(run_dir / "sb", up_timeout=0.01)
    with pytest.raises(SandboxError, match="did not reach running") as ei:
        sb.up()
    assert "console.log" in (ei.value.hint or "")
    assert not [c for c in leftover_cgroups() if sb.cgroup_name in c]
    assert sb.status().state == "down"


def test_concurrent_up_down_serialized(run_dir: Path) -> None:
    """While another process holds the sandbox's lock, up/down wait and then fail clearly instead of racing."""
    import fcntl

    sb = Sandbox(run_dir / "sb")
    sb.up()
    fd = os.open(sb.dir / ".deploytool-sandbox.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(SandboxError, match="busy"):
            Sandbox(sb.dir, lock_timeout=0.2).down()
        assert sb.status().state == "up"
    finally:
        os.close(fd)
    assert sb.down().was_up
