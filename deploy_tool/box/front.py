"""The front: the one public port, held while no backend can answer.

Runs as `deploytool-front.service`, socket-activated by `deploytool-front.socket` (systemd owns the listening
socket: a restart of the front loses no connection, the kernel's backlog holds them). Standard library only: the
release ships this file as launch/front.py and the unit runs it with the box's Python (-I -S), like the env
launcher.

Every request is read whole (head and body), then sent to the backend on its internal address (loopback, its own
port), once per attempt, with `Connection: close`:
- no backend listening (a switch, a restart, a crash, a failover between two servers) or one that answers 503
  while it loads its model, or closes before a byte of answer: the request waits and is tried again every
  RETRY_S, and goes to whichever backend answers first;
- held by deploytool (`hold`, from the moment a switch starts draining the current backend until the next one is
  ready): it waits for the release;
- past the hold bound (--hold, serve.hold_timeout_s): the client gets 503 with Retry-After, never a refused or
  reset connection.
Once the backend sends its answer's first bytes the front only copies (streams flow as they come, TCP_NODELAY);
the answer closes the client's connection (`Connection: close`), so no request is ever split over two backends.

Why a front of our own (docs/held-port.md has the measurements): systemd-socket-proxyd holds no request (a
refused upstream connection closes the client's at once) and HAProxy's `retry-on`/`redispatch` retries only
within `retries` (a few tries, not a minutes-long model load), and neither can be told to hold new requests while
the current backend drains.

Control (unix socket, --control; the unit's RuntimeDirectory, reachable by root alone): one line in, one JSON
line out: `hold SECONDS` (new requests wait; the hold ends by itself after SECONDS, so a deploytool killed
mid-switch leaves no port held), `release`, `stats` (counters since start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import sys
import time

RETRY_S = 0.02  # how often a waiting request tries the backend again
GONE_CHECK_S = 0.1  # how often a request held by deploytool looks whether its client is still there
HEAD_MAX = 64 * 1024
BODY_MAX = 64 * 1024 * 1024
IDLE_S = 75.0  # a client connection that sends no request for this long is closed
HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"upgrade", b"expect"}


class Stats:
    def __init__(self) -> None:
        self.started = time.time()
        self.requests = 0  # answered by a backend
        self.waited = 0  # of those (and of the failed), had to wait for a backend
        self.failed = 0  # answered 503 by the front (past the bound) or broken mid-answer
        self.wait_s = 0.0  # seconds all requests waited, together
        self.wait_max_s = 0.0
        self.held_s = 0.0  # seconds the port was held by deploytool, together
        self.holds = 0
        self.in_flight = 0
        self.gone = 0  # clients that closed their connection while their request waited (not sent on)

    def to_json(self, hold_until: float) -> dict[str, object]:
        now = time.monotonic()
        return {"requests": self.requests, "waited": self.waited, "failed": self.failed,
                "wait_s": round(self.wait_s, 4), "wait_max_s": round(self.wait_max_s, 4),
                "held_s": round(self.held_s + (max(0.0, min(hold_until, now) - self._hold_from) if hold_until > now
                                               else 0.0), 4),
                "holds": self.holds, "holding": hold_until > now, "in_flight": self.in_flight, "gone": self.gone,
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started))}

    _hold_from = 0.0


class Front:
    def __init__(self, backend: tuple[str, int], hold_s: float) -> None:
        self.backend = backend
        self.hold_s = hold_s
        self.stats = Stats()
        self.hold_until = 0.0  # monotonic; > now: held
        self.released = asyncio.Event()
        self.released.set()
        self._expiry: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ hold / release

    def hold(self, seconds: float) -> None:
        now = time.monotonic()
        if self.hold_until <= now:
            self.stats.holds += 1
            self.stats._hold_from = now
        self.hold_until = now + seconds
        self.released.clear()
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(seconds, self.release)

    def release(self) -> None:
        now = time.monotonic()
        if self.hold_until > now or not self.released.is_set():
            self.stats.held_s += max(0.0, min(now, self.hold_until) - self.stats._hold_from)
        self.hold_until = 0.0
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.released.set()

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await asyncio.wait_for(reader.readline(), 5)).decode("ascii", "replace").split()
            if line[:1] == ["hold"] and len(line) == 2:
                seconds = float(line[1])
                if not math.isfinite(seconds):
                    raise ValueError(f"hold needs a finite number of seconds, not {line[1]!r}")
                self.hold(min(max(seconds, 0.0), 86400.0))
            elif line == ["release"]:
                self.release()
            elif line != ["stats"]:
                raise ValueError(f"unknown command {line!r}")
            out: dict[str, object] = {"ok": True, **self.stats.to_json(self.hold_until)}
        except (TimeoutError, ValueError, IndexError, OSError) as exc:
            out = {"ok": False, "error": str(exc)}
        try:
            writer.write(json.dumps(out).encode() + b"\n")
            await writer.drain()
        except OSError:
            pass
        writer.close()

    # ------------------------------------------------------------------ clients

    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        try:
            req = await _read_request(reader, writer)
            if req is not None:
                self.stats.in_flight += 1
                try:
                    await self.serve(req, reader, writer)
                finally:
                    self.stats.in_flight -= 1
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass
        except _Bad as exc:
            await _answer(writer, exc.status, exc.reason)
        finally:
            writer.close()

    async def serve(self, req: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.hold_s
        waited = False
        while True:
            while not self.released.is_set() and time.monotonic() < deadline:
                waited = True
                with contextlib.suppress(TimeoutError):  # a slice at a time: a client that left is seen
                    await asyncio.wait_for(self.released.wait(), min(GONE_CHECK_S, deadline - time.monotonic()))
                if reader.at_eof():
                    break
            if reader.at_eof():  # the client gave up while it waited: no backend computes an answer for nobody
                self.stats.gone += 1
                self._count(t0, waited, answered=False)
                return
            if not self.released.is_set():
                break
            got = await self._try(req, writer, deadline)
            if got == "done":
                self._count(t0, waited)
                return
            if got == "broken":
                self.stats.failed += 1
                self._count(t0, waited, answered=False)
                return
            waited = True
            if time.monotonic() + RETRY_S >= deadline:
                break
            await asyncio.sleep(RETRY_S)
        self.stats.failed += 1
        self._count(t0, True, answered=False)
        await _answer(writer, 503, "no backend became ready within the hold bound",
                      retry_after=max(1, int(self.hold_s // 4)))

    def _count(self, t0: float, waited: bool, answered: bool = True) -> None:
        w = time.monotonic() - t0 if waited else 0.0
        if answered:
            self.stats.requests += 1
        if waited:
            self.stats.waited += 1
            self.stats.wait_s += w
            self.stats.wait_max_s = max(self.stats.wait_max_s, w)

    async def _try(self, req: bytes, writer: asyncio.StreamWriter, deadline: float) -> str:
        """One attempt: 'done' (answered), 'again' (no backend, loading, or closed before answering) or 'broken'
        (the answer had begun when the backend went away)."""
        try:
            br, bw = await asyncio.wait_for(asyncio.open_connection(*self.backend),
                                            max(0.05, deadline - time.monotonic()))
        except (TimeoutError, OSError):
            return "again"
        _nodelay(bw)
        try:
            bw.write(req)
            await bw.drain()
            head = await br.readuntil(b"\r\n\r\n")
            if head.split(b" ", 2)[1:2] == [b"503"]:
                bw.close()
                return "again"  # loading its model (llama-server), or going away
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, IndexError):
            bw.close()
            return "again"
        try:
            writer.write(_close_head(head))
            while True:
                chunk = await br.read(65536)
                if not chunk:
                    break
                writer.write(chunk)
                await writer.drain()
            return "done"
        except OSError:
            return "broken"
        finally:
            bw.close()


class _Bad(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def _nodelay(w: asyncio.StreamWriter) -> None:
    s = w.get_extra_info("socket")
    if s is not None and s.family in (socket.AF_INET, socket.AF_INET6):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes | None:
    """The next request, whole, with its hop-by-hop headers replaced by `Connection: close`; None at a clean end."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_S)
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise _Bad(400, "the request ended before its head did") from None
        return None
    except asyncio.LimitOverrunError:
        raise _Bad(431, "request head too large") from None
    lines = head[:-4].split(b"\r\n")
    if len(lines[0].split(b" ")) != 3:
        raise _Bad(400, "malformed request line")
    keep: list[bytes] = [lines[0]]
    length, chunked, expect = 0, False, False
    for ln in lines[1:]:
        name, sep, value = ln.partition(b":")
        if not sep:
            raise _Bad(400, "malformed header line")
        n = name.strip().lower()
        v = value.strip()
        if n == b"content-length":
            if not v.isdigit():
                raise _Bad(400, "bad Content-Length")
            length = int(v)
        elif n == b"transfer-encoding":
            chunked = v.lower() == b"chunked"
            if not chunked:
                raise _Bad(501, "transfer coding not supported")
        elif n == b"expect":
            expect = v.lower() == b"100-continue"
        if n not in HOP:
            keep.append(ln)
    keep.append(b"Connection: close")
    if length > BODY_MAX:
        raise _Bad(413, "request body too large")
    if expect:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    body = await _read_chunked(reader) if chunked else await reader.readexactly(length)
    return b"\r\n".join(keep) + b"\r\n\r\n" + body


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        out += size_line
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise _Bad(400, "bad chunk size") from None
        if len(out) + size > BODY_MAX:
            raise _Bad(413, "request body too large")
        if size == 0:
            while True:  # trailers, then the empty line
                t = await reader.readuntil(b"\r\n")
                out += t
                if t == b"\r\n":
                    return bytes(out)
        out += await reader.readexactly(size + 2)


def _close_head(head: bytes) -> bytes:
    lines = head[:-4].split(b"\r\n")
    keep = [lines[0]] + [ln for ln in lines[1:] if ln.partition(b":")[0].strip().lower() not in
                         (b"connection", b"keep-alive")]
    return b"\r\n".join([*keep, b"Connection: close"]) + b"\r\n\r\n"


async def _answer(writer: asyncio.StreamWriter, status: int, message: str, retry_after: int | None = None) -> None:
    reason = {400: "Bad Request", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
              501: "Not Implemented", 503: "Service Unavailable"}.get(status, "Error")
    body = json.dumps({"error": {"message": f"deploytool front: {message}", "type": "unavailable_error"
                                 if status == 503 else "invalid_request_error", "code": status}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
    except OSError:
        pass


def _listen_socket(listen: str | None) -> socket.socket:
    """systemd's listening socket (LISTEN_FDS: fd 3), or --listen HOST:PORT for a run outside systemd."""
    if listen is None:
        if os.environ.get("LISTEN_PID") != str(os.getpid()) or os.environ.get("LISTEN_FDS") != "1":
            raise SystemExit("deploytool front: no socket from systemd (LISTEN_FDS=1) and no --listen")
        return socket.socket(fileno=3)
    host, _, port = listen.rpartition(":")
    s = socket.create_server((host.strip("[]"), int(port)), reuse_port=False)
    return s


async def _main(args: argparse.Namespace) -> None:
    host, _, port = args.backend.rpartition(":")
    front = Front((host.strip("[]"), int(port)), args.hold)
    lsock = _listen_socket(args.listen)
    lsock.setblocking(False)
    server = await asyncio.start_server(front.client, sock=lsock, limit=HEAD_MAX, backlog=1024)
    ctl = None
    if args.control:
        # bound and listening under a name of its own, then renamed into place: the control path exists only once
        # it accepts, so `hold` right after a start is never refused (deploy_tool.box.frontctl asks only when the
        # path exists)
        tmp = f"{args.control}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        old = os.umask(0o177)
        csock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            csock.bind(tmp)
            csock.listen(16)
            os.rename(tmp, args.control)
        except BaseException:
            csock.close()
            raise
        finally:
            os.umask(old)
        csock.setblocking(False)
        ctl = await asyncio.start_unix_server(front.control, sock=csock)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"deploytool front: {args.backend} behind the public socket, requests held up to {args.hold:g} s",
          flush=True)
    await stop.wait()
    # stop accepting (systemd keeps the listening socket and its backlog for the next start), let the requests in
    # flight finish (the unit's TimeoutStopSec= bounds it)
    server.close()
    if ctl is not None:
        ctl.close()
    front.release()
    while front.stats.in_flight:
        await asyncio.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="deploytool-front", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True, help="HOST:PORT of the backends' internal address")
    p.add_argument("--hold", type=float, required=True, help="seconds a request may wait for a backend")
    p.add_argument("--control", help="unix socket for hold/release/stats")
    p.add_argument("--listen", help="HOST:PORT to listen on when not socket-activated (tests)")
    args = p.parse_args(argv)
    try:
        asyncio.run(_main(args))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
