"""The front (deploy_tool/box/front.py) as the unit runs it: socket-activated by systemd's own
systemd-socket-activate (the listening socket handed over as fd 3, LISTEN_FDS=1), the box's Python -I -S on the
file, in front of real HTTP servers on another port. What a client sees: passed through unchanged (body, key,
stream), held while no backend answers or while deploytool holds, 503 + Retry-After past the bound, never a
refused or reset connection."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

FRONT = Path(__file__).resolve().parents[1] / "deploy_tool" / "box" / "front.py"
ACTIVATE = shutil.which("systemd-socket-activate")
pytestmark = pytest.mark.skipif(ACTIVATE is None, reason="needs systemd-socket-activate (the systemd package)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend:
    """A server on the backends' port: answers JSON echoing what it got, or 503 while 'loading', or streams."""

    def __init__(self, port: int, *, loading: int = 0, close_first: int = 0) -> None:
        self.port, self.loading, self.close_first = port, loading, close_first
        self.seen: list[dict[str, object]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def do_GET(self) -> None:
                self._answer(b"")

            def do_POST(self) -> None:
                self._answer(self._body())

            def _answer(self, body: bytes) -> None:
                if outer.close_first > 0:
                    outer.close_first -= 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if outer.loading > 0:
                    outer.loading -= 1
                    msg = b'{"error":{"message":"Loading model","code":503}}'
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                outer.seen.append({"path": self.path, "body": body.decode(), "auth": self.headers.get("Authorization"),
                                   "connection": self.headers.get("Connection")})
                if self.path == "/stream":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(5):
                        data = f"data: {i}\n\n".encode()
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                        time.sleep(0.1)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                out = json.dumps({"path": self.path, "body": body.decode(), "port": outer.port}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Front:
    def __init__(self, tmp: Path, backend_port: int, hold: float) -> None:
        self.port = free_port()
        self.control = str(tmp / "control")
        self.proc = subprocess.Popen(
            [ACTIVATE, "-l", f"127.0.0.1:{self.port}", sys.executable, "-I", "-S", str(FRONT),
             "--backend", f"127.0.0.1:{backend_port}", "--hold", str(hold), "--control", self.control],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # systemd-socket-activate listens at once and execs the front on the first connection: one now
        deadline = time.monotonic() + 20
        while not os.path.exists(self.control):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), 1).close()
            assert self.proc.poll() is None, self.proc.stdout.read() if self.proc.stdout else ""
            assert time.monotonic() < deadline, "the front did not come up"
            time.sleep(0.05)

    def ask(self, line: str) -> dict:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(self.control)
            s.sendall(line.encode() + b"\n")
            return json.loads(s.makefile().readline())

    def settled_stats(self) -> dict:
        """The counters once the last answer is counted: an answer counts when the backend's side of it has closed,
        which may come just after the client has read the whole response (Content-Length)."""
        for _ in range(50):
            s = self.ask("stats")
            if s["requests"] or s["failed"] or s["gone"]:
                return s
            time.sleep(0.05)
        return s

    def request(self, method: str = "GET", path: str = "/v1/models", body: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def ports() -> Iterator[int]:
    yield free_port()


@pytest.fixture
def front(tmp_path: Path, ports: int) -> Iterator[Front]:
    f = Front(tmp_path, ports, hold=3.0)
    try:
        yield f
    finally:
        f.close()


def test_passes_a_request_through_unchanged(front: Front, ports: int) -> None:
    b = Backend(ports)
    try:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        st, h, out = front.request("POST", "/v1/chat/completions", body,
                                   {"Authorization": "Bearer k3y", "Content-Type": "application/json"})
        assert st == 200 and json.loads(out)["body"] == body.decode()
        assert b.seen[-1]["auth"] == "Bearer k3y" and b.seen[-1]["path"] == "/v1/chat/completions"
        assert b.seen[-1]["connection"] == "close" and h["connection"] == "close"
        # a body the client sends only after 100 Continue (curl does above 1 KiB), and a chunked one
        big = b"x" * 5000
        st, _, out = front.request("POST", "/big", big, {"Expect": "100-continue"})
        assert st == 200 and json.loads(out)["body"] == big.decode()
    finally:
        b.close()


def test_a_request_waits_for_a_backend_that_comes_later(front: Front, ports: int) -> None:
    later: list[Backend] = []
    t = threading.Timer(0.8, lambda: later.append(Backend(ports, loading=3)))
    t.start()
    try:
        t0 = time.monotonic()
        st, _, out = front.request()
        waited = time.monotonic() - t0
        assert st == 200 and json.loads(out)["port"] == ports
        assert waited >= 0.7  # held while nothing listened, then while the backend answered 503 (loading)
        s = front.settled_stats()
        assert s["waited"] == 1 and s["failed"] == 0 and s["requests"] == 1, s
    finally:
        t.join()
        for b in later:
            b.close()


def test_past_the_bound_503_with_retry_after(front: Front) -> None:
    t0 = time.monotonic()
    st, h, out = front.request()
    took = time.monotonic() - t0
    assert st == 503 and "retry-after" in h and int(h["retry-after"]) >= 1
    assert 2.9 <= took < 6, took
    assert "hold bound" in json.loads(out)["error"]["message"]
    assert front.ask("stats")["failed"] == 1


def test_held_by_deploytool_until_released(front: Front, ports: int) -> None:
    b = Backend(ports)
    try:
        assert front.ask("hold 10")["holding"] is True
        got: list[tuple[float, int]] = []

        def client() -> None:
            st, _, _ = front.request()
            got.append((time.monotonic(), st))

        th = threading.Thread(target=client)
        th.start()
        time.sleep(0.6)
        assert not got and not b.seen  # held, though the backend is up (it is draining)
        released = time.monotonic()
        front.ask("release")
        th.join(10)
        assert got and got[0][1] == 200 and got[0][0] - released < 1.0
        s = front.ask("stats")
        assert s["holds"] == 1 and s["held_s"] >= 0.5 and not s["holding"]
    finally:
        b.close()


def test_a_hold_ends_by_itself(front: Front, ports: int) -> None:
    """A deploytool killed mid-switch leaves no port held: the hold expires."""
    b = Backend(ports)
    try:
        front.ask("hold 0.5")
        t0 = time.monotonic()
        st, _, _ = front.request()
        assert st == 200 and 0.3 < time.monotonic() - t0 < 2.5
    finally:
        b.close()


def test_a_backend_that_closes_before_answering_is_tried_again(front: Front, ports: int) -> None:
    b = Backend(ports, close_first=2)
    try:
        st, _, _ = front.request()
        assert st == 200 and len(b.seen) == 1
    finally:
        b.close()


def test_a_stream_flows_as_it_comes(front: Front, ports: int) -> None:
    b = Backend(ports)
    try:
        with socket.create_connection(("127.0.0.1", front.port), 10) as c:
            t0 = time.monotonic()
            c.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            buf, t_first = b"", None
            while not buf.endswith(b"0\r\n\r\n"):
                chunk = c.recv(65536)
                assert chunk, buf
                buf += chunk
                if t_first is None and b"data: 0" in buf:
                    t_first = time.monotonic() - t0
            total = time.monotonic() - t0
        assert buf.startswith(b"HTTP/1.1 200 ") and b"data: 4" in buf
        assert t_first is not None and t_first < 0.3 < total  # the first event long before the last: not buffered
    finally:
        b.close()


def test_bad_requests_get_an_answer_not_a_reset(front: Front, ports: int) -> None:
    with socket.create_connection(("127.0.0.1", front.port), 5) as s:
        s.sendall(b"NONSENSE\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400 ")
    with socket.create_connection(("127.0.0.1", front.port), 5) as s:
        s.sendall(b"POST / HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 413 ")


def test_control_refuses_what_it_does_not_know(front: Front) -> None:
    assert front.ask("frobnicate")["ok"] is False
    assert front.ask("hold")["ok"] is False
    assert front.ask("stats")["ok"] is True


def test_a_client_that_leaves_while_held_is_not_sent_on(front: Front, ports: int) -> None:
    """A client that gives up while its request is held: when the next backend is up, that request is not sent to
    it (a model would compute an answer for nobody; after a long hold, every client that left would land at
    once), and the front counts it as gone, not as answered."""
    front.ask("hold 30")
    c = socket.create_connection(("127.0.0.1", front.port), 5)
    c.sendall(b"GET /gone HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    c.close()
    b = Backend(ports)
    try:
        time.sleep(0.3)  # the front sees the close within its 0.1 s look
        front.ask("release")
        st, _, out = front.request(path="/here")  # a client that stayed would be served
        assert st == 200 and json.loads(out)["path"] == "/here"
        assert [s["path"] for s in b.seen] == ["/here"], b.seen
        for _ in range(50):  # the answer counts a moment after the client has read it (see Front.settled_stats)
            s = front.ask("stats")
            if s["requests"]:
                break
            time.sleep(0.05)
        assert s["gone"] == 1 and s["requests"] == 1 and s["failed"] == 0, s
    finally:
        b.close()


@pytest.mark.parametrize("line", ["hold nan", "hold inf", "hold -inf", "hold x", "hold", "hold 1 2"])
def test_a_hold_needs_a_finite_number(front: Front, line: str) -> None:
    r = front.ask(line)
    assert r["ok"] is False and not front.ask("stats")["holding"], r
