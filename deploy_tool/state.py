"""What the box is running and what happened: state.json (atomic), history.jsonl (append-only), the lock.

state.json holds the active backend, the release, and the operation in progress (intent recorded before
acting), so that a crash or kill at any step leaves something the next run can detect and finish.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from deploy_tool.errors import LockedError, StateError
from deploy_tool.fsutil import atomic_write, os_error

STATE_FORMAT = 1


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Operation:
    """An operation in progress: written before acting, updated at each step, cleared on commit."""

    kind: str  # "install" | "switch" | "rollback" | "recover"
    op_id: str
    started: str
    step: str
    from_backend: str | None = None
    to_backend: str | None = None
    release: str | None = None
    previous_release: str | None = None
    pid: int = 0


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
        """Hold the exclusive lock; wait up to `wait` seconds, else fail fast naming the holder."""
        self.ensure()
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise os_error(exc, f"cannot open lock {self.lock_path}") from None
        try:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
                        raise LockedError(f"another deploytool {what} is running ({holder})",
                                          hint="wait for it to finish, or pass --wait SECONDS") from None
                    time.sleep(0.1)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}, {what} since {now_iso()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing releases the flock; a killed holder releases it too
