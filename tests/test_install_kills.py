"""`deploytool install` killed at every journaled step, fast: the install state machine (deploy_tool.box.install,
through deploy_tool.box.operations as the CLI runs it) against the fake systemd driver (tests.support.fake_systemd:
real sockets, fake processes, virtual time), with the real file system work: a real signed bundle packed by
`pack` (a small venv of one real wheel with a native library, deploytool's tool wheels replaced by one small
real wheel), verified, unpacked, relocated, its native library checked, laid down, pinned, recovered, on disk.

A SIGKILL runs none of the killed process's `except` and `finally` blocks; in-process, the kill raises instead, so
the files under the box are frozen at the kill (World.on_kill) and put back as the kill left them once the stack
has unwound: what `recover` then finds is what a real kill leaves.

What only a real systemd can show (a unit loaded by daemon-reload, a start job in flight, the environment of the
process systemd restarted, the `deploytool status` CLI) is tests/test_install_faults.py's: it keeps a few
representative kills on the real sandbox.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from deploy_tool import config
from deploy_tool.box import fingerprint, operations
from deploy_tool.builder import pack as pack_mod
from deploy_tool.errors import DeployError
from deploy_tool.manifest import generate_keypair
from tests.support import fake_systemd as fs
from tests.support.backends import free_port
from tests.support.bundles import bundle_dir_copy, swap_same_size
from tests.support.configs import DELETE, example_dict, set_key, write_dict
from tests.support.tiny_model import write_model

F, L = "ftllm-dflash", "llamacpp-tensor"
FU, LU = f"{F}.service", f"{L}.service"

ALL_STEPS = ("venv-ready", "native-libs-checked", "tool-ready", "release-laid-down", "units-written",
             "current-flipped", "pinned", "daemon-reloaded", "started", "healthy")
#: here every step is killed on a fresh box and on an upgrade (`make test`; `make check` kills one of each: _kills)
FRESH_KILLS = ALL_STEPS
UPGRADE_KILLS = ALL_STEPS
#: and install run again after a kill finishes the job (from before the units are written, after, once started)
AGAIN_KILLS = ("venv-ready", "pinned", "started")


def _kills(steps: tuple[str, ...], fast: str | None = None) -> list[Any]:
    """STEPS as parameters, all `slow` but FAST: `make check` kills a fresh install and an upgrade at one step each,
    `make test` at every step (each kill is a real install whose tool venv pip builds: 2-6 s of CPU, half the fast
    suite's when all of them ran there; bench/RESULTS.md)."""
    return [pytest.param(s, marks=() if s == fast else pytest.mark.slow) for s in steps]


def test_every_install_step_is_killed_somewhere() -> None:
    """A step added to install's journal fails here until the kill lists cover it ("verified" is the kill before
    anything is written: the untrusted-key and full-disk cases cover that ground). Every step is killed here, on
    the fake driver; the real sandbox (tests/test_install_faults.py) kills a few of them again, and every one it
    names is a step."""
    from deploy_tool.box.install import JOURNALED
    from tests import test_install_faults as real

    assert set(ALL_STEPS) == set(JOURNALED) - {"verified"}
    assert set(FRESH_KILLS) == set(UPGRADE_KILLS) == set(ALL_STEPS)
    assert set(real.ALL_STEPS) == set(ALL_STEPS)
    assert set(real.FRESH_KILLS) | set(real.UPGRADE_KILLS) | {"started"} <= set(ALL_STEPS)


# ------------------------------------------------------------------------------------------------ the bundles

def _wheel(path: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A small real wheel with its RECORD (pip and the bundle's stdlib wheel installer both check it)."""
    files = dict(files)
    di = f"{name}-{version}.dist-info"
    files[f"{di}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{di}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    rows = [f"{arc},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}" for arc, data in sorted(files.items())]
    files[f"{di}/RECORD"] = ("\n".join([*rows, f"{di}/RECORD,,"]) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files.items():
            z.writestr(zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return path


@dataclass
class Bundles:
    dir: Path
    cfg: config.Config  # release A's config (the box's)
    cfg_b: config.Config  # B's: ftllm-dflash's env has DEPLOYTOOL_TEST_RELEASE=b
    a: Path
    b: Path


def make_bundles(tmp_path_factory: pytest.TempPathFactory) -> Bundles:
    """Two small cpu-demo bundles (A, and B differing in one env var of ftllm-dflash), packed by the real `pack`
    from one locked real wheel (carrying one native library), signed by a key the box trusts."""
    d = tmp_path_factory.mktemp("install-kills")
    from deploy_tool.binaries import read_ld_so_cache

    zlib = Path(os.path.realpath(read_ld_so_cache()["libz.so.1"][0])).read_bytes()  # a native library (NEEDS libc)
    whl = _wheel(d / "wheels" / "tinypkg-1.0-py3-none-any.whl", "tinypkg", "1.0",
                 {"tinypkg/__init__.py": b"VALUE = 1\n", "tinypkg/libtiny.so.1": zlib,
                  # a script pip points at the venv's python: install relocates it
                  "tinypkg-1.0.data/scripts/tiny-hello": b"#!python\nprint('hello')\n"})
    _wheel(d / "tool-wheels" / "tinytool-1.0-py3-none-any.whl", "tinytool", "1.0",
           {"tinytool/__init__.py": b"VALUE = 2\n"})
    req = d / "requirements.in"
    req.write_text("tinypkg==1.0\n")
    pack_mod.write_lock([pack_mod.LockEntry("tinypkg", "1.0", hashlib.sha256(whl.read_bytes()).hexdigest())],
                        d / "requirements.lock", source_sha=hashlib.sha256(req.read_bytes()).hexdigest())
    (d / "chat_template.jinja").write_bytes(config.example_companions("cpu-demo")["chat_template.jinja"])
    write_model(d / "models" / "tiny-f16.gguf", size="tiny", f16=True)
    data = example_dict("cpu-demo")
    set_key(data, "systemd.sandbox", DELETE)
    set_key(data, "paths.unit_dir", str(d / "units"))
    set_key(data, "serve.internal_port", free_port())
    set_key(data, "bundle.tool_wheels_dir", "tool-wheels")
    set_key(data, "health.start_timeout_s", 10)  # virtual seconds
    set_key(data, "health.interval_s", 0.5)
    set_key(data, "health.smoke_timeout_s", 5)
    cfg = config.load(write_dict(d, data))
    set_key(data, "backends.ftllm-dflash.env", {"DEPLOYTOOL_TEST_RELEASE": "b"})
    cfg_b = config.load(write_dict(d, data, "deploytool-b.yaml"))
    key = d / "keys" / "signer.key"
    generate_keypair(key, Path(cfg.paths.keys_dir) / "signer.pub")
    with ThreadPoolExecutor(2) as pool:  # mostly child processes (venv, pip): the two packs overlap
        a, b = pool.map(lambda c: pack_mod.pack(c, out_dir=d / f"artifacts-{Path(c.source_path).stem}", key_path=key),
                        (cfg, cfg_b))
    assert a.bundle_id != b.bundle_id
    return Bundles(d, cfg, cfg_b, a.archive, b.archive)


# ------------------------------------------------------------------------------------------------ the box

@dataclass
class Outcome:
    what: str  # the install's or recover's action | "killed" | "error"
    result: Any = None
    error: DeployError | None = None
    left: dict[str, list[str]] = field(default_factory=dict)  # what a kill left on the box (before any recover)


class Box:
    """The bundles' box (its paths are the ones the bundles were packed for) on a fresh fake systemd."""

    def __init__(self, bundles: Bundles) -> None:
        self.b = bundles
        self.cfg = bundles.cfg
        p = self.cfg.paths
        self.root, self.env_dir, self.state_dir = Path(p.root), Path(p.env_dir), Path(p.state_dir)
        self.unit_dir, self.current, self.releases = Path(p.unit_dir), Path(p.current), Path(p.releases_dir)
        self.reset()
        self.world = fs.World(self.cfg)
        self.log: list[str] = []

    def reset(self) -> None:
        for d in (self.unit_dir, self.env_dir, self.state_dir, self.releases):
            shutil.rmtree(d, ignore_errors=True)
        if self.current.is_symlink():
            self.current.unlink()

    # ------------------------------------------------------------------ commands, as the CLI runs them

    def install(self, bundle: Path, *, cfg: config.Config | None = None, kill: str | None = None,
                start: bool = True) -> Outcome:
        return self._run(lambda sd: operations.install(cfg or self.cfg, str(bundle), log=self.log.append, sd=sd,
                                                       start=start), kill)

    def install_stopped(self, bundle: Path, point: str, meanwhile: Callable[[], None], *,
                        cfg: config.Config | None = None, start: bool = True) -> Outcome:
        """install, SIGSTOPped at fault point `point` (DEPLOYTOOL_FAULT=stop:<point>); `meanwhile` runs while it
        is stopped (as another process would), then it goes on."""
        def stopped_at(sd: Any) -> Any:
            kill = os.kill

            def on_signal(pid: int, sig: int) -> None:
                if pid == os.getpid() and sig == signal.SIGSTOP:
                    meanwhile()
                kill(pid, sig)

            os.kill = on_signal  # type: ignore[assignment]
            os.environ["DEPLOYTOOL_FAULT"] = f"stop:{point}"
            try:
                return operations.install(cfg or self.cfg, str(bundle), log=self.log.append, sd=sd, start=start)
            finally:
                os.kill = kill
                os.environ.pop("DEPLOYTOOL_FAULT", None)
        return self._run(stopped_at, None)

    def recover(self) -> Outcome:
        return self._run(lambda sd: operations.recover(self.cfg, log=self.log.append, sd=sd), None)

    def _run(self, command: Any, kill: str | None) -> Outcome:
        frozen = self.b.dir / "frozen"
        shutil.rmtree(frozen, ignore_errors=True)
        self.world.on_kill = lambda step: self.save(frozen)  # the files as the kill leaves them
        if kill:
            os.environ["DEPLOYTOOL_FAULT"] = f"kill:{kill}"
        try:
            with self.world.running():
                res = command(self.world.systemd())
        except fs.Killed as exc:
            self.restore(frozen)  # what the unwinding did is undone: a killed process does nothing more
            return Outcome("killed", left=self.traces(hidden=True), result=str(exc))
        except DeployError as exc:
            return Outcome("error", error=exc)
        finally:
            os.environ.pop("DEPLOYTOOL_FAULT", None)
            self.world.on_kill = None
            shutil.rmtree(frozen, ignore_errors=True)
        return Outcome(res.action, result=res)

    def save(self, to: Path) -> None:
        """The box's files copied to `to` (a release's files, never changed in place once written, linked)."""
        for d in self._dirs():
            if d.exists():
                shutil.copytree(d, to / d.relative_to(self.b.dir), symlinks=True, copy_function=_link_or_copy)
        if self.current.is_symlink():
            (to / "current").write_text(os.readlink(self.current))

    def restore(self, saved: Path) -> None:
        """The box's files as `save` found them."""
        self.reset()
        for d in self._dirs():
            if (saved / d.relative_to(self.b.dir)).exists():
                shutil.copytree(saved / d.relative_to(self.b.dir), d, symlinks=True, copy_function=_link_or_copy)
        if (saved / "current").is_file():
            os.symlink((saved / "current").read_text(), self.current)

    def _dirs(self) -> list[Path]:
        return [self.unit_dir, self.env_dir, self.state_dir, self.releases]

    # ------------------------------------------------------------------ what is on the box

    def state(self) -> dict[str, Any]:
        p = self.state_dir / "state.json"
        return json.loads(p.read_text()) if p.is_file() else {}

    def history(self) -> list[dict[str, Any]]:
        p = self.state_dir / "history.jsonl"
        return [json.loads(ln) for ln in p.read_text().splitlines()] if p.is_file() else []

    def release_entries(self, *, hidden: bool = True) -> list[str]:
        if not self.releases.is_dir():
            return []
        return sorted(n for n in os.listdir(self.releases) if hidden or not n.startswith("."))

    def current_release(self) -> str | None:
        return Path(os.readlink(self.current)).name if self.current.is_symlink() else None

    def traces(self, *, hidden: bool = True) -> dict[str, list[str]]:
        """Everything an install leaves on the box (empty lists on a clean box); `hidden`: with the verify and
        staging dirs under releases/."""
        return {
            "units": sorted(u for u in os.listdir(self.unit_dir) if u.startswith((F, L)))
            if self.unit_dir.is_dir() else [],
            "env": sorted(os.listdir(self.env_dir)) if self.env_dir.is_dir() else [],
            "current": [str(self.current)] if self.current.is_symlink() or self.current.exists() else [],
            "releases": self.release_entries(hidden=hidden),
            "pins": sorted(os.listdir(self.state_dir / "pins")) if (self.state_dir / "pins").is_dir() else [],
        }

    def verify(self, backend: str) -> fingerprint.VerifyReport:
        """What the units' ExecStartPre checks: the backend's files against its pins."""
        return fingerprint.verify(self.cfg, self.cfg.backends[backend])


def _link_or_copy(src: str, dst: str) -> str:
    if f"{os.sep}releases{os.sep}" in src:  # no step writes into a release's files, before or after its move
        os.link(src, dst)
        return dst
    return shutil.copy2(src, dst)


CLEAN = {"units": [], "env": [], "current": [], "releases": [], "pins": []}


@pytest.fixture()
def box(bundles: Bundles) -> Iterator[Box]:
    bx = Box(bundles)
    yield bx
    bx.world.close()
    bx.reset()


def _rid(bundle: Path) -> str:
    return bundle.name.split(".tar")[0].rsplit("-", 1)[1]


def _chat(bx: Box) -> dict[str, Any]:
    body = json.dumps({"model": bx.cfg.serve.model_name, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{bx.cfg.backend_port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _serving(bx: Box) -> set[str]:
    """The units serving as the command left them: the gate has waited for their start jobs (the ExecStartPost
    that waits for readiness), so nothing needs to pass first."""
    return bx.world.healthy()


def make_saved_a(bundles: Bundles) -> Path:
    """The box's files after release A was installed through the gate (once for the module)."""
    bx = Box(bundles)
    try:
        out = bx.install(bundles.a)
        assert out.what == "installed", (out, bx.log)
        assert _serving(bx) == {FU} and bx.state()["release"] == _rid(bundles.a)
        bx.save(bundles.dir / "saved-a")
    finally:
        bx.world.close()
        bx.reset()
    return bundles.dir / "saved-a"


def _with_a(bx: Box, saved: Path) -> None:
    """Release A installed, ftllm-dflash serving it and enabled for boot (as the install left them)."""
    bx.restore(saved)
    bx.world.bring_up(FU)
    assert bx.state()["release"] == _rid(bx.b.a) and bx.state()["active_backend"] == F


# ------------------------------------------------------------------------------------------------ fresh box

@pytest.mark.parametrize("step", _kills(FRESH_KILLS, "pinned"))
def test_fresh_box_kill_then_recover_leaves_nothing(box: Box, step: str) -> None:
    """kill -9 of install on a fresh box at STEP: state.json names it; recover leaves no units, env, current,
    release, staging dir or pins, nothing running or enabled, and history records the undo."""
    out = box.install(box.b.a, kill=step)
    assert out.what == "killed" and box.world.kills == [f"kill:{step}"], (out, box.log)
    op = box.state()["operation"]
    assert op["kind"] == "install" and op["step"] == step and op["release"] == _rid(box.b.a), op
    assert out.left["releases"], out.left  # the kill left work behind (a staging dir at least) ...
    if ALL_STEPS.index(step) >= ALL_STEPS.index("units-written"):
        assert out.left["units"] and out.left["env"], out.left
    if step in ("started", "healthy"):
        assert box.world.units[FU].active_state in ("activating", "active")  # ... and ftllm-dflash starting
    rec = box.recover()
    assert rec.what == "recovered", (rec, box.log)
    assert box.traces() == CLEAN
    assert box.world.active() == set() and box.world.enabled() == set()
    st = box.state()
    assert st["operation"] is None and st["release"] is None and st["active_backend"] is None
    last = box.history()[-1]
    assert last["event"] == "recover" and last["interrupted"] == "install" and last["step"] == step, last
    assert last["outcome"] == "undone"


@pytest.mark.parametrize("step", _kills(AGAIN_KILLS))
def test_fresh_box_kill_then_install_again_completes(box: Box, step: str) -> None:
    """kill -9 of install on a fresh box at STEP; install again undoes the interrupted one, then finishes the
    job: ftllm-dflash serves release A, enabled for boot, its files as pinned."""
    assert box.install(box.b.a, kill=step).what == "killed"
    out = box.install(box.b.a)
    assert out.what == "installed", (out, box.log)
    assert any("interrupted install" in ln for ln in box.log), box.log
    st = box.state()
    assert st["operation"] is None and st["release"] == _rid(box.b.a) and st["active_backend"] == F
    assert box.release_entries() == [_rid(box.b.a)] and box.current_release() == _rid(box.b.a)
    assert _serving(box) == {FU} and box.world.enabled() == {FU}
    assert box.world.front()["deploytool-front.socket"] == ("active", True)  # the public port is held
    assert _chat(box)["choices"][0]["message"]["content"]
    assert box.verify(F).ok and box.verify(L).ok
    events = [(e["event"], e.get("ok"), e.get("interrupted")) for e in box.history() if e["event"] != "pin"]
    assert events[-2:] == [("recover", True, "install"), ("install", True, None)], events


# ------------------------------------------------------------------------------------------------ upgrade

@pytest.mark.parametrize("step", _kills(UPGRADE_KILLS, "pinned"))
def test_previous_release_serves_after_kill_and_recover(box: Box, saved_a: Path, step: str) -> None:
    """kill -9 of an upgrade A->B at STEP: state.json names it; recover brings A back: current -> A, A's units,
    env files and pins (verify passes), ftllm-dflash serving and enabled, B's release dir gone."""
    _with_a(box, saved_a)
    a, b = _rid(box.b.a), _rid(box.b.b)
    files_a = {p.name: p.read_bytes() for p in [*box.unit_dir.glob("*.service"), *box.env_dir.iterdir()]}
    pins_a = {p.name: json.loads(p.read_text())["release"] for p in (box.state_dir / "pins").iterdir()}
    assert set(pins_a.values()) == {a}
    out = box.install(box.b.b, cfg=box.b.cfg_b, kill=step)
    assert out.what == "killed", (out, box.log)
    op = box.state()["operation"]
    assert op["kind"] == "install" and op["step"] == step and op["previous_release"] == a, op
    assert b in out.left["releases"] or f".staging-{b}" in out.left["releases"] or \
        any(n.startswith(".verify-") for n in out.left["releases"]), out.left
    rec = box.recover()
    assert rec.what == "recovered", (rec, box.log)
    st = box.state()
    assert st["operation"] is None and st["release"] == a and st["active_backend"] == F
    assert box.current_release() == a and box.release_entries() == [a]
    assert {p.name: p.read_bytes() for p in [*box.unit_dir.glob("*.service"), *box.env_dir.iterdir()]} == files_a
    assert {p.name: json.loads(p.read_text())["release"] for p in (box.state_dir / "pins").iterdir()} == pins_a
    assert box.verify(F).ok and box.verify(L).ok
    assert _serving(box) == {FU} and box.world.enabled() == {FU}
    assert _chat(box)["choices"][0]["message"]["content"]
    last = box.history()[-1]
    assert last["event"] == "recover" and last["step"] == step and last["outcome"] == "undone", last


@pytest.mark.parametrize("step", _kills(AGAIN_KILLS))
def test_upgrade_killed_then_install_again_completes(box: Box, saved_a: Path, step: str) -> None:
    """kill -9 of an upgrade A->B at STEP; install B again undoes, then installs B: B's env file in place and
    pinned, ftllm-dflash restarted on it, A kept as the previous release."""
    _with_a(box, saved_a)
    a, b = _rid(box.b.a), _rid(box.b.b)
    assert box.install(box.b.b, cfg=box.b.cfg_b, kill=step).what == "killed"
    out = box.install(box.b.b, cfg=box.b.cfg_b)
    assert out.what == "installed", (out, box.log)
    st = box.state()
    assert st["operation"] is None and st["release"] == b and st["previous_release"] == a
    assert box.current_release() == b and sorted(box.release_entries()) == sorted([a, b])
    assert b'DEPLOYTOOL_TEST_RELEASE="b"' in (box.env_dir / f"{F}.env").read_bytes()
    assert fingerprint.verify(box.b.cfg_b, box.b.cfg_b.backends[F]).ok
    assert _serving(box) == {FU} and box.world.enabled() == {FU}


@pytest.mark.parametrize("step", ["current-flipped", "pinned"])
def test_going_back_killed_keeps_the_release_it_found_laid_down(box: Box, saved_a: Path, step: str) -> None:
    """A, then B installed (A kept on the box); `install A` again (going back) killed at STEP: recover brings B back
    and keeps A's directory, which that install found laid down and did not make (it was removed before)."""
    _with_a(box, saved_a)
    a, b = _rid(box.b.a), _rid(box.b.b)
    assert box.install(box.b.b, cfg=box.b.cfg_b).what == "installed"
    assert sorted(box.release_entries()) == sorted([a, b])
    assert box.install(box.b.a, kill=step).what == "killed"
    assert box.state()["operation"]["release_kept"] is True
    rec = box.recover()
    assert rec.what == "recovered", (rec, box.log)
    assert box.current_release() == b and sorted(box.release_entries()) == sorted([a, b])
    assert fingerprint.verify(box.b.cfg_b, box.b.cfg_b.backends[F]).ok


# ------------------------------------------------------------------------------------------------ verified bytes

@pytest.mark.parametrize("victim", ["env/ftllm-dflash.env", "units/llamacpp-tensor.service", "config.json",
                                    "templates/chat_template.jinja", "venv-parts/tinypkg.tar.zst"])
def test_file_swapped_after_the_signature_check_is_refused(box: Box, victim: str, tmp_path: Path) -> None:
    """install of a bundle directory, stopped right after the signature check; VICTIM is swapped for other bytes
    of the same size and mode; install goes on: exit 6, the error names VICTIM, nothing installed.
    (The CLI's one error line for it, on the real sandbox: tests/test_install_faults.py.)"""
    bdir = bundle_dir_copy(box.b.a, tmp_path)
    assert (bdir / victim).is_file(), sorted(p.name for p in bdir.iterdir())
    swapped: list[str] = []
    out = box.install_stopped(bdir, "signature-checked", lambda: swapped.append(swap_same_size(bdir / victim) and victim))
    assert swapped == [victim]
    assert out.what == "error" and out.error is not None and int(out.error.exit_code) == 6, (out, box.log)
    assert victim in out.error.message.splitlines()[0], out.error.message
    assert box.traces() == CLEAN
    assert {c.method for c in box.world.calls} <= {"show"}, box.world.calls  # systemd was asked to do nothing
    assert not box.state().get("operation") and not box.state().get("release")


def test_swap_after_the_copy_installs_the_signed_bytes(box: Box, tmp_path: Path) -> None:
    """A swap after install has copied the bundle (stopped at venv-ready) changes nothing: the env file and unit
    installed are the signed ones, byte for byte."""
    bdir = bundle_dir_copy(box.b.a, tmp_path)
    signed = {n: (bdir / n).read_bytes() for n in ("env/ftllm-dflash.env", "units/ftllm-dflash.service")}

    def swap_all() -> None:
        for n in signed:
            swap_same_size(bdir / n)

    out = box.install_stopped(bdir, "venv-ready", swap_all, start=False)
    assert out.what == "installed", (out, box.log)
    assert all((bdir / n).read_bytes() != data for n, data in signed.items())  # the swap did happen
    assert (box.env_dir / "ftllm-dflash.env").read_bytes() == signed["env/ftllm-dflash.env"]
    assert (box.unit_dir / "ftllm-dflash.service").read_bytes() == signed["units/ftllm-dflash.service"]


# ------------------------------------------------------------------------------------------------ rebuild

@pytest.mark.slow  # pip rebuilds the venv in a child process
def test_rebuild_offline_json_report(bundles: Bundles) -> None:
    """`deploytool --json rebuild --offline BUNDLE` on the small bundle: verified with the box's trusted key, the
    venv rebuilt from its wheels, the report as JSON (the real bundle's >10 native libraries all byte-identical,
    in an empty network namespace, is tests/test_e2e.py's make rebuild-check)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "deploy_tool", "--config", str(bundles.cfg.source_path), "--json",
                        "rebuild", "--offline", str(bundles.a)], capture_output=True, text=True, timeout=300,
                       cwd=bundles.dir, env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["ok"] is True and rep["bundle_id"] == _rid(bundles.a) and rep["different"] == []
    assert rep["identical"] == rep["native_libs"] == 1 and rep["seconds"] > 0
