"""`deploytool install`: from a signed bundle to the known-good service, offline, all or nothing.

Steps (each undone, in reverse, if a later one fails; intent is in state.json before anything changes):
verify the bundle with a trusted key into a private staging dir (archive or directory alike: each file hashed
from the bytes written there; nothing is read from the bundle after that) -> refuse a bundle packed for another
config -> rename the staging dir to releases/.staging-<id> -> unpack the venv's archives, bytecode included (or
rebuild it from the wheels with --no-index --require-hashes) and relocate it, deploytool's own venv built
alongside -> refuse a box that lacks an OS library the native binaries need -> check every native library hash
against the manifest -> rename to releases/<id> -> write env files and units atomically (drop-in dirs
untouched) -> flip `current` -> pin fingerprints -> daemon-reload -> enable and start the default backend ->
health gate -> commit state and history. The same release again is a no-op, or starts the backend if none runs.
A previous release keeps running untouched until the new one is ready to start; a fresh box that fails is left
with no half-installed units.

`install_plan` and `recover_plan` build those steps as data (`Step`s, from the config, the state and what the
verified bundle and the box report); `--dry-run` prints them; built for running, each step carries the `_Install`
(or `_UndoInstall`) method it runs, and the run walks them.
An operation of another kind found interrupted is finished by whoever hands `finish` in (deploy_tool.box.operations).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from deploy_tool import archive, binaries, checks, keyring, proc, strictmodes, venv
from deploy_tool import bundle as bundle_mod
from deploy_tool.box import bootstrap, fingerprint, frontctl, packedconfig, sequence, venvreuse
from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.probe.gate import api_key, queue_start, run_gate
from deploy_tool.box.state import Operation, State, Step, Store
from deploy_tool.clock import iso_utc
from deploy_tool.config import Config, expand
from deploy_tool.errors import (
    BundleError,
    ConfigError,
    DeployError,
    ExitCode,
    GpuError,
    InputError,
    InstallError,
    MissingTool,
    RollbackFailed,
    StateError,
)
from deploy_tool.fsutil import atomic_symlink, atomic_write, os_error
from deploy_tool.manifest import hash_native_libs
from deploy_tool.progress import waiting
from deploy_tool.render import (
    API_KEY_FILE,
    FRONT_SERVICE,
    FRONT_SOCKET,
    LEGACY_SECRETS_ENV,
    RenderedFile,
    render_api_key,
)

Log = Callable[[str], None]
BUNDLE_SUFFIXES = (".tar", ".tar.zst")
# the steps an install journals (state.json's operation.step, after the step's work; each a fault point)
JOURNALED = ("verified", "venv-ready", "native-libs-checked", "tool-ready", "release-laid-down", "units-written",
             "current-flipped", "pinned", "daemon-reloaded", "started", "healthy")


@dataclass
class InstallResult:
    ok: bool
    action: str  # "installed" | "noop" | "started" | "planned"
    release: str
    release_dir: str
    backend: str | None
    seconds: float = 0.0
    steps: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def find_bundle(cfg: Config, given: str | None) -> Path:
    """The bundle to install: the one given, else the single bundle in artifacts/ (next to the config)."""
    if given:
        p = Path(given)
        if not p.exists():
            laid = "/" not in given and (Path(cfg.paths.releases_dir) / given).is_dir()
            raise InputError(f"bundle not found: {p}" + (f" ({given} is a release laid down on this box, not a "
                                                         "bundle)" if laid else ""),
                             hint="install takes a bundle: its directory (artifacts/NAME-ID) or its .tar.zst; going "
                                  "back to a release still laid down takes its bundle too, and unpacks nothing"
                                  if laid else "name the bundle's directory or .tar.zst")
        return p
    places = [cfg.base_dir / "artifacts", Path.cwd() / "artifacts", cfg.base_dir]
    seen: list[Path] = []
    for d in places:
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            is_bundle = p.name.endswith(BUNDLE_SUFFIXES) or (p.is_dir() and (p / "MANIFEST").is_file())
            if is_bundle and p.resolve() not in [s.resolve() for s in seen]:
                seen.append(p)
        if seen:
            break
    archives = [p for p in seen if p.is_file()]
    cands = archives or seen
    if not cands:
        raise InputError("no bundle given and none found in " + ", ".join(str(d) for d in places[:2]),
                         hint="build one with `deploytool pack`, or pass its path: deploytool install BUNDLE")
    if len(cands) > 1:
        raise InputError("several bundles found; name the one to install:\n  " + "\n  ".join(str(c) for c in cands),
                         hint="deploytool install BUNDLE")
    return cands[0]


class _Undo(contextlib.ExitStack):
    """What undoes each change an install made, run in reverse by `close()` when it fails (pipx-style); the
    commit drops it (`pop_all()`). An undo that fails is logged by what it undoes and the rest still run."""

    def __init__(self, log: Log = lambda s: None) -> None:  # pop_all() makes one without a log
        super().__init__()
        self.log = log

    def add(self, what: str, fn: Callable[[], None]) -> None:
        self.callback(self._undo_one, what, fn)

    def _undo_one(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # keep undoing the rest; report what could not be undone
            self.log(f"undo '{what}' failed: {exc}")


def _backup_file(p: Path, undo: _Undo) -> None:
    """Remember the current content of `p` (or its absence) so undo can restore it."""
    if p.exists():
        data = p.read_bytes()
        mode = p.stat().st_mode & 0o7777
        undo.add(f"restore {p}", lambda: atomic_write(p, data, mode))
    else:
        undo.add(f"remove {p}", lambda: p.unlink(missing_ok=True))



# ---------------------------------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class InstallFacts:
    """What an install's plan depends on besides the config and the state: the verified bundle and the box."""

    release: str  # the bundle's id
    installed: bool = False  # this release is installed: `current` points at it, its units and env files in place
    running: bool = False  # a backend runs (asked only when the release is installed and it is to start)
    laid_down: bool = False  # releases/<id> exists already (an earlier install of it)
    tool: bool = True  # the bundle carries deploytool's own wheels


# what the first step refuses besides a bad signature or file (keyring, box.sequence)
VERIFY_ALSO = " (a revoked or expired key is refused), refuse a sequence below the box's highest of its name"


def install_plan(cfg: Config, st: State, *, bundle: str, keys: str, facts: InstallFacts | None,
                 rebuild: bool = False, start: bool = True, run: _Install | None = None) -> list[Step]:
    """The steps of an install after the lock, each with what it runs when `run` (the install under way) is
    given; `facts` None: the bundle is not verified yet (--dry-run), so its id is <id> and the steps that depend
    on what it carries say so. The first step (the verification) runs before the plan is built."""
    releases, paths = Path(cfg.paths.releases_dir), cfg.paths
    rid = facts.release if facts else "<id>"
    final = releases / rid
    steps = [Step("verified", f"verify {bundle} against keys in {keys}{VERIFY_ALSO}", (f"{releases}/.verify-*",))]
    if facts is not None and facts.installed:
        if start and not facts.running:
            name = _backend_to_start(cfg, st)
            return [*steps, Step("start-installed", f"release {rid} is installed but no backend runs: start {name} "
                                 "behind the health gate, enable it for boot, disable the others",
                                 (cfg.backends[name].unit,))]
        return [*steps, Step("noop", f"nothing to do: release {rid} is already installed")]
    if facts is None or not facts.laid_down:
        stage = releases / f".staging-{rid}"
        how = ("rebuild the venv from the wheels (--no-index --require-hashes), compile, relocate" if rebuild
               else "unpack venv (bytecode included), relocate")
        steps += [Step("venv-ready", f"unpack to {stage}, {how}", (str(stage),), run=run.venv if run else None),
                  Step("native-libs-checked", "check the OS libraries the native binaries need, check native "
                       "library hashes", run=run.native_libs if run else None)]
        if facts is None or facts.tool:
            steps.append(Step("tool-ready", "build deploytool's own venv from the bundle's tool wheels",
                              (f"{stage}/tool",), when="" if facts else "if the bundle carries them",
                              run=run.tool_venv if run else None))
        steps.append(Step("release-laid-down", f"move it to {final}", (str(final),), run=run.lay_down if run else None))
    else:
        steps.append(Step("release-kept", f"{final} is laid down already: keep it", (str(final),),
                          run=run.keep if run else None))
    secrets = f", the API key as the units' root-only credential {API_KEY_FILE}" if cfg.serve.api_key_file else ""
    steps += [Step("units-written", f"write units to {paths.unit_dir}, env files to {paths.env_dir}{secrets}",
                   (paths.unit_dir, paths.env_dir), run=run.write_units if run else None),
              Step("current-flipped", f"flip {paths.current}", (paths.current,), run=run.flip_current if run else None),
              Step("pinned", "pin fingerprints", (f"{paths.state_dir}/pins",), run=run.pin if run else None),
              Step("daemon-reloaded", "daemon-reload", run=run.daemon_reload if run else None)]
    if start:
        target = cfg.backends[cfg.default_backend]
        steps += [Step("started", f"stop the other backends, hold the public port {cfg.serve.port} "
                                  f"({FRONT_SOCKET}), start {cfg.default_backend}",
                       (*(b.unit for b in cfg.backends.values()), FRONT_SOCKET), run=run.start if run else None),
                  Step("healthy", f"health gate, then enable {target.unit} for boot and disable the others",
                       (target.unit,), run=run.gate if run else None)]
    state = str(Store(paths.state_dir).state_path)
    steps += [Step("committed", "commit state", (state,), run=run.commit if run else None),
              Step("undo", "undo every step in reverse, start the backend that served, exit 14", (state,),
                   when="on failure")]
    return steps


def _backend_to_start(cfg: Config, st: State) -> str:
    """The backend a box with its release installed and nothing running should serve: the recorded active one,
    else the default."""
    return st.active_backend if st.active_backend and st.active_backend in cfg.backends else cfg.default_backend


def recover_plan(cfg: Config, st: State, *, prev_laid_down: bool, prev_running: bool,
                 run: _UndoInstall | None = None) -> list[Step]:
    """The steps that undo an install killed midway (`prev_laid_down`: the release it replaced is on the box;
    `prev_running`: the backend that served runs), each with what it runs when `run` is given; run by
    `recover_install`."""
    op = st.operation
    assert op is not None and op.kind == "install"
    rid, prev = op.release, op.previous_release
    releases, paths = Path(cfg.paths.releases_dir), cfg.paths
    target = cfg.backends.get(op.to_backend or "")
    started_new = op.step in ("started", "healthy")
    steps = [Step("clean-staging", f"remove {releases}/.verify-* and {releases}/.staging-{rid}",
                  run=run.clean_staging if run else None)]
    if prev and prev_laid_down:
        steps += [Step("restore-release", f"point {paths.current} to {releases}/{prev}, write its env files and "
                       "units back", (paths.current, paths.env_dir, paths.unit_dir), run=run.restore_release if run else None),
                  Step("repin", f"pin fingerprints of release {prev}", (f"{paths.state_dir}/pins",),
                       run=run.repin if run else None)]
        if started_new and target is not None and target.name != op.from_backend:
            steps.append(Step("stop-target", f"stop {target.unit}", (target.unit,), run=run.stop_target if run else None))
    else:
        units = sorted(b.unit for b in cfg.backends.values())
        steps.append(Step("remove-units", f"stop, disable and remove {', '.join(units)} (and the units release "
                          f"{rid} carries), their env files, the pins and {paths.current}: a fresh box keeps "
                          "nothing half-installed", (*units, paths.env_dir, f"{paths.state_dir}/pins", paths.current),
                          run=run.remove_units if run else None))
    if rid and rid != prev and not op.release_kept:  # one laid down before this install stays, as it found it
        steps.append(Step("remove-release", f"remove {releases}/{rid}", (f"{releases}/{rid}",),
                          run=run.remove_release if run else None))
    steps.append(Step("daemon-reload", "daemon-reload", run=run.daemon_reload if run else None))
    if op.from_backend and op.from_backend in cfg.backends and prev:
        b = cfg.backends[op.from_backend]
        if started_new or not prev_running:  # (re)started: serving again only once it is healthy
            steps.append(Step("restart-previous", f"{'restart' if started_new else 'start'} {b.unit} of release "
                              f"{prev} behind the health gate", (b.unit,), run=run.restart_previous if run else None))
    elif started_new and target is not None:
        steps.append(Step("stop-new", f"stop {target.unit}", (target.unit,), run=run.stop_target if run else None))
    steps.append(Step("undone", f"clear the interrupted install from state (release {prev or 'none'}), record it in "
                      "history", (str(Store(paths.state_dir).state_path),), run=run.undone if run else None))
    return steps


def planned(steps: list[Step]) -> list[dict[str, Any]]:
    """The steps as --dry-run --json shows them: "step" the text, then the step as data."""
    return [{"step": s.text(), **s.to_json()} for s in steps]


# ---------------------------------------------------------------------------------------------------- install

def _finish_own(cfg: Config, store: Store, sd: systemd_mod.Systemd, log: Log) -> Callable[[State], object]:
    """Without an operations layer: an interrupted install is undone; another kind is left to `recover`."""
    def finish(st: State) -> None:
        assert st.operation is not None
        if st.operation.kind != "install":
            raise StateError(f"an interrupted {st.operation.kind} is found: it is finished by `deploytool recover`",
                             hint="run deploytool recover")
        recover_install(cfg, store, st, sd=sd, log=log)
    return finish


def install(cfg: Config, bundle_path: str | None, *, keys_dir: str | None = None, rebuild: bool = False,
            dry_run: bool = False, start: bool = True, log: Log = lambda s: None, progress=None,
            sd: systemd_mod.Systemd | None = None, wait: float = 0.0,
            finish: Callable[[State], object] | None = None, allow_downgrade: str | None = None) -> InstallResult:
    """Install the bundle (`finish`: what finishes an operation found interrupted under the lock;
    `allow_downgrade`: why a bundle below the box's highest sequence of its name is installed, see box.sequence)."""
    t0 = time.monotonic()
    path = find_bundle(cfg, bundle_path)
    keys = keys_dir or cfg.paths.keys_dir
    releases = Path(cfg.paths.releases_dir)
    store = Store(cfg.paths.state_dir)
    # before anything is written (the state dir, the lock): what steers the root steps must be root's alone
    strictmodes.require(cfg, None, f"cannot install {path.name}",
                        extra=strictmodes.keys_paths(keys) if keys != cfg.paths.keys_dir else ())
    if dry_run:  # what the real install refuses first, checked in place (an archive in a temporary directory)
        with bundle_mod.verify_bundle(path, keys) as vb:
            check_config_matches(cfg, vb.root / "config.json", vb.manifest.bundle_id)
            _box_refusal(cfg, keys, vb.key_id)
        st = store.load()
        steps = store.lock_steps(st) + install_plan(cfg, st, bundle=str(path), keys=keys, facts=None,
                                                    rebuild=rebuild, start=start)
        return InstallResult(True, "planned", "?", str(releases / "<id>"), cfg.default_backend, steps=planned(steps))
    sd = sd or systemd_mod.for_config(cfg)
    store.ensure()
    with store.locked(what="install", wait=wait, finish=finish or _finish_own(cfg, store, sd, log), log=log) as st:
        makedirs_open(releases)
        try:
            staging_root = Path(tempfile.mkdtemp(prefix=".verify-", dir=releases))
        except OSError as exc:
            raise os_error(exc, f"cannot create a staging directory in {releases}") from None
        try:
            return _install_verified(cfg, sd, store, st, path, keys, staging_root, rebuild=rebuild, start=start,
                                     log=log, progress=progress, t0=t0, allow_downgrade=allow_downgrade)
        finally:
            shutil.rmtree(staging_root, ignore_errors=True)


def check_gpus(cfg: Config) -> None:
    """Refuse, before anything changes, a config whose cuda backends would lose their GPUs on this box: no NVIDIA
    driver, a host.gpus entry the driver does not have, device nodes the service user cannot open."""
    front = checks.front_errors(cfg)
    if front:
        raise ConfigError("; ".join(f"{f.id}: {f.message}" for f in front), hint=front[0].fix,
                          details={"findings": [f.to_json() for f in front]})
    errs = checks.gpu_box_errors(cfg)
    if errs:
        raise GpuError("this box cannot give the cuda backends their GPUs: " + "; ".join(f.message for f in errs),
                       hint="; ".join(dict.fromkeys(f.fix for f in errs)),
                       details={"findings": [f.to_json() for f in errs]})


def api_key_credential(cfg: Config) -> RenderedFile | None:
    """The root-only copy of serve.api_key_file's key the units load as their credential; None without a key.
    A missing, empty or unusable key is refused before the install changes anything."""
    if not cfg.serve.api_key_file:
        return None
    key = api_key(cfg)
    if not key:
        raise InputError(f"serve.api_key_file {cfg.serve.api_key_file} is missing or empty",
                         hint="write the API key into that file (root-only, mode 0600), or unset serve.api_key_file")
    return render_api_key(cfg, key)


def _verify(cfg: Config, path: Path, keys: str, staging_root: Path, log: Log) -> bundle_mod.VerifiedBundle:
    """The first step: the bundle verified into a private copy, packed for this config."""
    log(f"verifying {path}")
    try:
        vb = bundle_mod.verify_bundle(path, keys, staging=staging_root / "b")
    except OSError as exc:  # e.g. no space left for the verified copy
        raise os_error(exc, f"cannot unpack {path} under {staging_root.parent} to verify it") from None
    check_config_matches(cfg, vb.root / "config.json", vb.manifest.bundle_id)
    _box_refusal(cfg, keys, vb.key_id)
    return vb


def _box_refusal(cfg: Config, keys: str, key_id: str) -> None:
    """--keys names where the trusted keys are, never a way around this box's own revocations and expiries."""
    if os.path.realpath(keys) != os.path.realpath(cfg.paths.keys_dir) and Path(cfg.paths.keys_dir).is_dir():
        refusal = keyring.load(cfg.paths.keys_dir, require_keys=False).refusal(key_id)
        if refusal is not None:
            raise refusal


def _install_verified(cfg: Config, sd: systemd_mod.Systemd, store: Store, st: State, path: Path, keys: str,
                      staging_root: Path, *, rebuild: bool, start: bool, log: Log, progress, t0: float,
                      allow_downgrade: str | None = None) -> InstallResult:
    vb = _verify(cfg, path, keys, staging_root, log)
    api_key_credential(cfg)  # a missing or unusable key fails here, before anything changes
    check_gpus(cfg)  # so does a cuda backend whose GPUs this box lacks or closes to it
    rid = vb.manifest.bundle_id
    # no replay: a bundle older than the newest of its name this box installed is refused here, before any change
    seq = sequence.of_bundle(vb.manifest, vb.root / "config.json")
    downgrade = sequence.check(cfg.paths.releases_dir, cfg.paths.state_dir, seq, rid, allow_downgrade=allow_downgrade)
    if downgrade is not None:
        log(f"downgrade of {seq.name} from sequence {downgrade.highest} to {seq.number}, on purpose: {downgrade.reason}")
    else:
        highest = sequence.load(cfg.paths.state_dir).get(seq.name)
        if highest is not None and seq.number < highest["sequence"]:  # allowed: it is laid down on this box
            log(f"note: going back to an older release of {seq.name}: {rid} is sequence {seq.number}, this box has "
                f"installed sequence {highest['sequence']} ({highest.get('release')}); the older one is still laid "
                "down here, so it is not refused as a downgrade")
    final = Path(cfg.paths.releases_dir) / rid
    installed = st.release == rid and final.is_dir() and Path(cfg.paths.current).resolve() == final.resolve() \
        and _units_match(cfg, vb.root)
    facts = InstallFacts(release=rid, installed=installed, laid_down=final.exists(),
                         tool=(vb.root / "tool" / "wheels").is_dir(),
                         running=installed and start and any(
                             sd.show(b.unit).active_state in ("active", "activating", "reloading")
                             for b in cfg.backends.values()))
    # what to do, first: the steps are bound to the run below only when there is an install to run
    steps = install_plan(cfg, st, bundle=str(path), keys=keys, facts=facts, rebuild=rebuild, start=start)
    if steps[1].name == "start-installed":
        return _start_installed(cfg, sd, store, st, rid, final, log=log, t0=t0)
    if steps[1].name == "noop":
        return InstallResult(True, "noop", rid, str(final), st.active_backend, seconds=time.monotonic() - t0,
                             message=f"release {rid} is already installed; nothing to do")
    op = Operation(kind="install", op_id=uuid.uuid4().hex[:12], started=iso_utc(micro=True), step="verified",
                   from_backend=st.active_backend, to_backend=cfg.default_backend, release=rid,
                   previous_release=st.release, pid=os.getpid(), release_kept=facts.laid_down)
    st = store.begin(st, op)
    undo = _Undo(log)
    try:
        run = _Install(cfg, sd, store, st, vb, final, rebuild=rebuild, undo=undo, log=log,
                       progress=progress, seq=seq, downgrade=downgrade)
        run.marks[0]["since_start_s"] = round(run.marks[0]["t"] - t0, 3)  # lock, verify, checks, intent
        res = run.run(install_plan(cfg, st, bundle=str(path), keys=keys, facts=facts, rebuild=rebuild, start=start,
                                   run=run))
    except BaseException as exc:
        _undo(cfg, sd, store, st, undo, log)
        if isinstance(exc, OSError):  # disk full and the like, from any step: a clean error, exit 17
            exc = os_error(exc, f"install of {rid}")
        if isinstance(exc, DeployError):
            store.record("install", ok=False, release=rid, reason=exc.message.splitlines()[0])
            if not isinstance(exc, InstallError):
                err = InstallError(f"install of {rid} failed: {exc.message}",
                                   hint=exc.hint or "nothing was left half-installed; fix the cause "
                                   "and run deploytool install again")
                if exc.exit_code in (ExitCode.OS, ExitCode.MISSING_TOOL, ExitCode.UNSAFE_PATH):
                    err.exit_code = exc.exit_code  # disk full, a missing OS library, a path not root's: fix the box
                raise err from exc
            raise exc from None
        raise
    res.seconds = time.monotonic() - t0
    return res


def _undo(cfg: Config, sd: systemd_mod.Systemd, store: Store, st: State, undo: _Undo, log: Log) -> None:
    """The failure step: every step undone in reverse, the backend that served started again, intent cleared."""
    log("install failed; undoing")
    undo.close()
    with contextlib.suppress(DeployError):
        sd.daemon_reload()
    prev = st.active_backend
    if prev and prev in cfg.backends and st.release:
        with contextlib.suppress(DeployError):  # queued: it serves once its ExecStartPost sees it ready
            sd.start(cfg.backends[prev].unit, no_block=True, past_start_limit=True)
    store.save(replace(st, operation=None))


def release_binaries(cfg: Config, release: Path) -> tuple[dict[str, set[str]], list[Path]]:
    """({backend: its llama-server binaries}, extra ELF roots outside the venv) of a release laid down at
    `release` (a staging dir or the installed one): binaries named under {current}/{venv} are looked up there,
    others on the box; the bundled NCCL when present."""
    cur = cfg.paths.current.rstrip("/")
    per_backend: dict[str, set[str]] = {}
    extra: list[Path] = []
    nccl = release / "nccl" / "libnccl.so.2"
    if nccl.is_file():
        extra.append(nccl)
    for b in cfg.backends.values():
        if b.kind != "llamacpp":
            continue
        path = expand(cfg, b.binary)  # type: ignore[union-attr]
        p = release / path[len(cur) + 1:] if path.startswith(cur + "/") else Path(path)
        if p.is_file():
            per_backend.setdefault(b.name, set()).add(str(p))
            if not str(p).startswith(str(release) + "/venv/"):
                extra.append(p)
    return per_backend, extra


def check_os_libraries(cfg: Config, release: Path) -> None:
    """Refuse a box that lacks an OS library the release's native binaries need (ELF NEEDED entries resolved
    as the dynamic loader would), naming the library and the Debian package that provides it; nothing on the box
    has changed yet (the release is still in its staging dir)."""
    _per_backend, extra = release_binaries(cfg, release)
    try:
        missing = binaries.release_missing_libraries(
            release / "venv", extra=extra,
            ftllm_devices={b.device for b in cfg.backends.values() if b.kind == "ftllm"})
    except InputError as exc:
        raise BundleError(f"a native binary of the release cannot be read: {exc.message}") from None
    if not missing:
        return

    def rel(p: str) -> str:
        return os.path.relpath(p, release) if p.startswith(str(release) + "/") else p

    first = missing[0]
    pkgs = sorted({m.package for m in missing if m.package and " " not in m.package})
    others = f" (and {', '.join(m.name for m in missing[1:4])}{' ...' if len(missing) > 4 else ''})" \
        if len(missing) > 1 else ""
    raise MissingTool(f"this box lacks {first.name}, needed by {rel(first.needed_by)}"
                      + (f" (Debian package: {first.package})" if first.package else "") + others
                      + "; nothing was installed",
                      hint=(f"apt-get install {' '.join(pkgs)}" if pkgs else "install the library from the OS")
                      + ", then run deploytool install again",
                      details={"missing": [{"library": m.name, "needed_by": rel(m.needed_by), "package": m.package}
                                          for m in missing]})


def check_config_matches(cfg: Config, packed_json: Path, rid: str) -> None:
    """Refuse a bundle packed for another config, naming the differing keys.

    The bundle's units, env files and paths were rendered from the config it was packed with and are signed as
    such; installing them under a config that says otherwise would start services pointing at paths the box
    does not have, or pin and check something else than what runs. Rendering the units again on the box would
    install unsigned files: the fix is to pack with this box's config (or install with the one it was packed
    from)."""
    try:
        diffs = packedconfig.differences(cfg, packed_json)
    except (OSError, ValueError) as exc:
        raise BundleError(f"bundle {rid} carries no readable config.json: {exc}",
                          hint="pack the bundle again with `deploytool pack`") from None
    if not diffs:
        return
    where = cfg.source_path or "the config"
    raise BundleError(f"bundle {rid} was packed for another config than {where}: "
                      f"{packedconfig.describe(diffs, 'bundle')}",
                      hint="pack the bundle with this box's config (`deploytool pack`), or install with the config "
                           "it was packed from", details={"differences": [k for k, _, _ in diffs]})


def _start_installed(cfg: Config, sd: systemd_mod.Systemd, store: Store, st: State, rid: str, final: Path, *,
                     log: Log, t0: float) -> InstallResult:
    """The release is installed but no backend runs (an earlier `install --no-start`, a stopped box): start the
    backend the box should serve (the recorded active one, else the default) behind the same gate as install."""
    name = _backend_to_start(cfg, st)
    target = cfg.backends[name]
    log(f"release {rid} is already installed but no backend is running; starting {name}")
    if sd.unit_path(FRONT_SOCKET).exists():
        start_front(cfg, sd, None, log=log)
    sd.reset_failed(target.unit)
    queue_start(sd, target.unit, restart=True)
    try:
        gate = run_gate(cfg, sd, target, on_event=log)
    except DeployError as exc:
        with contextlib.suppress(DeployError):
            sd.stop(target.unit)
        store.record("install", ok=False, release=rid, backend=name, reason=exc.message.splitlines()[0])
        raise
    sd.enable(target.unit)
    for o in cfg.other_backends(name):
        if sd.is_enabled(o.unit) == "enabled":
            sd.disable(o.unit)
    store.save(replace(store.load(), active_backend=name,
                       previous_backend=st.previous_backend if st.active_backend == name else st.active_backend))
    store.record("install", ok=True, release=rid, backend=name, action="started")
    from deploy_tool.box.probe.liveness import arm

    arm(cfg, sd, log=log)
    return InstallResult(True, "started", rid, str(final), name, seconds=time.monotonic() - t0,
                         steps=[{"step": "healthy", "ready_s": round(gate.ready_s, 2)}],
                         message=f"release {rid} is already installed; {name} was not running and now serves "
                                 f"{cfg.serve.model_name!r} on port {cfg.serve.port}")


def start_front(cfg: Config, sd: systemd_mod.Systemd, undo: _Undo | None, *, log: Log) -> None:
    """The front's socket enabled and started (the public port, held by systemd from now on) and its service
    started, or restarted without waiting when it runs (the new release's launch/front.py and unit take over; the
    socket keeps every connection meanwhile, requests in flight finish first). `undo`: how to take it back down,
    when it was not up before."""
    sd.enable(FRONT_SOCKET, reload=False)
    sd.start(FRONT_SOCKET)
    if undo is not None:
        def down() -> None:
            sd.stop(FRONT_SERVICE)
            sd.stop(FRONT_SOCKET)
            sd.disable(FRONT_SOCKET, reload=False)

        undo.add(f"stop and disable {FRONT_SOCKET}", down)
    if sd.show(FRONT_SERVICE).active_state in ("active", "activating"):
        sd.restart(FRONT_SERVICE, no_block=True)
    else:
        sd.start(FRONT_SERVICE, no_block=True)
    log(f"the public port {cfg.serve.host}:{cfg.serve.port} is held by {FRONT_SOCKET}; requests wait for a backend "
        f"at most {cfg.hold_timeout_s:g} s")


def _units_match(cfg: Config, root: Path) -> bool:
    for d, target in (("units", cfg.paths.unit_dir), ("env", cfg.paths.env_dir)):
        for f in sorted((root / d).iterdir()) if (root / d).is_dir() else []:
            t = Path(target) / f.name
            if not t.is_file() or t.read_bytes() != f.read_bytes():
                return False
    return True


class _Install:
    """One install under the lock: what each step of its plan runs (install_plan binds them), each journaled
    (and a fault point) once done; every change it makes registers its undo."""

    def __init__(self, cfg: Config, sd: systemd_mod.Systemd, store: Store, st: State, vb: bundle_mod.VerifiedBundle,
                 final: Path, *, rebuild: bool, undo: _Undo, log: Log, progress,
                 seq: sequence.BundleSequence | None = None, downgrade: sequence.Downgrade | None = None) -> None:
        self.cfg, self.sd, self.store, self.st, self.vb, self.final = cfg, sd, store, st, vb, final
        self.seq, self.downgrade = seq, downgrade
        self.rebuild, self.undo, self.log, self.progress = rebuild, undo, log, progress
        self.rid = vb.manifest.bundle_id
        self.stage = final.parent / f".staging-{self.rid}"
        self.target = cfg.backends[cfg.default_backend]
        self.started = False
        self.front_before: dict | None = None
        # the verification ran before the plan: its end is the first mark, so every step's time is between marks
        self.marks: list[dict[str, Any]] = [{"step": "verified", "t": round(time.monotonic(), 3)}]
        self.tool: Future[None] | None = None
        # the files this install hashed as it wrote them (the verified bundle copy, the unpacked venv), by their
        # path in the release and their stat then: the native library check and the pin read none of them again
        self.written = fingerprint.HashCache()  # in memory: only values computed in this process
        if vb.extracted:
            self._note_written(vb.root, {f.path: f.sha256 for f in vb.manifest.files}, "")

    def run(self, steps: list[Step]) -> InstallResult:
        # deploytool's own venv needs only the (verified) tool wheels: it is built on this pool while the backend
        # venv unpacks (on another core: its work is mostly a child python), and waited for at tool-ready
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tool-venv") as self.pool:
            for step in steps:
                if step.when or step.name == "verified":  # verified: done before the plan; the failure step: above
                    continue
                assert step.run is not None, step.name
                with waiting(f"install: {step.does}"):  # unpacking, pinning, the tool venv, the gate: each shown
                    kw: dict[str, Any] = step.run()
                if step.name in JOURNALED:
                    self.marks.append({"step": step.name, "t": round(time.monotonic(), 3), **kw})
                    self.log(step.name + "".join(f" {k}={v}" for k, v in kw.items()))
                    self.store.advance(self.store.load(), step.name)
        name = self.target.name if self.started else None
        return InstallResult(True, "installed", self.rid, str(self.final), name, steps=self.marks,
                             message=f"release {self.rid} installed" + (
                                 f"; {name} is serving {self.cfg.serve.model_name!r} on port {self.cfg.serve.port}"
                                 if self.started else ""))

    def _note_written(self, root: Path, digests: dict[str, str], under: str) -> None:
        """Record the files under `root` whose bytes were hashed as they were written (`digests`, by relative
        path), with their stat now: a file changed or replaced after this (relocated, a mode fixed) has another
        stat, so the pin's cache misses it and reads it; one changed in the same clock tick is racy and read too."""
        at = time.time_ns()
        final = str(self.final) + "/" + under
        for rel, sha in digests.items():
            try:
                st = os.lstat(root / rel)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                self.written.put(final + rel, st, "sha256", sha, at)

    def venv(self) -> dict[str, Any]:
        cfg, stage, venv_final = self.cfg, self.stage, self.final / "venv"
        shutil.rmtree(stage, ignore_errors=True)
        try:
            # the private copy verify_bundle wrote and hashed (archive or directory alike), on the same file
            # system: renamed, never read from the bundle again
            os.rename(self.vb.root, stage)
        except OSError as exc:
            shutil.rmtree(stage, ignore_errors=True)
            raise os_error(exc, f"cannot lay down release {self.rid} under {stage.parent}") from None
        self.undo.add(f"remove {stage}", lambda: shutil.rmtree(stage, ignore_errors=True))
        os.chmod(stage, 0o755)  # the staging copy came from a private temp dir; services must read the release
        if (stage / "tool" / "wheels").is_dir():
            self.tool = self.pool.submit(_bootstrap_tool, cfg, stage, self.final, self.log)
        if self.rebuild:
            self.log("venv: rebuilding from the bundle's wheels (--no-index --require-hashes)")
            venv.build_venv(cfg.bundle.python, stage / "requirements.lock", stage / "wheels", stage / "venv")
            venv.compile_venv(stage / "venv", cfg.paths.current, self.log)  # the same .pyc the archive carries
            venv.relocate_venv(stage / "venv", str(stage / "venv"), str(venv_final))
        else:
            t0 = time.monotonic()
            # the MANIFEST's venv parts (none in a format-1 bundle): what this release may share, and its index
            part_sha = {f.path: f.sha256 for f in self.vb.manifest.files if f.path.startswith(venv.VENV_PARTS + "/")}
            donor, shared = self._reusable(part_sha)
            index = self._unpack(exclude=shared)
            t1 = time.monotonic()
            # before the links: `python -m venv` writes some files in place (activate scripts, pyvenv.cfg, the
            # interpreter's names), which must never be the previous release's inodes; a part that holds one of
            # those names then fails to link (it exists) and every part is unpacked
            venv.finish_venv(cfg.bundle.python, stage / "venv")
            t2 = time.monotonic()
            linked, refused = 0, None
            if donor is not None and shared:
                try:
                    linked = self._link(donor, shared)
                    index.update({rel: donor.parts[rel][1] for rel in shared})
                except venvreuse.NoReuse as exc:
                    refused = str(exc)  # in the step's report too: a fallback is slower, never silent
                    self.log(f"venv: every part unpacked: {exc}")
                    shutil.rmtree(stage / "venv")
                    donor, shared = None, []
                    index = self._unpack(exclude=[])
                    venv.finish_venv(cfg.bundle.python, stage / "venv")
            t3 = time.monotonic()
            if index:
                venvreuse.write_index(stage, {rel: (part_sha[rel], names) for rel, names in index.items()})
            olds: tuple[str, ...] = (self.vb.manifest.inputs.get("venv_placeholder", venv.VENV_PLACEHOLDER),
                                     str(stage / "venv"))
            if donor is not None:  # scripts linked from the donor name its venv
                olds += (str(Path(self.cfg.paths.releases_dir) / donor.rid / "venv"), str(donor.root / "venv"))
            venv.relocate_venv(stage / "venv", olds, str(venv_final))
            return {"mode": "unpack", "unpack_s": round(t1 - t0, 3), "finish_s": round(t2 - t1, 3),
                    "link_s": round(t3 - t2, 3), "relocate_s": round(time.monotonic() - t3, 3),
                    **({"reused_parts": len(shared), "linked_files": linked, "from": donor.rid} if donor else {}),
                    **({"reuse_refused": refused} if refused else {})}
        return {"mode": "rebuild"}

    def _reusable(self, want: dict[str, str]) -> tuple[venvreuse.Donor | None, list[str]]:
        """The current release and which of the venv parts `want` ({part: SHA-256}) this release can take from it
        (venvreuse), or (None, [])."""
        if not want:
            return None, []
        try:
            donor = venvreuse.find_donor(self.cfg, self.rid)
        except venvreuse.NoReuse as exc:
            self.log(f"venv: every part unpacked: {exc}")
            return None, []
        return donor, venvreuse.shared_parts(donor, want)

    def _unpack(self, *, exclude: list[str]) -> dict[str, list[str]]:
        """Unpack the venv's archives but `exclude` into the staging venv; {part: the entries it unpacked} for a
        bundle of parts (venvreuse.INDEX), {} for a format-1 bundle's one archive."""
        dest = self.stage / "venv"
        # the Python writer hashes each file as it writes it, for the checks after; through the system's tar
        # the data never enters this process (splice) and they read the files back from the page cache
        digests: dict[str, str] | None = None if archive.unpack_tools() else {}
        archives = venv.venv_archives(f.path for f in self.vb.manifest.files)
        unpack = [rel for rel in archives if rel not in exclude]
        names: list[list[str]] = []
        archive.extract_archive([self.stage / rel for rel in unpack], dest, symlinks=True, progress=self.progress,
                                digests=digests, names=names)
        if digests:
            self._note_written(dest, digests, "venv/")
        return {} if archives == [venv.LEGACY_VENV_ARCHIVE] else dict(zip(unpack, names, strict=True))

    def _link(self, donor: venvreuse.Donor, shared: list[str]) -> int:
        """Link the `shared` parts from `donor` into the staging venv; the files' hashes, checked against the
        donor's pins, are the pin's (the written cache) unless a file changes after its read."""
        linked, at = venvreuse.link_parts(donor, shared, self.stage / "venv")
        for f in linked:
            self.written.put(f"{self.final}/venv/{f.name}", f.st, "sha256", f.sha256, at)
        return len(linked)

    def native_libs(self) -> dict[str, Any]:
        check_os_libraries(self.cfg, self.stage)
        got = hash_native_libs(self.stage / "venv", progress=self.progress, known=self.written.get_same_file)
        want = dict(self.vb.manifest.native_libs)
        bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        if bad:
            raise BundleError(f"{len(bad)} native libraries in the venv differ from the manifest: "
                              + ", ".join(f"{k} (expected {str(want.get(k))[:12]}, got {str(got.get(k))[:12]})"
                                          for k in bad[:5]), hint="the bundle or the rebuild is not reproducible")
        return {"count": len(got)}

    def tool_venv(self) -> dict[str, Any]:
        assert self.tool is not None, "the plan has tool-ready but the bundle carries no tool wheels"
        self.tool.result()
        return {}

    def lay_down(self) -> dict[str, Any]:
        try:
            os.rename(self.stage, self.final)
        except OSError as exc:
            raise os_error(exc, f"cannot move release into {self.final}") from None
        final = self.final
        self.undo.add(f"remove release {final}", lambda: shutil.rmtree(final, ignore_errors=True))
        server_modes(final)
        return {"dir": str(final)}

    def keep(self) -> dict[str, Any]:
        server_modes(self.final)  # a release laid down before (by an older deploytool, with a 0700 venv)
        return {}

    def write_units(self) -> dict[str, Any]:
        cfg, final, undo = self.cfg, self.final, self.undo
        env_dir, unit_dir = Path(cfg.paths.env_dir), Path(cfg.paths.unit_dir)
        for d in (env_dir, unit_dir):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise os_error(exc, f"cannot create {d}") from None
        for f in sorted((final / "env").iterdir()):
            _backup_file(env_dir / f.name, undo)
            atomic_write(env_dir / f.name, f.read_bytes(), 0o644)
        sec = api_key_credential(cfg)
        if sec is not None:
            _backup_file(env_dir / sec.name, undo)
            atomic_write(env_dir / sec.name, sec.content.encode(), sec.mode)
            legacy = env_dir / LEGACY_SECRETS_ENV  # the key as environment, left by an older deploytool
            if legacy.exists():
                _backup_file(legacy, undo)
                legacy.unlink()
        for f in sorted((final / "units").iterdir()):
            _backup_file(unit_dir / f.name, undo)
            self.sd.install_file(f.name, f.read_bytes(), 0o644)
        return {"units": sorted(p.name for p in (final / "units").iterdir())}

    def flip_current(self) -> dict[str, Any]:
        cur = Path(self.cfg.paths.current)
        old_target = os.readlink(cur) if cur.is_symlink() else None
        atomic_symlink(os.path.relpath(self.final, cur.parent), cur)
        self.undo.add(f"point {cur} back", (lambda: atomic_symlink(old_target, cur)) if old_target
                      else (lambda: cur.unlink(missing_ok=True)))
        return {"to": str(self.final)}

    def pin(self) -> dict[str, Any]:
        pins_dir = Path(self.cfg.paths.state_dir) / "pins"
        # the backends share the release: it is read once for all their pins, and what this install hashed as it
        # wrote it (same path, same stat, not racy) is not read at all
        fresh = self.written
        for name in sorted(self.cfg.backends):
            _backup_file(pins_dir / f"{name}.json", self.undo)
            fingerprint.pin(self.cfg, self.cfg.backends[name], f"install of release {self.rid}", release=self.rid,
                            store=self.store, fresh=fresh)
        return {}

    def daemon_reload(self) -> dict[str, Any]:
        self.sd.daemon_reload()
        return {}

    def start(self) -> dict[str, Any]:
        sd, target = self.sd, self.target
        front_was_up = sd.show(FRONT_SOCKET).active_state == "active"
        self.front_before = frontctl.stats(self.cfg)  # what clients see from here goes into the history event
        # a box upgraded from a deploytool without the front: the serving backend holds the public port itself,
        # so it stops before the front's socket can take that port (its clients wait from then on)
        stop = self.cfg.other_backends(target.name) + ([] if front_was_up else [target])
        for o in stop:
            if sd.show(o.unit).active_state in ("active", "activating"):
                sd.stop(o.unit)
                self.undo.add(f"restart {o.unit}", functools.partial(sd.start, o.unit, no_block=True,
                                                                     past_start_limit=True))
        start_front(self.cfg, sd, self.undo if not front_was_up else None, log=self.log)
        sd.reset_failed(target.unit)
        self.undo.add(f"stop {target.unit}", lambda: sd.stop(target.unit))
        queue_start(sd, target.unit, restart=True)
        self.started = True
        return {"unit": target.unit}

    def gate(self) -> dict[str, Any]:
        sd, target = self.sd, self.target
        gate = run_gate(self.cfg, sd, target, on_event=self.log)  # the invocation it first sees run
        sd.enable(target.unit)
        for o in self.cfg.other_backends(target.name):
            if sd.is_enabled(o.unit) == "enabled":
                sd.disable(o.unit)
        return {"ready_s": round(gate.ready_s, 2)}

    def commit(self) -> dict[str, Any]:
        st, rid, name = self.st, self.rid, self.target.name
        new = replace(self.store.load(), operation=None, release=rid,
                      previous_release=st.release if st.release != rid else st.previous_release,
                      active_backend=name if self.started else st.active_backend,
                      previous_backend=st.active_backend if st.active_backend != name else st.previous_backend)
        if self.seq is not None:  # the highest of its name, once the install is committed (box.sequence)
            sequence.record(self.cfg.paths.state_dir, self.seq, rid, iso_utc(micro=True))
        self.store.save(new)
        self.undo.pop_all()  # committed: nothing is undone
        extra: dict[str, Any] = {"key_id": self.vb.key_id}
        if self.seq is not None:
            extra.update(bundle_name=self.seq.name, sequence=self.seq.number)
        if self.downgrade is not None:
            extra["downgrade"] = self.downgrade.to_json()
            extra["reason"] = f"downgrade: {self.downgrade.reason}"
        if self.started:
            seen = frontctl.delta(self.front_before, frontctl.stats(self.cfg))
            if seen is not None:
                extra["clients"] = seen
        self.store.record("install", ok=True, release=rid, backend=name if self.started else None,
                          previous_release=st.release, mode="rebuild" if self.rebuild else "unpack", **extra)
        if self.started:
            from deploy_tool.box.probe.liveness import arm

            arm(self.cfg, self.sd, log=self.log)
        from deploy_tool.box import releases  # keep supervision.keep_releases, under this install's lock

        releases.auto_prune(self.cfg, self.store, self.log)
        return {}


def makedirs_open(d: Path) -> None:
    """mkdir -p with every directory it creates 0755 whatever the umask (the servers' DynamicUser passes through
    the install root to reach the release); directories already there keep their modes (`check` reports one
    that closes the way: unit-path-hidden)."""
    missing = []
    p = d
    while not p.exists():
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        p.mkdir(exist_ok=True)
        os.chmod(p, 0o755)


def server_modes(tree: Path) -> int:
    """Give the release the modes its servers need: they run as a DynamicUser (no group, no home), so every
    directory must be 0755 and every file 0644 (0755 if executable), owned by whoever installs (root), writable
    by nobody else. The venv's archives unpack into a private 0700 staging directory and pip, venv and compileall
    follow the umask, so nothing of that is left to chance. Symlinks are left alone. Returns how many modes
    changed."""
    changed = 0

    def fix(p: str, want: int, have: int) -> None:
        nonlocal changed
        if have & 0o7777 != want:
            os.chmod(p, want)
            changed += 1

    fix(str(tree), 0o755, tree.stat().st_mode)
    for top, dirs, files in os.walk(tree):
        for name in dirs + files:
            p = os.path.join(top, name)
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                fix(p, 0o755, st.st_mode)
            elif stat.S_ISREG(st.st_mode):
                fix(p, 0o755 if st.st_mode & 0o111 else 0o644, st.st_mode)
    return changed


def _bootstrap_tool(cfg: Config, stage: Path, final: Path, log: Log) -> None:
    """deploytool's own venv inside the release, from the bundle's tool wheels, with no network."""
    tool = stage / "tool" / "venv"
    wheels = stage / "tool" / "wheels"
    # no pip and no ensurepip (Debian/Ubuntu ship it separately): the stdlib wheel installer the bundle's
    # `bootstrap` uses, which checks every file against its wheel's RECORD and writes a RECORD verify pins
    proc.run([cfg.bundle.python, "-m", "venv", "--without-pip", str(tool)], env=venv.pip_env(), timeout=600)
    try:
        bootstrap.install_wheels([str(p) for p in wheels.glob("*.whl")], str(tool),
                                 python_path=str(final / "tool" / "venv" / "bin" / "python"))
    except bootstrap.Refused as exc:
        raise BundleError(f"deploytool's own venv: {exc.message}", hint=exc.hint) from None
    venv.relocate_venv(tool, str(tool), str(final / "tool" / "venv"))
    bindir = stage / "tool" / "bin"
    bindir.mkdir(exist_ok=True)
    os.symlink("../venv/bin/deploytool", bindir / "deploytool")
    log("tool: deploytool bootstrapped into the release")




# ---------------------------------------------------------------------------------------------------- recover

def recover_steps(cfg: Config, st: State, *, sd: systemd_mod.Systemd, run: _UndoInstall | None = None) -> list[Step]:
    """The plan that undoes the interrupted install in `st`, from what the box reports (bound to `run`)."""
    op = st.operation
    assert op is not None
    prev = op.previous_release
    laid_down = bool(prev) and (Path(cfg.paths.releases_dir) / str(prev)).is_dir()
    started_new = op.step in ("started", "healthy")
    b = cfg.backends.get(op.from_backend or "")
    running = b is not None and bool(prev) and not started_new and sd.show(b.unit).is_active
    return recover_plan(cfg, st, prev_laid_down=laid_down, prev_running=running, run=run)


def recover_install(cfg: Config, store: Store, st: State, *, sd: systemd_mod.Systemd, log: Log) -> None:
    """Undo an install that was killed midway along its plan: restore the previous release's units, current and
    pins (on a fresh box: remove what it laid down), and start the backend that served.

    Runs under the state lock, so no other install is using releases/.verify-* or .staging-* right now."""
    run = _UndoInstall(cfg, store, st, sd=sd, log=log)
    for step in recover_steps(cfg, st, sd=sd, run=run):
        assert step.run is not None, step.name
        step.run()


class _UndoInstall:
    """Undoing one interrupted install: what each step of its plan runs (recover_plan binds them)."""

    def __init__(self, cfg: Config, store: Store, st: State, *, sd: systemd_mod.Systemd, log: Log) -> None:
        assert st.operation is not None and st.operation.kind == "install"
        self.cfg, self.store, self.st, self.sd, self.log, self.op = cfg, store, st, sd, log, st.operation
        self.rid, self.prev = self.op.release, self.op.previous_release
        self.releases = Path(cfg.paths.releases_dir)
        # from "started" on, the target runs the new release's units and environment: a plain start would keep it
        self.started_new = self.op.step in ("started", "healthy")

    def clean_staging(self) -> None:
        if self.releases.is_dir():  # the killed run's private verify dir and staging copy
            for p in self.releases.iterdir():
                if p.name.startswith(".verify-") or (self.rid and p.name == f".staging-{self.rid}"):
                    shutil.rmtree(p, ignore_errors=True)

    def restore_release(self) -> None:
        prev = self.releases / str(self.prev)
        cur = Path(self.cfg.paths.current)
        atomic_symlink(os.path.relpath(prev, cur.parent), cur)
        for d, dest in (("env", Path(self.cfg.paths.env_dir)), ("units", Path(self.cfg.paths.unit_dir))):
            for f in sorted((prev / d).iterdir()):
                atomic_write(dest / f.name, f.read_bytes(), 0o644)

    def repin(self) -> None:
        fresh = fingerprint.HashCache()
        for name in sorted(self.cfg.backends):
            fingerprint.pin(self.cfg, self.cfg.backends[name], f"recover: back to release {self.prev}",
                            release=self.prev, store=self.store, fresh=fresh)

    def stop_target(self) -> None:
        with contextlib.suppress(DeployError):
            self.sd.stop(self.cfg.backends[str(self.op.to_backend)].unit)

    def remove_units(self) -> None:
        _remove_units(self.cfg, self.sd, self.releases / self.rid if self.rid else None)

    def remove_release(self) -> None:
        shutil.rmtree(self.releases / str(self.rid), ignore_errors=True)

    def daemon_reload(self) -> None:
        with contextlib.suppress(DeployError):
            self.sd.daemon_reload()

    def restart_previous(self) -> None:
        sd, b = self.sd, self.cfg.backends[str(self.op.from_backend)]
        try:
            sd.reset_failed(b.unit)
            queue_start(sd, b.unit, restart=self.started_new)
            run_gate(self.cfg, sd, b, on_event=self.log)
        except DeployError as exc:
            self.store.save(replace(self.st, operation=None, release=self.prev, active_backend=None))
            self.store.record("recover", ok=False, interrupted="install", step=self.op.step, release=self.rid,
                              outcome="rollback-failed", reason=exc.message.splitlines()[0])
            raise RollbackFailed(f"undid the interrupted install of {self.rid}, but {b.name} of release {self.prev} "
                                 f"did not come back: {exc.message}", hint=f"see `journalctl -u {b.unit}` and "
                                 "`deploytool status`") from None

    def undone(self) -> None:
        prev = self.prev
        self.store.save(replace(self.st, operation=None, release=prev,
                                active_backend=self.op.from_backend if prev else None))
        self.store.record("recover", ok=True, interrupted="install", step=self.op.step, release=self.rid,
                          outcome="undone")
        self.log(f"undid the interrupted install of {self.rid}" + (f"; release {prev} is back" if prev else
                                                                  "; the box holds no release"))


def _remove_units(cfg: Config, sd: systemd_mod.Systemd, release: Path | None) -> None:
    """A fresh box: leave no half-installed units, env files, pins or `current`."""
    names = {f"{n}.env" for n in cfg.backends}
    units = {cfg.backends[n].unit for n in cfg.backends}
    if release is not None and release.is_dir():
        names |= {f.name for f in (release / "env").iterdir()} if (release / "env").is_dir() else set()
        units |= {f.name for f in (release / "units").iterdir()} if (release / "units").is_dir() else set()
    if cfg.serve.api_key_file:
        names |= {API_KEY_FILE, LEGACY_SECRETS_ENV}
    for unit in sorted(units):
        with contextlib.suppress(DeployError):
            sd.stop(unit)
        if sd.unit_path(unit).exists():
            with contextlib.suppress(DeployError):
                sd.disable(unit)
        sd.remove_file(unit)
    for name in sorted(names):
        (Path(cfg.paths.env_dir) / name).unlink(missing_ok=True)
    for name in sorted(cfg.backends):
        (Path(cfg.paths.state_dir) / "pins" / f"{name}.json").unlink(missing_ok=True)
    cur = Path(cfg.paths.current)
    if cur.is_symlink():
        cur.unlink()
