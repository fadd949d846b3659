"""What the box is running and what happened: state.json (atomic), history.jsonl (append-only), the lock.

state.json holds the active backend, the release, and the operation in progress (intent recorded before
acting, its step journaled as it goes), so that a crash or kill at any step leaves something the next run can
detect and finish. Each journaled step is also a fault point (deploy_tool.faults) for the crash tests.
An operation's plan is a list of `Step`s: what `--dry-run` shows is what the operation runs.
"""

from __future__ import annotations

import contextlib
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
from deploy_tool.clock import iso_utc
from deploy_tool.errors import LockedError, StateError
from deploy_tool.fsutil import atomic_write, os_error

STATE_FORMAT = 1


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
    # an install that found releases/<release> laid down already (an earlier install of it, kept): undoing it keeps
    # that directory, which it did not make
    release_kept: bool = False


@dataclass(frozen=True)
class Step:
    """One step of an operation's plan, built before acting: `--dry-run` prints it, the operation runs it.

    `run` is what the step does, bound to the operation's run object when the plan is built for running (a plan
    built for --dry-run has none); it is not part of the step's data (text, JSON, equality)."""

    name: str  # what the operation calls it (where it journals steps: state.json's operation.step, a fault point)
    does: str  # what it does, in words
    touches: tuple[str, ...] = ()  # the units and paths it changes
    when: str = ""  # empty: always, in order; else the condition it runs under ("on failure")
    run: Callable[[], Any] | None = field(default=None, compare=False, repr=False)

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


#: The lock file in the state dir (uninstall keeps it: the lock is held on it until the uninstall exits).
LOCK_FILE = "lock"


class Store:
    """state.json, history.jsonl and the lock, all under the config's state_dir."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.state_path = self.dir / "state.json"
        self.history_path = self.dir / "history.jsonl"
        self.lock_path = self.dir / LOCK_FILE

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
        st = replace(st, updated=iso_utc(micro=True))
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
        entry = {"time": iso_utc(micro=True), "event": event, **fields}
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

        The lock is a flock on the file `lock`. Once it holds the flock, the holder writes its record (JSON:
        operation, pid, since) into that file, and empties it again when it lets go. The record is for messages
        only: the flock is the lock (a killed holder releases it with its process)."""
        self.ensure()
        deadline = time.monotonic() + wait
        while True:
            fd = self._open(self.lock_path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise os_error(exc, f"cannot lock {self.lock_path}") from None
                if time.monotonic() >= deadline:
                    raise self._locked_error(what) from None
                time.sleep(0.05)
        try:
            rec = json.dumps({"operation": what, "pid": os.getpid(), "since": iso_utc(micro=True)}, sort_keys=True) + "\n"
            with contextlib.suppress(OSError):  # without a record, a refused caller names no holder
                os.ftruncate(fd, 0)
                os.pwrite(fd, rec.encode(), 0)
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing releases the flock

    def _open(self, path: Path, flags: int) -> int:
        try:
            return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise os_error(exc, f"cannot open lock {path}") from None

    def refuse_if_held(self, what: str) -> None:
        """LockedError (exit 12) naming the holder when another process holds the lock now: a dry run's preview
        of the refusal its run would meet (with --wait, the run would wait for it instead)."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return  # no lock file: nobody holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise self._locked_error(what) from None
        finally:
            os.close(fd)

    def holder(self) -> dict[str, Any] | None:
        """The record of the process holding the lock ({"operation", "pid", "since"}), None when it is free (or
        was taken a moment ago and has no record yet).

        A record left by a holder that was killed is told from a live one by the flock itself: only when a
        record is there, a shared flock is tried, which the holder's exclusive one refuses."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            rec = _parse_record(os.pread(fd, 4096, 0))
            if not rec:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return rec  # held
            return None  # free: the record is a killed holder's
        finally:
            os.close(fd)

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


def _parse_record(raw: bytes) -> dict[str, Any]:
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(d, dict) or not isinstance(d.get("pid"), int) or isinstance(d.get("pid"), bool):
        return {}
    return {"operation": str(d.get("operation") or "") or None, "pid": d["pid"],
            "since": str(d["since"]) if d.get("since") else None}
