"""Releases over time: which are on the box, keeping the newest N, removing one, and uninstalling the box.

Every install lays down `releases/<id>` (the cpu-demo release is 1.5 GB, the real ftllm one several times that)
and nothing else ever removed one, so a box's disk filled release by release. Now:

  * `deploytool releases` lists each: id, bundle name and sequence (its MANIFEST), size on disk and what removing
    it frees (a venv part it shares with another release stays: deploy_tool.box.venvreuse), when it was
    installed and last active (history), and its roles: `current` (what `current` points at), `previous` (the
    release the state names as the one before), `last-good` (the release of the last health gate that passed).
  * `supervision.keep_releases` (3): a committed install, and a committed switch, prune the releases beyond the
    newest N, never one with a role (a release whose role protects it does not count against N either).
    `releases prune [--keep N]` does the same on demand; `releases remove ID` removes one, refusing one with a
    role, naming it.
  * `deploytool uninstall` stops and disables the units, removes the unit files deploytool wrote, the env files,
    the API key's copy, every release and `current`, the metrics file and the state dir (pins, history), keeping
    the config, the trusted keys and the sequence record (the replay guard, deploy_tool.box.sequence: a later
    install still refuses an older bundle) unless `--purge` (drop-ins under `UNIT.d/` are the operator's: kept,
    and listed).

Crash safety. A release is removed by renaming it to `releases/.removing-<id>` (one atomic rename: from then on
it is no release) and then deleting that; a kill in between leaves a `.removing-*` that the next prune, list or
uninstall deletes. Uninstall is journaled like the other operations (state.json's operation `uninstall`, the step
it reached): a kill at any step leaves an operation `status` reports and that `deploytool recover` (or a second
`uninstall`) finishes, every step being one that can run again. The state dir goes last, itself by rename.
Everything runs under the operation lock.

Going back to a removed release is a downgrade again (deploy_tool.box.sequence: a release laid down on the box is
not one; a removed one is retired).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deploy_tool import faults
from deploy_tool.box import metrics, sequence
from deploy_tool.box import systemd as systemd_mod
from deploy_tool.box.state import LOCK_FILE, Operation, State, Store
from deploy_tool.clock import iso_utc
from deploy_tool.config import Config
from deploy_tool.errors import InputError, StateError
from deploy_tool.fsutil import os_error
from deploy_tool.manifest import Manifest
from deploy_tool.render import API_KEY_FILE, FAILOVER_TEMPLATE, FRONT_UNITS, LEGACY_SECRETS_ENV, LIVENESS_UNIT

Log = Callable[[str], None]
REMOVING = ".removing-"
ROLES = ("current", "previous", "last-good")


@dataclass
class Release:
    id: str
    path: str
    bundle_name: str | None = None
    sequence: int | None = None
    bytes: int = 0
    frees: int = 0  # what removing it frees: its files that no other release shares
    installed: str | None = None  # the latest install of it that history records
    last_active: str | None = None  # the last event that had it serving
    roles: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def disk_usage(*paths: Path) -> tuple[int, int]:
    """(what the trees take on disk, what removing them would free): allocated blocks, a file with several names
    counted once; what they free leaves out every file that also has a name outside them (a release installed
    after this one links the venv parts they share: deploy_tool.box.venvreuse). Symlinks are not followed."""
    seen: dict[tuple[int, int], list[int]] = {}  # (dev, ino) -> [names seen, st_nlink, bytes]
    for path in paths:
        names = [str(path)]
        for top, dirs, files in os.walk(path):
            names.extend(os.path.join(top, n) for n in (*dirs, *files))
        for name in names:
            try:
                st = os.lstat(name)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                seen[key][0] += 1
            else:  # a directory's st_nlink counts its subdirectories' "..": its only name is its own
                seen[key] = [1, 1 if stat.S_ISDIR(st.st_mode) else st.st_nlink, st.st_blocks * 512]
    total = sum(size for _, _, size in seen.values())
    return total, sum(size for names, nlink, size in seen.values() if names >= nlink)


def _manifest(path: Path) -> Manifest | None:
    try:
        return Manifest.from_bytes((path / "MANIFEST").read_bytes())
    except Exception:  # a damaged or half-written release: listed, named by its id only
        return None


def _current_id(cfg: Config) -> str | None:
    cur = Path(cfg.paths.current)
    if not cur.is_symlink():
        return None
    return Path(os.readlink(cur)).name


def last_good(events: list[dict[str, Any]]) -> str | None:
    """The release of the last history event whose health gate passed."""
    for e in reversed(events):
        if metrics.gate_result(e) is True and e.get("release"):
            return str(e["release"])
    return None


def roles(cfg: Config, st: State, events: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Release id -> its roles (current, previous, last-good): the releases no prune removes."""
    out: dict[str, list[str]] = {}
    for role, rid in (("current", _current_id(cfg) or st.release), ("previous", st.previous_release),
                      ("last-good", last_good(events))):
        if rid:
            out.setdefault(rid, []).append(role)
    return out


def _sweep(cfg: Config) -> list[str]:
    """Delete what a killed removal left (`.removing-*`); their names."""
    rd = Path(cfg.paths.releases_dir)
    left = sorted(p for p in rd.glob(REMOVING + "*")) if rd.is_dir() else []
    for p in left:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in left]


def releases(cfg: Config, st: State | None = None, events: list[dict[str, Any]] | None = None,
             *, sizes: bool = True) -> list[Release]:
    """Every release laid down on the box, oldest install first."""
    store = Store(cfg.paths.state_dir)
    st = st if st is not None else store.load()
    events = events if events is not None else store.history()
    rd = Path(cfg.paths.releases_dir)
    if not rd.is_dir():
        return []
    role = roles(cfg, st, events)
    out = []
    for p in sorted(rd.iterdir()):
        if p.name.startswith(".") or not p.is_dir() or p.is_symlink():
            continue  # staging, verify copies, what a removal left
        m = _manifest(p)
        inputs = m.inputs if m is not None else {}
        seq = inputs.get("sequence")
        size, frees = disk_usage(p) if sizes else (0, 0)
        r = Release(id=p.name, path=str(p), bundle_name=inputs.get("bundle_name"),
                    sequence=seq if isinstance(seq, int) else None, bytes=size, frees=frees,
                    roles=role.get(p.name, []))
        for e in events:
            if e.get("release") != p.name or e.get("ok") is not True:
                continue
            if e.get("event") == "install":  # the latest: a release removed and laid down again is that new
                r.installed = e.get("time")
            if metrics.gate_result(e) is True or e.get("event") == "install":
                r.last_active = e.get("time")
        if r.installed is None:  # history lost or older than the release: when it was laid down
            with contextlib.suppress(OSError):
                r.installed = iso_utc(p.stat().st_mtime, micro=True)
        out.append(r)
    return sorted(out, key=lambda r: (r.installed or "", r.id))


def prune_plan(rels: list[Release], keep: int) -> list[Release]:
    """The releases a prune removes: beyond the newest `keep` (by install time) and with no role."""
    unprotected = [r for r in rels if not r.roles]
    room = max(0, keep - (len(rels) - len(unprotected)))
    return unprotected[:max(0, len(unprotected) - room)]


def _remove(cfg: Config, rid: str) -> None:
    rd = Path(cfg.paths.releases_dir)
    gone = rd / f"{REMOVING}{rid}"
    try:
        os.rename(rd / rid, gone)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise os_error(exc, f"cannot remove release {rid}") from None
    faults.fault("release-renamed")
    shutil.rmtree(gone, ignore_errors=True)


@dataclass
class PruneResult:
    removed: list[Release]
    kept: list[Release]
    swept: list[str]
    dry_run: bool = False

    freed: int = 0  # what removing them freed (or would): their files no kept release shares

    def to_json(self) -> dict[str, Any]:
        return {"removed": [r.to_json() for r in self.removed], "kept": [r.to_json() for r in self.kept],
                "swept": self.swept, "freed_bytes": self.freed, "dry_run": self.dry_run}


def _prune_locked(cfg: Config, store: Store, keep: int, *, dry_run: bool, log: Log, why: str,
                  sizes: bool = True) -> PruneResult:
    """`sizes`: measure every release (what `releases prune` shows); without it only the removed ones are (after
    a switch nobody sees the others, and walking every release costs 0.1 s per GB-sized tree)."""
    swept = [] if dry_run else _sweep(cfg)
    st = store.load()
    rels = releases(cfg, st, store.history(), sizes=sizes)
    gone = prune_plan(rels, keep)
    if not sizes:
        for r in gone:
            r.bytes, r.frees = disk_usage(Path(r.path))
    # what they free together (a file several of them share and no kept one is freed too); one release: its own
    freed = gone[0].frees if len(gone) == 1 else disk_usage(*(Path(r.path) for r in gone))[1]
    kept = [r for r in rels if r not in gone]
    if not dry_run:
        for r in gone:
            log(f"removing release {r.id} ({_human(r.bytes)}, installed {r.installed or '?'})")
            _remove(cfg, r.id)
        if gone or swept:
            store.record("prune", ok=True, removed=[r.id for r in gone], freed_bytes=freed, keep=keep, reason=why)
    return PruneResult(gone, kept, swept, dry_run, freed)


def prune(cfg: Config, *, keep: int | None = None, dry_run: bool = False, wait: float = 0.0,
          log: Log = lambda s: None) -> PruneResult:
    """`deploytool releases prune`: keep the newest `keep` (supervision.keep_releases) and every one with a role."""
    keep = cfg.supervision.keep_releases if keep is None else keep
    if keep < 1:
        raise InputError(f"--keep {keep}: at least 1 release is kept (the current one)", hint="pass --keep 1 or more")
    store = Store(cfg.paths.state_dir)
    if dry_run:
        return _prune_locked(cfg, store, keep, dry_run=True, log=log, why="")
    with store.lock(wait=wait, what="releases prune"):
        _refuse_pending(store.load(), "prune releases")
        return _prune_locked(cfg, store, keep, dry_run=False, log=log, why="releases prune")


def auto_prune(cfg: Config, store: Store, log: Log) -> PruneResult | None:
    """After a committed install or switch, under its lock: what supervision.keep_releases asks. Never fails the
    operation it follows (a removal that cannot be done is said in the log)."""
    try:
        return _prune_locked(cfg, store, cfg.supervision.keep_releases, dry_run=False, log=log,
                             why=f"keep {cfg.supervision.keep_releases} (supervision.keep_releases)", sizes=False)
    except Exception as exc:  # noqa: BLE001  the operation is committed; a prune is housekeeping
        log(f"warning: pruning old releases failed: {exc}")
        return None


def remove(cfg: Config, rid: str, *, dry_run: bool = False, wait: float = 0.0,
           log: Log = lambda s: None) -> Release:
    """`deploytool releases remove ID`: one release, never one the box still needs (its roles named)."""
    store = Store(cfg.paths.state_dir)

    def pick() -> Release:
        rels = releases(cfg, store.load(), store.history())
        found = [r for r in rels if r.id == rid]
        if not found:
            have = ", ".join(r.id for r in rels) or "none"
            raise InputError(f"no release {rid!r} on this box (releases: {have})",
                             hint="`deploytool releases` lists them")
        r = found[0]
        if r.roles:
            raise StateError(f"release {rid} is the box's {' and '.join(r.roles)} release; it is kept",
                             hint="install another release first (a switch changes the backend, not the release); "
                                  "`deploytool releases` shows the roles")
        return r

    if dry_run:
        return pick()
    with store.lock(wait=wait, what=f"releases remove {rid}"):
        _refuse_pending(store.load(), f"remove release {rid}")
        r = pick()
        _remove(cfg, r.id)
        store.record("prune", ok=True, removed=[r.id], freed_bytes=r.frees, reason="releases remove")
        log(f"removed release {r.id} ({_human(r.bytes)})")
        return r


def _refuse_pending(st: State, what: str) -> None:
    if st.operation is not None:
        raise StateError(f"cannot {what}: an interrupted {st.operation.kind} (step {st.operation.step}) is pending; "
                         "`deploytool recover` finishes it first", hint="run `deploytool recover`, then again")


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


# ------------------------------------------------------------------------------------------------ uninstall

UNINSTALL_STEPS = ("units-stopped", "units-removed", "env-removed", "releases-removed", "state-removed")


def units(cfg: Config) -> list[str]:
    """The unit files deploytool writes for this config, in the order they are stopped: the front's socket first
    (no connection starts its service again), then its service, then the rest."""
    return [*FRONT_UNITS, *sorted({b.unit for b in cfg.backends.values()} | {LIVENESS_UNIT, FAILOVER_TEMPLATE})]


def uninstall_plan(cfg: Config, *, purge: bool) -> list[dict[str, Any]]:
    p = cfg.paths
    steps = [
        {"name": "units-stopped", "what": f"stop and disable {', '.join(units(cfg))}"},
        {"name": "units-removed", "what": f"remove those unit files from {p.unit_dir} (drop-ins under UNIT.d/ are "
                                          "kept), daemon-reload"},
        {"name": "env-removed", "what": f"remove the env files and the API key's copy from {p.env_dir}"},
        {"name": "releases-removed", "what": f"remove {p.current} and every release in {p.releases_dir}"
                                             + (f", and {p.metrics_file}" if p.metrics_file else "")},
        {"name": "state-removed", "what": f"remove {p.state_dir} (state, pins, history) last, but its "
                                          f"{sequence.RECORD_NAME} (the replay guard)"},
    ]
    if purge:
        steps.append(_purge_step(cfg))
    return steps


def _purge_step(cfg: Config) -> dict[str, Any]:
    p = cfg.paths
    return {"name": "purged", "what": f"remove the config {p.config}, the trusted keys in {p.keys_dir} and "
                                      f"{p.state_dir} with its {sequence.RECORD_NAME}"}


def _nothing_installed(cfg: Config) -> bool:
    """No release, and a state dir that is absent or holds the sequence record alone (what uninstall keeps)."""
    sdir = Path(cfg.paths.state_dir)
    left = {e.name for e in os.scandir(sdir)} if sdir.is_dir() else set()
    return not Path(cfg.paths.releases_dir).exists() and left <= {sequence.RECORD_NAME, LOCK_FILE}


@dataclass
class UninstallResult:
    ok: bool
    steps: list[dict[str, Any]]
    kept: list[str]
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def uninstall(cfg: Config, *, purge: bool = False, dry_run: bool = False, wait: float = 0.0,
              sd: systemd_mod.Systemd | None = None, log: Log = lambda s: None) -> UninstallResult:
    """`deploytool uninstall`: the box as before the first install, but its config and keys (all with --purge)."""
    if dry_run:
        return UninstallResult(True, uninstall_plan(cfg, purge=purge), _kept(cfg, purge), dry_run=True)
    from deploy_tool.box import journal

    with journal.operation(cfg, "uninstall", "uninstall" + (" --purge" if purge else "")) as ev:
        res = _uninstall(cfg, purge=purge, wait=wait, sd=sd, log=ev.tee(log))
        ev.result(True, "uninstalled" if res.steps else "nothing installed, nothing to do")
        return res


def _uninstall(cfg: Config, *, purge: bool, wait: float, sd: systemd_mod.Systemd | None,
               log: Log) -> UninstallResult:
    if _nothing_installed(cfg):  # nothing installed: nothing to do (systemd is not asked), but what --purge asks
        if purge:
            _purge(cfg, log)
            return UninstallResult(True, [_purge_step(cfg)], [])
        return UninstallResult(True, [], _kept(cfg, purge))
    sd = sd or systemd_mod.for_config(cfg)
    store = Store(cfg.paths.state_dir)
    store.ensure()
    with store.lock(wait=wait, what="uninstall"):
        st = store.load()
        if st.operation is not None and st.operation.kind != "uninstall":
            _refuse_pending(st, "uninstall")
        if st.operation is None:
            st = store.begin(st, Operation(kind="uninstall", op_id=uuid.uuid4().hex[:12], started=iso_utc(micro=True),
                                           step="units-stopped", from_backend=st.active_backend, to_backend=None,
                                           release=st.release, previous_release=st.previous_release,
                                           pid=os.getpid()))
        _uninstall_steps(cfg, sd, store, st, log)
    if purge:
        _purge(cfg, log)
    return UninstallResult(True, uninstall_plan(cfg, purge=purge), _kept(cfg, purge))


def finish_uninstall(cfg: Config, st: State, *, sd: systemd_mod.Systemd, log: Log) -> None:
    """recover's way to finish an interrupted uninstall (the caller holds the lock)."""
    _uninstall_steps(cfg, sd, Store(cfg.paths.state_dir), st, log)


def _uninstall_steps(cfg: Config, sd: systemd_mod.Systemd, store: Store, st: State, log: Log) -> None:
    steps = ((s, fn) for s, fn in zip(UNINSTALL_STEPS, (_units_stopped, _units_removed, _env_removed,
                                                          _releases_removed, _state_removed), strict=True))
    start = UNINSTALL_STEPS.index(st.operation.step) if st.operation and st.operation.step in UNINSTALL_STEPS else 0
    for i, (step, run) in enumerate(steps):
        if i < start:
            continue
        if step == "state-removed":  # the journal lives in the state dir: it cannot outlast it
            faults.fault(step)
        else:
            st = store.advance(st, step)  # journals the step (and is its kill point)
        log(f"uninstall: {step}")
        run(cfg, sd, log)


def _units_stopped(cfg: Config, sd: systemd_mod.Systemd, log: Log) -> None:
    for u in (u for u in units(cfg) if "@" not in u):  # the failover template has no instance of its own
        with contextlib.suppress(Exception):  # one that is gone already (a step run again) is fine
            sd.stop(u)
        if sd.unit_path(u).exists():
            with contextlib.suppress(Exception):
                sd.disable(u)


def _units_removed(cfg: Config, sd: systemd_mod.Systemd, log: Log) -> None:
    for u in units(cfg):
        sd.remove_file(u)
        d = Path(cfg.paths.unit_dir) / f"{u}.d"
        if d.is_dir():
            log(f"uninstall: kept the operator's drop-ins in {d}")
    with contextlib.suppress(Exception):
        sd.daemon_reload()
    with contextlib.suppress(Exception):
        sd.reset_failed()


def _env_removed(cfg: Config, sd: systemd_mod.Systemd, log: Log) -> None:
    env = Path(cfg.paths.env_dir)
    for name in [*(f"{n}.env" for n in cfg.backends), API_KEY_FILE, LEGACY_SECRETS_ENV]:
        (env / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        env.rmdir()  # only when empty: anything else in it is not ours


def _releases_removed(cfg: Config, sd: systemd_mod.Systemd, log: Log) -> None:
    cur = Path(cfg.paths.current)
    if cur.is_symlink():
        cur.unlink()
    rd = Path(cfg.paths.releases_dir)
    if rd.is_dir():
        for p in sorted(rd.iterdir()):
            if p.name.startswith(REMOVING):
                continue
            if p.is_dir() and not p.is_symlink():
                _remove(cfg, p.name) if not p.name.startswith(".") else shutil.rmtree(p, ignore_errors=True)
        _sweep(cfg)
        with contextlib.suppress(OSError):
            rd.rmdir()
    if cfg.paths.metrics_file:
        Path(cfg.paths.metrics_file).unlink(missing_ok=True)


def _state_removed(cfg: Config, sd: systemd_mod.Systemd, log: Log) -> None:
    sdir = Path(cfg.paths.state_dir)
    if not sdir.exists():
        return
    record = sdir / sequence.RECORD_NAME
    if record.exists():  # the replay guard outlives the install (--purge removes it); the rest goes, state.json last
        last = Store(cfg.paths.state_dir).state_path.name
        for p in sorted(sdir.iterdir(), key=lambda p: p.name == last):
            if p.name in (record.name, LOCK_FILE):  # the lock is held on it until this uninstall exits
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        log(f"uninstall: kept {record} (a later install still refuses an older bundle; --purge removes it) and "
            "the lock file")
        return
    gone = sdir.with_name(f"{REMOVING}{sdir.name}-{uuid.uuid4().hex[:8]}")
    os.rename(sdir, gone)  # the lock file goes with it: the lock held on its inode stays valid until we exit
    shutil.rmtree(gone, ignore_errors=True)


def _purge(cfg: Config, log: Log) -> None:
    Path(cfg.paths.config).unlink(missing_ok=True)
    for d in (Path(cfg.paths.keys_dir), Path(cfg.paths.state_dir)):
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
    log("uninstall: purged the config, the trusted keys and the sequence record")


def _kept(cfg: Config, purge: bool) -> list[str]:
    if purge:
        return []
    return [p for p in (cfg.paths.config, cfg.paths.keys_dir) if p]
