"""Small file-system primitives: atomic writes and renames, so nothing is ever half-written."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from deploy_tool.errors import InputError, OSFailure


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Write `data` to a temp file beside `path`, fsync, chmod, then rename over `path`."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, p)
        fsync_dir(p.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise os_error(exc, f"cannot write {p}") from None


def fsync_dir(d: str | os.PathLike[str]) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_symlink(target: str, link: str | os.PathLike[str]) -> None:
    """Point `link` at `target` atomically (symlink to a temp name, then rename over the link)."""
    lp = Path(link)
    tmp = lp.with_name(f".{lp.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:
        os.symlink(target, tmp)
        os.rename(tmp, lp)
        fsync_dir(lp.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise os_error(exc, f"cannot point {lp} at {target}") from None


def os_error(exc: OSError, what: str):
    """Map an OSError to a DeployError with a hint (disk full, permission, read-only...)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        return OSFailure(f"{what}: no space left on device", hint="free disk space and run the command again; "
                         "nothing was left half-written")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return OSFailure(f"{what}: permission denied", hint="run as root, or point the paths: settings at a "
                         "directory you can write")
    if exc.errno == errno.EROFS:
        return OSFailure(f"{what}: read-only file system", hint="point the paths: settings at a writable place")
    if exc.errno == errno.ENOENT:
        return InputError(f"{what}: {reason}")
    return OSFailure(f"{what}: {reason}")
