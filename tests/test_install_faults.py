"""`deploytool install` under faults, with real parts only: a real signed cpu-demo bundle (ftllm 0.1.8.2 and
llama-server on a tiny model), a real sandboxed systemd of this module's own, the CLI run as a user runs it.

kill -9 at each install step (DEPLOYTOOL_FAULT=kill:<step> makes the CLI SIGKILL itself there), on a fresh box
and on a box whose previous release serves; a full disk (a small tmpfs mounted over the install root in a private
mount namespace); a bundle signed by a key the box does not trust. No GPU exists here: both backends run on CPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.bundles import bundle_dir_copy, swap_same_size
from tests.support.demo_box import Box, active_units, bundle_in, chat, dt, make_demo, pack, variant
from tests.support.sandbox import free_port, new_run_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.backends, pytest.mark.slow, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[1]
ALL_STEPS = ("venv-ready", "native-libs-checked", "tool-ready", "release-laid-down", "units-written",
             "current-flipped", "pinned", "daemon-reloaded", "started", "healthy")
#: Every kill point is killed on a fresh box and on an upgrade by tests/test_install_kills.py, against the fake
#: systemd driver with a small real bundle (seconds each; it also checks that every step is killed somewhere).
#: Each kill here costs a real install up to it (verify, unpack of a 1.4 GB venv, start), so only the ones where
#: systemd's own behaviour is the point are killed again: a fresh box whose units are written (not yet loaded) and
#: loaded by daemon-reload, install run again after a kill while ftllm starts; an upgrade with A serving, killed
#: once B's units are loaded and once B serves (recover restarts A: its process runs A's environment again).
FRESH_KILLS = ("units-written", "daemon-reloaded")
UPGRADE_KILLS = ("daemon-reloaded", "healthy")


@pytest.fixture(scope="module")
def sbx(own_sandbox):
    """A sandboxed systemd for this module only (its units never meet another suite's box)."""
    return own_sandbox


@pytest.fixture(scope="module")
def box(sbx):
    """Two bundles of one cpu-demo box (B differs from A in one env var of ftllm-dflash) and one signed by a key
    the box does not trust."""
    root = new_run_dir("install-faults")  # where the units can see it, wherever the checkout is
    d = root / "box"
    cfg = make_demo(d, sandbox_dir=sbx.sandbox.dir, unit_dir=sbx.unit_dir, port=free_port())
    a = bundle_in(d / "artifacts")
    cfg_b = variant(cfg, "deploytool-b.yaml", {"DEPLOYTOOL_TEST_RELEASE": "b"})
    b = pack(cfg_b, d / "artifacts-b")
    r = dt(cfg, "keygen", "--out", str(d / "rogue-keys"))
    assert r.returncode == 0, r.stderr
    assert len({a.name, b.name}) == 2
    yield {"cfg": cfg, "cfg_b": cfg_b, "a": a, "b": b, "rogue_keys": d / "rogue-keys", "box": Box(cfg), "dir": d}
    Box(cfg).reset(sbx.systemd)
    if not os.environ.get("DEPLOYTOOL_E2E_KEEP"):
        shutil.rmtree(root, ignore_errors=True)


def _port(cfg: Path) -> int:
    import yaml

    return yaml.safe_load(cfg.read_text())["serve"]["port"]


def _rid(bundle: Path) -> str:
    return bundle.name.split(".tar")[0].rsplit("-", 1)[1]


@pytest.fixture()
def fresh(box, sbx):
    """The box with nothing installed (what a test leaves is taken away by the next one that needs a fresh box, or
    kept by one that needs release A serving: the last fresh-box test leaves A serving)."""
    box["box"].reset(sbx.systemd)
    return box


@pytest.fixture()
def with_a(box, sbx):
    """The box with release A installed and ftllm-dflash serving it."""
    bx: Box = box["box"]
    st = bx.state()
    if st.get("release") != _rid(box["a"]) or st.get("operation") or active_units(sbx.systemd) != \
            {"ftllm-dflash.service"} or bx.current_release() != _rid(box["a"]):
        bx.reset(sbx.systemd)
        r = dt(box["cfg"], "install", str(box["a"]))
        assert r.returncode == 0, r.stdout + r.stderr
    return box


def _kill_install(cfg: Path, bundle: Path, step: str) -> None:
    r = dt(cfg, "install", str(bundle), env={"DEPLOYTOOL_FAULT": f"kill:{step}"})
    assert r.returncode == -9, f"install was not killed at {step}: {r.returncode}\n{r.stdout}\n{r.stderr}"


def _status_reports(cfg: Path, step: str) -> None:
    import json

    s = dt(cfg, "--json", "status")
    op = json.loads(s.stdout)["interrupted"]
    assert op["kind"] == "install" and op["step"] == step, op
    s = dt(cfg, "status")
    assert "install" in s.stdout and step in s.stdout, s.stdout


# ------------------------------------------------------------------------------- a fresh box

@pytest.mark.parametrize("step", FRESH_KILLS)
def test_fresh_box_kill_then_recover_leaves_nothing(fresh, sbx, step):
    """kill -9 of install on a fresh box at STEP: status names it; recover leaves no units, env, current, release."""
    bx: Box = fresh["box"]
    _kill_install(fresh["cfg"], fresh["a"], step)
    _status_reports(fresh["cfg"], step)
    r = dt(fresh["cfg"], "recover")
    assert r.returncode == 0, r.stdout + r.stderr
    assert bx.traces() == {"units": [], "env": [], "current": [], "releases": [], "pins": []}
    assert active_units(sbx.systemd) == set()
    st = bx.state()
    assert st["operation"] is None and st["release"] is None and st["active_backend"] is None
    last = bx.history()[-1]
    assert last["event"] == "recover" and last["interrupted"] == "install" and last["step"] == step, last
    assert not list(sbx.unit_dir.glob("*.wants/ftllm-dflash.service"))


@pytest.mark.parametrize("step", ["started"])
def test_fresh_box_kill_then_install_again_completes(fresh, sbx, step):
    """kill -9 of install on a fresh box at STEP; running install again finishes the job: ftllm-dflash serves."""
    bx: Box = fresh["box"]
    _kill_install(fresh["cfg"], fresh["a"], step)
    r = dt(fresh["cfg"], "install", str(fresh["a"]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "interrupted install" in r.stderr
    st = bx.state()
    assert st["operation"] is None and st["release"] == _rid(fresh["a"]) and st["active_backend"] == "ftllm-dflash"
    assert bx.release_entries() == [_rid(fresh["a"])] and bx.current_release() == _rid(fresh["a"])
    assert active_units(sbx.systemd) == {"ftllm-dflash.service"}
    assert chat(_port(fresh["cfg"]))["choices"][0]["message"]["content"]


@contextlib.contextmanager
def _trusting_only(bx: Box, keys: Path) -> Iterator[None]:
    """The box trusts only the public keys in `keys` (not the one its bundles are signed with), then its own again.
    Same check as a bundle signed by a foreign key, without packing a third bundle."""
    own = {p.name: p.read_bytes() for p in bx.keys.glob("*.pub")}
    for name in own:
        (bx.keys / name).unlink()
    for p in keys.glob("*.pub"):
        shutil.copy(p, bx.keys / f"rogue-{p.name}")
    try:
        yield
    finally:
        for p in bx.keys.glob("rogue-*.pub"):
            p.unlink()
        for name, data in own.items():
            (bx.keys / name).write_bytes(data)


def test_untrusted_key_is_refused_before_anything_is_written(fresh, sbx):
    """A bundle signed by a key the box does not trust: exit 6 naming the signature, nothing laid down."""
    bx: Box = fresh["box"]
    with _trusting_only(bx, fresh["rogue_keys"]):
        r = dt(fresh["cfg"], "install", str(fresh["a"]))
    assert r.returncode == 6, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "key" in r.stderr.lower() or "signature" in r.stderr.lower(), r.stderr
    assert bx.traces() == {"units": [], "env": [], "current": [], "releases": [], "pins": []}
    assert not bx.state().get("operation")
    assert not [e for e in bx.history() if e.get("ok")]


def _in_full_disk(root: Path, size: str, mode: str = "0755") -> list[str]:
    """Wrap a command so it runs in a private mount namespace with a `size` tmpfs over `root` (root's, `mode`: a
    tmpfs is 1777 unless told, which StrictModes refuses as a box path)."""
    script = ('mkdir -p "$1" && mount -t tmpfs -o size="$2",mode="$3" deploytool-test-full "$1" && shift 3 && '
              'exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", str(root), size, mode]


def test_a_world_writable_mount_over_the_install_root_is_refused_first(fresh, sbx):
    """A tmpfs mounted over the install root as tmpfs makes it (1777: anyone could create `current` there first):
    exit 23 naming it and `chmod go-w`, before the bundle is read; nothing written."""
    bx: Box = fresh["box"]
    r = dt(fresh["cfg"], "install", str(fresh["a"]), wrap=_in_full_disk(bx.root, "2m", mode="1777"))
    assert r.returncode == 23, r.stdout + r.stderr
    assert f"{bx.root} (above the current): owner 0:0, mode 1777, writable by group and others; fix: chmod go-w " \
        f"{bx.root}" in r.stderr
    assert "verifying" not in r.stderr and bx.traces() == {"units": [], "env": [], "current": [], "releases": [],
                                                           "pins": []}


@pytest.mark.parametrize("size,where", [("2m", "verifying"), ("800m", "laying down"), ("1300m", "unpacking")])
def test_full_disk_is_a_clean_error(fresh, sbx, size, where):
    """The install root on a small tmpfs (full while WHERE, the bundle being 0.5 GB and the venv 1.4 GB): exit 17
    'no space left', no unit or env written, no state torn, the tmpfs gone with the command's mount namespace."""
    bx: Box = fresh["box"]
    r = dt(fresh["cfg"], "install", str(fresh["a"]), wrap=_in_full_disk(bx.root, size))
    assert r.returncode == 17, r.stdout + r.stderr
    assert "no space left" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    t = bx.traces()
    assert t["units"] == [] and t["env"] == [] and t["pins"] == [], t
    assert not [n for n in os.listdir(sbx.unit_dir) if "ftllm" in n or "llamacpp" in n], os.listdir(sbx.unit_dir)
    st = bx.state()
    assert st.get("operation") is None and st.get("release") is None
    # the tmpfs lived in the command's own mount namespace: nothing of it is visible here
    assert "deploytool-test-full" not in Path("/proc/self/mounts").read_text()
    assert bx.release_entries() == []
    assert subprocess.run(["findmnt", str(bx.root)], capture_output=True).returncode != 0


# ------------------------------------------------------------------------------- verified bytes, box fitness

def _stopped_install(cfg: Path, *args: str, point: str) -> subprocess.Popen[str]:
    """`deploytool install ARGS` that SIGSTOPs itself at fault point `point`; returned once it is stopped."""
    import time

    from tests.support.demo_box import DT

    env = {**os.environ, "PYTHONPATH": str(REPO), "DEPLOYTOOL_FAULT": f"stop:{point}"}
    p = subprocess.Popen([*DT, "--config", str(cfg), "install", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=cfg.parent)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        if state in ("T", "gone") or p.poll() is not None:
            break
        time.sleep(0.05)
    assert p.poll() is None, f"install ended before {point}: {p.communicate()}"
    return p


# every kind of file swapped (and a swap after the copy) is tests/test_install_kills.py's, in-process; here, the CLI
# SIGSTOPped for real, and its one error line
@pytest.mark.parametrize("victim", ["env/ftllm-dflash.env"])
def test_file_swapped_after_the_signature_check_is_refused(fresh, sbx, victim, tmp_path):
    """install of a bundle directory, stopped right after the signature check; VICTIM is swapped for other bytes
    of the same size and mode; install resumes: exit 6, one error line naming VICTIM, nothing installed."""
    bx: Box = fresh["box"]
    bdir = bundle_dir_copy(fresh["a"], tmp_path)
    assert (bdir / victim).is_file(), sorted(p.name for p in bdir.iterdir())
    p = _stopped_install(fresh["cfg"], str(bdir), point="signature-checked")
    try:
        swap_same_size(bdir / victim)
    finally:
        os.kill(p.pid, 18)  # SIGCONT
    out, err = p.communicate(timeout=600)
    assert p.returncode == 6, out + err
    errors = [ln for ln in err.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and victim in errors[0], err
    assert "Traceback" not in err
    assert bx.traces() == {"units": [], "env": [], "current": [], "releases": [], "pins": []}
    assert active_units(sbx.systemd) == set()
    assert not bx.state().get("operation") and not bx.state().get("release")


def test_bundle_packed_for_another_config_is_refused(fresh, sbx):
    """Bundle B (packed from a config whose ftllm env differs) installed under config A: exit 6 naming the key,
    nothing written."""
    bx: Box = fresh["box"]
    r = dt(fresh["cfg"], "install", str(fresh["b"]))
    assert r.returncode == 6, r.stdout + r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and "another config" in err[0], r.stderr
    assert "backends.ftllm-dflash.env.DEPLOYTOOL_TEST_RELEASE: bundle \"b\", here (unset)" in err[0], err
    assert "Traceback" not in r.stderr
    assert bx.traces() == {"units": [], "env": [], "current": [], "releases": [], "pins": []}


def _without_libgomp() -> list[str]:
    """Run a command in a private mount namespace where the OS's libgomp.so.1 is hidden (/dev/null over it), as
    on a minimal Debian 12 box."""
    from deploy_tool.binaries import read_ld_so_cache

    paths = sorted({os.path.realpath(p) for p in read_ld_so_cache().get("libgomp.so.1", [])})
    assert paths, "libgomp.so.1 is on this machine (the setup installs it)"
    binds = " && ".join(f'mount --bind /dev/null "{p}"' for p in paths)
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", f'{binds} && exec "$@"', "sh"]


def test_box_without_libgomp_is_refused_naming_the_package(fresh, sbx):
    """On a box without libgomp.so.1, install is refused before anything changes: exit 16, the library, the
    binary that needs it and the Debian package (libgomp1); no unit, env, current or release."""
    bx: Box = fresh["box"]
    r = dt(fresh["cfg"], "install", str(fresh["a"]), wrap=_without_libgomp())
    assert r.returncode == 16, r.stdout + r.stderr
    assert "libgomp.so.1" in r.stderr and "libgomp1" in r.stderr and "libggml" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert bx.traces() == {"units": [], "env": [], "current": [], "releases": [], "pins": []}
    assert active_units(sbx.systemd) == set()


def test_install_again_after_no_start_starts_the_default_backend(fresh, sbx):
    """install --no-start, then the same install again: the default backend starts behind the gate (it said
    "nothing to do" before); a third run is a no-op."""
    bx: Box = fresh["box"]
    r = dt(fresh["cfg"], "install", "--no-start", str(fresh["a"]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert active_units(sbx.systemd) == set() and bx.state()["active_backend"] is None
    r = dt(fresh["cfg"], "--json", "install", str(fresh["a"]))
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    assert json.loads(r.stdout)["action"] == "started"
    assert active_units(sbx.systemd) == {"ftllm-dflash.service"} and bx.state()["active_backend"] == "ftllm-dflash"
    assert chat(_port(fresh["cfg"]))["choices"][0]["message"]["content"]
    assert bx.history()[-1]["event"] == "install" and bx.history()[-1].get("action") == "started"
    r = dt(fresh["cfg"], "install", str(fresh["a"]))
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------- with release A serving
# (after the no-start test above, which leaves A serving: the fixture installs it only if it must)

def _env_of_running(sbx, unit: str) -> str:
    """The environment of the unit's running main process (what it was really started with)."""
    pid = sbx.systemd.show(unit).main_pid
    assert pid, f"{unit} has no main process"
    host = sbx.sandbox.host_pid(pid)
    return Path(f"/proc/{host}/environ").read_bytes().decode(errors="replace")


@pytest.mark.parametrize("step", UPGRADE_KILLS)
def test_previous_release_serves_after_kill_and_recover(with_a, sbx, step):
    """kill -9 of an upgrade A->B at STEP: status names it; recover brings A back: current -> A, A's units, A
    serving (its process runs A's environment), B's release dir gone."""
    bx: Box = with_a["box"]
    a, b = _rid(with_a["a"]), _rid(with_a["b"])
    unit_a = (bx.unit_dir / "ftllm-dflash.service").read_bytes()
    env_a = (bx.env_dir / "ftllm-dflash.env").read_bytes()
    _kill_install(with_a["cfg_b"], with_a["b"], step)
    _status_reports(with_a["cfg_b"], step)
    r = dt(with_a["cfg_b"], "recover")
    assert r.returncode == 0, r.stdout + r.stderr
    st = bx.state()
    assert st["operation"] is None and st["release"] == a and st["active_backend"] == "ftllm-dflash"
    assert bx.current_release() == a and bx.release_entries() == [a], bx.release_entries()
    assert b not in bx.release_entries()
    assert (bx.unit_dir / "ftllm-dflash.service").read_bytes() == unit_a
    assert (bx.env_dir / "ftllm-dflash.env").read_bytes() == env_a
    assert active_units(sbx.systemd) == {"ftllm-dflash.service"}
    assert "DEPLOYTOOL_TEST_RELEASE" not in _env_of_running(sbx, "ftllm-dflash.service")
    assert chat(_port(with_a["cfg"]))["choices"][0]["message"]["content"]
    r = dt(with_a["cfg"], "verify", "ftllm-dflash")
    assert r.returncode == 0, r.stdout + r.stderr


def test_untrusted_key_leaves_a_serving_release_alone(with_a, sbx):
    """An untrusted bundle (B, whose key the box no longer trusts) on a box with A serving: exit 6; A's units,
    current, process untouched."""
    bx: Box = with_a["box"]
    before = {p.name: p.read_bytes() for p in bx.unit_dir.glob("*.service")}
    pid = sbx.systemd.show("ftllm-dflash.service").main_pid
    with _trusting_only(bx, with_a["rogue_keys"]):
        r = dt(with_a["cfg_b"], "install", str(with_a["b"]))
    assert r.returncode == 6, r.stdout + r.stderr
    assert {p.name: p.read_bytes() for p in bx.unit_dir.glob("*.service")} == before
    assert sbx.systemd.show("ftllm-dflash.service").main_pid == pid
    assert bx.current_release() == _rid(with_a["a"]) and bx.release_entries() == [_rid(with_a["a"])]


def test_full_disk_on_upgrade_keeps_previous_release(with_a, sbx):
    """Upgrade A->B with the releases dir full: exit 17; A keeps serving, unit files and current untouched."""
    bx: Box = with_a["box"]
    before = {p.name: p.read_bytes() for p in bx.unit_dir.glob("*.service")}
    pid = sbx.systemd.show("ftllm-dflash.service").main_pid
    # a tmpfs over releases/ in the install's own mount namespace: B's verify and lay-down run out of space there
    a = _rid(with_a["a"])
    r = dt(with_a["cfg_b"], "install", str(with_a["b"]), wrap=_in_full_disk(bx.releases, "20m"))
    assert r.returncode == 17, r.stdout + r.stderr
    assert "no space left" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in bx.unit_dir.glob("*.service")} == before
    assert sbx.systemd.show("ftllm-dflash.service").main_pid == pid
    assert bx.current_release() == a and bx.release_entries() == [a]
    assert bx.state()["operation"] is None and bx.state()["release"] == a


def test_swap_while_serving_leaves_the_serving_release_alone(with_a, sbx, tmp_path):
    """The same race on an upgrade A->B: refused with exit 6; A's process, units, env and current untouched."""
    bx: Box = with_a["box"]
    before = {p.name: p.read_bytes() for p in [*bx.unit_dir.glob("*.service"), *bx.env_dir.iterdir()]}
    pid = sbx.systemd.show("ftllm-dflash.service").main_pid
    bdir = bundle_dir_copy(with_a["b"], tmp_path)
    p = _stopped_install(with_a["cfg_b"], str(bdir), point="signature-checked")
    try:
        swap_same_size(bdir / "env" / "ftllm-dflash.env")
    finally:
        os.kill(p.pid, 18)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 6 and "env/ftllm-dflash.env" in err, out + err
    assert {p.name: p.read_bytes() for p in [*bx.unit_dir.glob("*.service"), *bx.env_dir.iterdir()]} == before
    assert sbx.systemd.show("ftllm-dflash.service").main_pid == pid
    assert bx.current_release() == _rid(with_a["a"]) and bx.release_entries() == [_rid(with_a["a"])]


def test_upgrade_killed_then_install_again_completes(with_a, sbx):
    """kill -9 of an upgrade A->B after the units were written; install B again undoes, then installs B."""
    bx: Box = with_a["box"]
    b = _rid(with_a["b"])
    _kill_install(with_a["cfg_b"], with_a["b"], "units-written")
    r = dt(with_a["cfg_b"], "install", str(with_a["b"]))
    assert r.returncode == 0, r.stdout + r.stderr
    st = bx.state()
    assert st["operation"] is None and st["release"] == b and st["previous_release"] == _rid(with_a["a"])
    assert bx.current_release() == b
    assert "DEPLOYTOOL_TEST_RELEASE=b" in _env_of_running(sbx, "ftllm-dflash.service")
    assert chat(_port(with_a["cfg"]))["choices"][0]["message"]["content"]
