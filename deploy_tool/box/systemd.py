"""The systemctl/journalctl driver: every systemd operation deploytool performs goes through `Systemd`.

The `systemctl` and `journalctl` command prefixes and the unit directory are given by the caller (from the
config), so a rehearsal or a test points them at a sandbox (`Sandbox.systemctl_prefix()`, ...) and never at
the machine's own systemd. Unit files are installed atomically (temp file, fsync, rename) and `<unit>.d/`
drop-in directories, where the user's own edits live, are never touched.

The one wait here (a failed unit's journal tail settling) goes through deploy_tool.retry.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy_tool import proc, retry
from deploy_tool.errors import InputError, MissingTool, OSFailure, SystemdError
from deploy_tool.fsutil import atomic_write

UNIT_SUFFIXES = ("service", "socket", "target", "timer", "path", "mount", "automount", "swap", "slice", "scope",
                 "device")
_UNIT_RE = re.compile(r"[A-Za-z0-9:_.@-]+")
_REMOTE_FLAGS = ("-M", "--machine", "-H", "--host", "--root")
SANDBOX_HINT = ("rehearse in the sandbox: deploytool sandbox up DIR, then set systemd.sandbox: DIR in the config")
_SHOW_PROPS = ("Id", "LoadState", "ActiveState", "SubState", "Result", "ExecMainStatus", "ExecMainCode",
               "ExecMainPID", "MainPID", "ControlPID", "NRestarts", "InvocationID", "UnitFileState", "Job")


def host_systemd_available() -> bool:
    """True when this machine's PID 1 is systemd (what `systemctl` without a sandbox needs)."""
    try:
        comm = Path("/proc/1/comm").read_text().strip()
    except OSError:
        return False
    return comm == "systemd" and Path("/run/systemd/system").is_dir()


def validate_unit_name(name: str) -> str:
    """Return `name` if it is a plain unit name like `llamacpp.service`; raise InputError otherwise."""
    if not isinstance(name, str) or not name:
        raise InputError("empty unit name", hint="give a unit name such as llamacpp.service")
    bad = sorted({c for c in name if not _UNIT_RE.fullmatch(c)})
    if bad:
        raise InputError(f"unit name {name!r} contains characters systemd does not allow: "
                         + " ".join(repr(c) for c in bad),
                         hint="use only letters, digits and : _ . @ - (for example llamacpp-tensor.service)")
    if name.startswith(("-", ".")):
        raise InputError(f"unit name {name!r} must not start with {name[0]!r}")
    if len(name) > 255:
        raise InputError(f"unit name {name[:40]!r}... is longer than 255 characters")
    stem, dot, suffix = name.rpartition(".")
    if not dot or not stem or suffix not in UNIT_SUFFIXES:
        raise InputError(f"unit name {name!r} does not end in a unit type",
                         hint="end it in .service (or " + ", ".join("." + s for s in UNIT_SUFFIXES[1:]) + ")")
    if "@" in stem and stem.count("@") > 1:
        raise InputError(f"unit name {name!r} has more than one '@'")
    return name


@dataclass(frozen=True)
class UnitState:
    """The properties of a unit that deploytool acts on (from `systemctl show`)."""

    unit: str
    load_state: str  # loaded, not-found, masked, error, ...
    active_state: str  # active, inactive, failed, activating, deactivating, reloading
    sub_state: str  # running, exited, dead, failed, start-pre, auto-restart, ...
    result: str  # success, exit-code, signal, core-dump, timeout, start-limit-hit, ...
    exec_main_status: int  # exit code, or signal number when exec_main_code is 2 (killed) / 3 (dumped)
    exec_main_code: int  # 0 none, 1 exited, 2 killed, 3 dumped (CLD_* codes)
    exec_main_pid: int
    main_pid: int
    n_restarts: int
    invocation_id: str
    unit_file_state: str
    job: str = ""  # the id of the job queued or running for the unit (a start queued with --no-block), else ""
    control_pid: int = 0  # the process running the unit's ExecStartPre/ExecStartPost/ExecStop..., else 0

    @property
    def is_active(self) -> bool:
        return self.active_state == "active"

    @property
    def is_failed(self) -> bool:
        return self.active_state == "failed"

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def _int(v: str) -> int:
    try:
        return int(v)
    except ValueError:
        return 0


# a query (show, is-enabled, enable, journalctl ...) that takes longer is stuck: systemctl's own D-Bus call
# timeout is 25 s
QUERY_TIMEOUT_S = 60.0


class Systemd:
    """Drive one systemd manager through the given command prefixes; unit files live in `unit_dir`."""

    def __init__(self, systemctl: Sequence[str], journalctl: Sequence[str], unit_dir: str | os.PathLike[str], *,
                 timeout: float = 300.0) -> None:
        self.systemctl = [str(a) for a in systemctl]
        self.journalctl = [str(a) for a in journalctl]
        self.unit_dir = Path(unit_dir)
        self.timeout = timeout
        for what, prefix in (("systemctl", self.systemctl), ("journalctl", self.journalctl)):
            if not prefix:
                raise InputError(f"the {what} command is empty", hint=f"set the {what} command in the config")
            if shutil.which(prefix[0]) is None:
                raise MissingTool(f"{what} command not found: {prefix[0]}",
                                  hint=f"install it or fix the {what} command in the config; " + SANDBOX_HINT)
        if self._targets_host() and not host_systemd_available():
            raise SystemdError("PID 1 is not systemd; " + SANDBOX_HINT)

    def _targets_host(self) -> bool:
        return (os.path.basename(self.systemctl[0]) == "systemctl"
                and not any(a.split("=")[0] in _REMOTE_FLAGS for a in self.systemctl[1:]))

    def __repr__(self) -> str:
        return f"Systemd(systemctl={self.systemctl!r}, unit_dir={str(self.unit_dir)!r})"

    # ------------------------------------------------------------------ raw calls

    def _ctl(self, *args: str, ok: Sequence[int] = (0,), timeout: float | None = None) -> proc.Result:
        # Every call is bounded (queries by QUERY_TIMEOUT_S, job-waiting verbs by self.timeout). A bounded call runs
        # through deploy_tool.proc, the one runner of external programs
        try:
            return proc.run([*self.systemctl, "--no-pager", "--no-ask-password", *args], ok=ok,
                            timeout=timeout if timeout is not None else QUERY_TIMEOUT_S)
        except proc.CommandFailed as exc:
            raise SystemdError(f"systemctl {' '.join(args)} failed (exit {exc.result.returncode}): "
                               f"{(exc.result.stderr or exc.result.stdout).strip()[-500:]}") from exc

    def _jctl(self, *args: str, ok: Sequence[int] = (0,)) -> proc.Result:
        try:
            return proc.run([*self.journalctl, "--no-pager", *args], ok=ok, timeout=QUERY_TIMEOUT_S)
        except proc.CommandFailed as exc:
            raise SystemdError(f"journalctl {' '.join(args)} failed (exit {exc.result.returncode}): "
                               f"{(exc.result.stderr or exc.result.stdout).strip()[-500:]}") from exc

    # ------------------------------------------------------------------ manager

    def daemon_reload(self) -> None:
        self._ctl("daemon-reload")

    def reset_failed(self, unit: str | None = None) -> None:
        if unit is None:
            self._ctl("reset-failed")
        else:
            self._ctl("reset-failed", validate_unit_name(unit), ok=(0, 1, 5))  # not loaded / not failed: fine

    # ------------------------------------------------------------------ lifecycle

    def start(self, unit: str, *, no_block: bool = False, past_start_limit: bool = False) -> None:
        """Start `unit` and wait for the job (unless no_block); on failure raise SystemdError with the journal tail.

        past_start_limit: an operator's start (switch, rollback, install) is not a crash loop: when systemd
        refuses it with Result=start-limit-hit (StartLimitBurst= starts within StartLimitIntervalSec=, e.g. a
        unit started by hand and refused by its ExecStartPre a few times), reset the counter and start once
        more. Costs nothing on the normal path (no reset-failed round trip before every start).
        """
        self._job("start", unit, no_block, past_start_limit)

    def restart(self, unit: str, *, no_block: bool = False, past_start_limit: bool = False) -> None:
        self._job("restart", unit, no_block, past_start_limit)

    def stop(self, unit: str, *, no_block: bool = False) -> None:
        validate_unit_name(unit)
        res = self._ctl("stop", *(["--no-block"] if no_block else []), unit, ok=range(256), timeout=self.timeout)
        if res.returncode == 5 and "not loaded" in res.stderr:
            return  # nothing to stop
        if res.returncode != 0:
            raise SystemdError(f"stopping {unit} failed: {res.stderr.strip()[-500:]}",
                               details=self._tail_for(unit))

    def kill(self, unit: str, signal: str = "SIGTERM", *, who: str = "all") -> None:
        """Send `signal` to the unit's processes (`who`: main, control or all) without stopping it."""
        validate_unit_name(unit)
        if not re.fullmatch(r"(SIG)?[A-Z0-9+]+", signal) or who not in ("main", "control", "all"):
            raise InputError(f"bad signal {signal!r} or target {who!r}")
        self._ctl("kill", "--signal=" + signal, "--kill-who=" + who, unit)

    def _job(self, verb: str, unit: str, no_block: bool, past_start_limit: bool = False) -> None:
        validate_unit_name(unit)
        res = self._ctl(verb, *(["--no-block"] if no_block else []), unit, ok=range(256), timeout=self.timeout)
        if res.returncode == 0:
            return
        reason = res.stderr.strip().splitlines()[0] if res.stderr.strip() else f"exit {res.returncode}"
        st = None
        try:
            st = self.show(unit)
            state = f" (ActiveState={st.active_state}, Result={st.result}, ExecMainStatus={st.exec_main_status})"
        except SystemdError:
            state = ""
        if st is not None and st.result == "start-limit-hit":
            if past_start_limit:  # see start(): reset the counter, then once more
                self.reset_failed(unit)
                return self._job(verb, unit, no_block)
            tail = ""  # refused before anything ran: the latest invocation's lines are an older start's
        else:
            # the failed job's own invocation (a failed start gets a fresh InvocationID), not a cursor read
            # before every job: that costs a journalctl round trip on the success path too
            tail = self._tail_for(unit, invocation=(st.invocation_id or None) if st is not None else None)
        raise SystemdError(f"{verb} of {unit} failed{state}: {reason}"
                           + (("\n" + _indent(tail)) if tail else ""),
                           hint=f"see the full log: journalctl -u {unit}", details=tail)

    def _tail_for(self, unit: str, lines: int = 20, since_cursor: str | None = None,
                  invocation: str | None = None) -> str:
        """The unit's journal since `since_cursor`, else of `invocation` (default: its latest), read until it
        settles.

        journald reads a unit's stdout/stderr streams asynchronously (slowly on a busy machine), so right after
        a failed start the unit's own last words may still be in flight; `journalctl --sync` does not wait for
        streams on 252. A unit that printed nothing costs the full 2 s wait, on the failure path only.
        """
        with contextlib.suppress(SystemdError):
            self.sync_journal()
            inv = None if since_cursor else (invocation or self.show(unit).invocation_id or None)

            return _settled(lambda: self.journal(unit, since_cursor=since_cursor, invocation=inv, lines=lines))
        return ""

    def journal_settled(self, unit: str, *, invocation: str | None = None, lines: int = 30) -> str:
        """The journal tail of `unit`'s invocation (default: its latest) once journald has taken in the unit's own
        last lines (see _tail_for): for a start refused by a short-lived ExecStartPre."""
        return self._tail_for(unit, lines=lines, invocation=invocation)

    # ------------------------------------------------------------------ state

    def show(self, unit: str) -> UnitState:
        validate_unit_name(unit)
        res = self._ctl("show", "--property=" + ",".join(_SHOW_PROPS), unit)
        props: dict[str, str] = {}
        for line in res.stdout.splitlines():
            k, sep, v = line.partition("=")
            if sep:
                props[k] = v
        return UnitState(
            unit=unit, load_state=props.get("LoadState", ""), active_state=props.get("ActiveState", ""),
            sub_state=props.get("SubState", ""), result=props.get("Result", ""),
            exec_main_status=_int(props.get("ExecMainStatus", "0")),
            exec_main_code=_int(props.get("ExecMainCode", "0")),
            exec_main_pid=_int(props.get("ExecMainPID", "0")), main_pid=_int(props.get("MainPID", "0")),
            n_restarts=_int(props.get("NRestarts", "0")), invocation_id=props.get("InvocationID", ""),
            unit_file_state=props.get("UnitFileState", ""), job=props.get("Job", ""),
            control_pid=_int(props.get("ControlPID", "0")))

    def properties(self, unit: str, *names: str) -> dict[str, str]:
        """The named properties of `unit` as `systemctl show` prints them (one round trip), e.g. CPUUsageNSec."""
        validate_unit_name(unit)
        if not names or not all(re.fullmatch(r"[A-Za-z]+", n) for n in names):
            raise InputError(f"bad property names {names!r}")
        res = self._ctl("show", "--property=" + ",".join(names), unit)
        props = {}
        for line in res.stdout.splitlines():
            k, sep, v = line.partition("=")
            if sep:
                props[k] = v
        return props

    def is_active(self, unit: str) -> bool:
        # is-active: 0 active; 3 inactive/failed/activating; 4 no such unit
        return self._ctl("is-active", validate_unit_name(unit), ok=(0, 3, 4)).returncode == 0

    def is_failed(self, unit: str) -> bool:
        # is-failed: 0 failed; 1 anything else
        return self._ctl("is-failed", validate_unit_name(unit), ok=(0, 1)).returncode == 0

    # ------------------------------------------------------------------ install state

    def enable(self, unit: str, *, reload: bool = True) -> None:
        """Enable `unit`; reload=False skips the daemon-reload (the symlinks are on disk either way)."""
        self._ctl("enable", *(() if reload else ("--no-reload",)), validate_unit_name(unit))

    def disable(self, *units: str, reload: bool = True) -> None:
        self._ctl("disable", *(() if reload else ("--no-reload",)), *(validate_unit_name(u) for u in units))

    def is_enabled(self, unit: str) -> str:
        """enabled, disabled, static, masked, not-found, ... (`systemctl is-enabled` output)."""
        res = self._ctl("is-enabled", validate_unit_name(unit), ok=(0, 1, 4))
        out = res.stdout.strip().splitlines()
        if out:
            return out[0]
        return "not-found" if "No such file" in res.stderr or res.returncode == 4 else "unknown"

    # ------------------------------------------------------------------ unit files

    def unit_path(self, name: str) -> Path:
        return self.unit_dir / validate_unit_name(name)

    def install_file(self, name: str, content: bytes, mode: int = 0o644) -> Path:
        """Write unit file `name` into the unit dir atomically: temp file, fsync, rename, fsync the directory.

        Only the file itself is replaced; a `<name>.d/` drop-in directory next to it is never touched. Returns the
        path. Needs `daemon_reload()` afterwards for systemd to see the change.
        """
        path = self.unit_path(name)
        if path.is_dir() and not path.is_symlink():
            raise InputError(f"{path} is a directory; refusing to replace it with the unit file")
        if not isinstance(content, bytes):
            raise TypeError("content must be bytes")
        if not path.parent.is_dir():
            raise OSFailure(f"cannot install {path}: the unit directory {self.unit_dir} does not exist",
                            hint="check paths.unit_dir (or systemd.sandbox) in the config")
        atomic_write(path, content, mode)
        return path

    def remove_file(self, name: str) -> bool:
        """Remove unit file `name` (not its drop-in dir). True if something was removed."""
        path = self.unit_path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except IsADirectoryError as exc:
            raise InputError(f"{path} is a directory, not a unit file") from exc
        except OSError as exc:
            raise OSFailure(f"cannot remove {path}: {exc.strerror or exc}") from exc
        return True

    # ------------------------------------------------------------------ journal

    def sync_journal(self) -> None:
        """Ask journald to write out everything logged so far (so a just-failed unit's output is readable)."""
        self._jctl("--sync", ok=range(256))

    def journal_cursor(self) -> str:
        """The cursor of the newest journal entry (pass it to `journal(since_cursor=)` to read what follows)."""
        res = self._jctl("-n", "1", "-o", "json", "--output-fields=__CURSOR")
        lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
        if not lines:
            return ""
        try:
            return str(json.loads(lines[-1])["__CURSOR"])
        except (ValueError, KeyError) as exc:
            raise SystemdError(f"journalctl printed no cursor: {lines[-1][:200]}") from exc

    def journal(self, unit: str, since_cursor: str | None = None, invocation: str | None = None,
                lines: int = 50, since: float | None = None) -> str:
        """The last `lines` journal lines of `unit`: all of them, those after `since_cursor`, or one invocation's.

        `since` (epoch seconds, e.g. taken just before the start) bounds what journalctl reads: an invocation's
        lines are then found among the entries from that second on instead of the unit's last lines + 1000
        (a long-lived unit has many; reading and parsing them cost 0.1 s per call).

        Includes both the unit's own output and the manager's messages about it (why it failed).

        The cursor is applied here, not with `journalctl --after-cursor`: combined with `-u`, journalctl 252
        sometimes skips a matching entry that follows the cursor. An invocation's lines are found by position,
        not only by `_SYSTEMD_INVOCATION_ID`: journald 252 sometimes stores a short-lived ExecStartPre's output
        before the manager's "Starting ..." message, or without (or with a previous) invocation id. So the
        window runs from just after the previous invocation's last manager message to just before the next
        invocation's first one.
        """
        validate_unit_name(unit)
        n = max(int(lines), 1)
        if invocation is not None and not re.fullmatch(r"[0-9a-f]{32}", invocation):
            raise InputError(f"invocation id {invocation!r} is not 32 hex digits")
        after = _parse_cursor(since_cursor) if since_cursor else None
        fetch = n + 1000 if (after or invocation) else n
        ents = []
        # with `since`, journalctl seeks to that time and reads forward (what this start logged); with -n as
        # well it would walk back -n entries from the end, through older invocations, whatever --since says
        bound = [f"--since=@{max(0.0, since):.6f}"] if since is not None else ["-n", str(fetch)]
        for line in self._jctl("-o", "json", _JOURNAL_FIELDS, *bound, "-u", unit, ok=(0, 1)).stdout.splitlines():
            with contextlib.suppress(ValueError):
                e = json.loads(line)
                if isinstance(e, dict):
                    ents.append(e)
        if after is not None:
            ents = [e for e in ents if _is_after(e, after)]
        if invocation:
            ents = _invocation_window(ents, invocation)
        return "\n".join(_format_entry(e) for e in ents[-n:])


# what journal() reads (the window, _format_entry); __CURSOR and __REALTIME_TIMESTAMP always come along.
# Half the bytes of every field: 40% less time for journalctl and json.loads on a long startup log.
_JOURNAL_FIELDS = "--output-fields=MESSAGE,INVOCATION_ID,_SYSTEMD_INVOCATION_ID,SYSLOG_IDENTIFIER,_COMM,_PID"


def _parse_cursor(cursor: str) -> tuple[str, int, int]:
    """(seqnum id, seqnum, realtime usec) of a journal cursor `s=..;i=..;b=..;m=..;t=..;x=..`."""
    try:
        f = dict(part.split("=", 1) for part in cursor.split(";"))
        return f["s"], int(f["i"], 16), int(f["t"], 16)
    except (ValueError, KeyError) as exc:
        raise InputError(f"not a journal cursor: {cursor[:80]!r}") from exc


def _is_after(e: dict[str, object], after: tuple[str, int, int]) -> bool:
    try:
        s, i, t = _parse_cursor(str(e.get("__CURSOR", "")))
    except InputError:
        return True
    return i > after[1] if s == after[0] else t > after[2]


def _invocation_window(ents: list[dict[str, object]], inv: str) -> list[dict[str, object]]:
    """The entries of invocation `inv` among one unit's journal entries (oldest first); see Systemd.journal."""
    def mgr(e: dict[str, object]) -> object:  # the manager's messages about a unit carry INVOCATION_ID
        return e.get("INVOCATION_ID")

    first = next((i for i, e in enumerate(ents) if mgr(e) == inv), None)
    if first is None:
        tagged = [i for i, e in enumerate(ents) if e.get("_SYSTEMD_INVOCATION_ID") == inv]
        if not tagged:
            return []
        first = tagged[0]
    start = first
    while start > 0 and mgr(ents[start - 1]) in (None, "", inv):  # back to the previous invocation's last word
        start -= 1
    end = next((k for k in range(first + 1, len(ents)) if mgr(ents[k]) and mgr(ents[k]) != inv), len(ents))
    last_own = max((i for i in range(first, end) if mgr(ents[i]) == inv), default=first)
    out = []
    for i in range(start, end):
        tag = ents[i].get("_SYSTEMD_INVOCATION_ID")
        if tag is not None and tag != inv and not mgr(ents[i]):
            continue  # output of another invocation
        if i > last_own and end < len(ents) and tag != inv:
            continue  # untagged, after our last word and before the next start: the next invocation's
        out.append(ents[i])
    return out


def _format_entry(e: dict[str, object]) -> str:
    """One journal entry (journalctl -o json) as `Mon DD HH:MM:SS.ffffff ident[pid]: message`."""
    try:
        ts = datetime.datetime.fromtimestamp(int(str(e.get("__REALTIME_TIMESTAMP"))) / 1e6)
        when = ts.strftime("%b %d %H:%M:%S.%f")
    except (TypeError, ValueError):
        when = "?"
    msg = e.get("MESSAGE")
    if isinstance(msg, list):  # binary or non-UTF-8 message: an array of bytes
        msg = bytes(int(b) for b in msg if isinstance(b, int)).decode("utf-8", "replace")
    ident = e.get("SYSLOG_IDENTIFIER") or e.get("_COMM") or "?"
    pid = e.get("_PID")
    return f"{when} {ident}{f'[{pid}]' if pid else ''}: {msg if msg is not None else ''}"


def for_config(cfg: object) -> Systemd:
    """The Systemd a loaded config asks for: its sandbox's systemd if `systemd.sandbox` is set, else its commands."""
    scfg = cfg.systemd  # type: ignore[attr-defined]
    unit_dir = cfg.paths.unit_dir  # type: ignore[attr-defined]
    if scfg.sandbox:
        from deploy_tool.box.sandbox_handle import SandboxHandle

        sb = SandboxHandle(scfg.sandbox)
        # run by a unit of the sandbox's own systemd (the failover unit, the liveness probe): its systemd is ours
        if sb.contains_self() or _inside(sb.unit_dir):
            return Systemd(("systemctl",), ("journalctl",), unit_dir)
        return Systemd(sb.systemctl_prefix(), sb.journalctl_prefix(), unit_dir)
    return Systemd(scfg.systemctl, scfg.journalctl, unit_dir)


def _inside(sandbox_unit_dir: Path) -> bool:
    """True in a process of the sandbox whose unit dir this is: it is bind-mounted over /etc/systemd/system there."""
    try:
        a, b = os.stat("/etc/systemd/system"), os.stat(sandbox_unit_dir)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _settled(read: Callable[[], str]) -> str:
    """What `read()` returns once the unit's own processes have a line in and nothing new arrived for 0.1 s (the
    retry.journal_settle policy: at most ~2 s; then the last read)."""
    seen: list[str] = []

    def again() -> bool:
        text = read()
        settled = bool(seen) and text == seen[-1] and any(" systemd[1]: " not in ln for ln in text.splitlines())
        seen.append(text)
        return settled

    retry.journal_settle()(again)
    return seen[-1]


def _indent(text: str) -> str:
    return "\n".join("  " + ln for ln in text.splitlines())
