"""What the box is running and what happened: state.json (atomic), history.jsonl (append-only), the lock.

state.json holds the active backend, the release, and the operation in progress (intent recorded before
acting, its step journaled as it goes), so that a crash or kill at any step leaves something the next run can
detect and finish. Each journaled step is also a fault point (deploy_tool.faults) for the crash tests.
An operation's plan is a list of `Step`s: what `--dry-run` shows is what the operation runs.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from deploy_tool import faults
from deploy_tool.errors import LockedError, StateError
from deploy_tool.fsutil import atomic_write, os_error

STATE_FORMAT = 1


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Operation:
    """An operation in progress: written before acting, updated at each step, cleared on commit."""

    kind: str  # "install" | "switch" | "rollback" | "recover" | "failover"
    op_id: str
    started: str
    step: str
    from_backend: str | None = None
    to_backend: str | None = None
    release: str | None = None
    previous_release: str | None = None
    pid: int = 0


@dataclass(frozen=True)
class Step:
    """One step of an operation's plan, built before acting: `--dry-run` prints it, the operation runs it."""

    name: str  # what the operation calls it (where it journals steps: state.json's operation.step, a fault point)
    does: str  # what it does, in words
    touches: tuple[str, ...] = ()  # the units and paths it changes
    when: str = ""  # empty: always, in order; else the condition it runs under ("on failure")

    def text(self) -> str:
        return f"{self.when}: {self.does}" if self.when else self.does

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "does": self.does, "touches": list(self.touches), "when": self.when or None}


@dataclass(frozen=True)
class State:
    format: int = STATE_FORMAT
    active_backend: str | None = None
    previous_backend: str | None = None
    release: str | None = None
    previous_release: str | None = None
    operation: Operation | None = None
    updated: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return d


def _from_json(d: Any, path: Path) -> State:
    if not isinstance(d, dict) or d.get("format") != STATE_FORMAT:
        raise StateError(f"{path}: not a deploytool state file of format {STATE_FORMAT}",
                         hint="move it aside and run `deploytool install` again")
    try:
        op = d.get("operation")
        return State(format=STATE_FORMAT, active_backend=d.get("active_backend"),
                     previous_backend=d.get("previous_backend"), release=d.get("release"),
                     previous_release=d.get("previous_release"),
                     operation=Operation(**op) if op else None, updated=d.get("updated"),
                     extra=dict(d.get("extra") or {}))
    except TypeError as exc:
        raise StateError(f"{path}: malformed state ({exc})", hint="move it aside and run `deploytool install` again") from None


class Store:
    """state.json, history.jsonl and the lock, all under the config's state_dir."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.state_path = self.dir / "state.json"
        self.history_path = self.dir / "history.jsonl"
        self.lock_path = self.dir / "lock"

    def ensure(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        except OSError as exc:
            raise os_error(exc, f"cannot create state dir {self.dir}") from None

    def load(self) -> State:
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return State()
        except OSError as exc:
            raise os_error(exc, f"cannot read {self.state_path}") from None
        try:
            d = json.loads(raw)
        except ValueError:
            raise StateError(f"{self.state_path}: not valid JSON (a torn write cannot happen: was it edited?)",
                             hint="move it aside and run `deploytool install` again") from None
        return _from_json(d, self.state_path)

    def save(self, st: State) -> State:
        self.ensure()
        st = replace(st, updated=now_iso())
        atomic_write(self.state_path, (json.dumps(st.to_json(), indent=2, sort_keys=True) + "\n").encode(), 0o644)
        return st

    def begin(self, st: State, op: Operation) -> State:
        """Journal the intent of `op` (its first step) before acting."""
        st = self.save(replace(st, operation=op))
        faults.fault(op.step)
        return st

    def advance(self, st: State, step: str) -> State:
        """Journal that the operation in progress reached `step`."""
        assert st.operation is not None
        st = self.save(replace(st, operation=replace(st.operation, step=step)))
        faults.fault(step)
        return st

    def lock_steps(self, st: State) -> list[Step]:
        """The first steps of every operation's plan: the lock, and finishing an interrupted operation."""
        steps = [Step("lock", f"lock {self.lock_path}", (str(self.lock_path),))]
        if st.operation is not None:
            steps.append(Step("finish-interrupted", f"finish the interrupted {st.operation.kind} (step "
                              f"{st.operation.step}) first, as `deploytool recover` does"))
        return steps

    @contextlib.contextmanager
    def locked(self, *, what: str, wait: float, finish: Callable[[State], object],
               log: Callable[[str], None]) -> Iterator[State]:
        """Hold the lock for `what` (see `lock`); an operation found interrupted is finished first by `finish`
        (under the lock). Yields the state to act on."""
        with self.lock(wait=wait, what=what):
            st = self.load()
            if st.operation is not None:
                log(f"an interrupted {st.operation.kind} (step {st.operation.step}) was found; finishing it first")
                finish(st)
                st = self.load()
            yield st

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event line to history.jsonl (O_APPEND, one write, fsync)."""
        self.ensure()
        entry = {"time": now_iso(), "event": event, **fields}
        line = (json.dumps(entry, sort_keys=True, default=str) + "\n").encode()
        try:
            fd = os.open(self.history_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise os_error(exc, f"cannot append to {self.history_path}") from None
        return entry

    def history(self, limit: int | None = None) -> list[dict[str, Any]]:
        try:
            lines = self.history_path.read_text("utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise os_error(exc, f"cannot read {self.history_path}") from None
        out = []
        for ln in lines:
            with contextlib.suppress(ValueError):
                d = json.loads(ln)
                if isinstance(d, dict):
                    out.append(d)
        return out[-limit:] if limit else out

    @contextlib.contextmanager
    def lock(self, *, wait: float = 0.0, what: str = "operation") -> Iterator[None]:
        """Hold the exclusive lock for the operation `what`; wait up to `wait` seconds, else fail (exit 12)
        naming the holder's operation and pid.

        The lock is a flock on the file `lock`, whose content is the holder's record (JSON: operation, pid,
        since). The record is written atomically: the holder writes a new file, locks it, and renames it over
        the lock file while still holding the old one, so a reader only ever sees a complete record, and a
        process that locked the replaced file notices (its inode is no longer the lock file's) and tries again.
        (Only the very first lock on a box creates an empty file, replaced by its holder's record at once.)
        """
        self.ensure()
        deadline = time.monotonic() + wait
        while True:
            fd = self._open(self.lock_path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise os_error(exc, f"cannot lock {self.lock_path}") from None
                if time.monotonic() >= deadline:
                    raise self._locked_error(what) from None
                time.sleep(0.05)
                continue
            if _same_file(fd, self.lock_path):
                break
            os.close(fd)  # we locked a file the previous holder had already replaced: take the new one
        try:
            fd = self._replace_record(fd, what)
            yield
        finally:
            os.close(fd)  # closing releases the flock; a killed holder releases it too

    def _open(self, path: Path, flags: int) -> int:
        try:
            return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise os_error(exc, f"cannot open lock {path}") from None

    def _replace_record(self, old_fd: int, what: str) -> int:
        """Put a lock file holding this process's record in place of the one `old_fd` locks; return its fd
        (locked). On any failure the old lock is kept (the record is only for messages)."""
        rec = json.dumps({"operation": what, "pid": os.getpid(), "since": now_iso()}, sort_keys=True) + "\n"
        tmp = self.dir / ".lock.new"  # only the lock holder writes it
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError:
            return old_fd
        try:
            os.write(fd, rec.encode())
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else can have it open yet
            os.rename(tmp, self.lock_path)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return old_fd
        os.close(old_fd)
        return fd

    def holder(self) -> dict[str, Any] | None:
        """The record of the process holding the lock ({"operation", "pid", "since"}), None when it is free.

        The pid is the kernel's (/proc/locks); the operation comes from the record, used only when its pid is
        that holder's (a new holder replaces the record right after taking the lock: wait a moment for it).
        """
        rec: dict[str, Any] = {}
        pids: list[int] = []
        for _ in range(100):
            try:
                fd = os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                return None
            try:
                st = os.fstat(fd)
                raw = os.pread(fd, 4096, 0)
            finally:
                os.close(fd)
            rec = _parse_record(raw)
            found = _flock_holders(st)
            if found is None or 0 in found:  # no /proc/locks, or a holder outside our pid namespace
                return rec or None
            pids = found
            if not pids:
                return None
            if rec.get("pid") in pids:
                return rec
            time.sleep(0.005)
        return {"operation": None, "pid": pids[0], "since": None}

    def _locked_error(self, what: str) -> LockedError:
        h = self.holder()
        if h is None:  # released between our try and this look: say so rather than guess
            who = "another deploytool"
        else:
            parts = [str(h["operation"]) if h.get("operation") else "operation unknown", f"pid {h['pid']}"]
            if h.get("since"):
                parts.append(f"since {h['since']}")
            who = f"another deploytool ({', '.join(parts)})"
        return LockedError(f"cannot {what}: {who} holds the lock {self.lock_path}",
                           hint="wait for it to finish, or pass --wait SECONDS", details={"holder": h})


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _parse_record(raw: bytes) -> dict[str, Any]:
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(d, dict) or not isinstance(d.get("pid"), int) or isinstance(d.get("pid"), bool):
        return {}
    return {"operation": str(d.get("operation") or "") or None, "pid": d["pid"],
            "since": str(d["since"]) if d.get("since") else None}


def _flock_holders(st: os.stat_result) -> list[int] | None:
    """PIDs holding a flock on the file `st` describes, from /proc/locks (`1: FLOCK ADVISORY WRITE 4242
    fe:00:2146450 0 EOF`; blocked waiters are `1: -> FLOCK ...`); None when /proc/locks cannot be read."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key:
                    with contextlib.suppress(ValueError):
                        out.append(int(parts[4]))
    except OSError:
        return None
    return out
