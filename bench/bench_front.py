#!/usr/bin/env python3
"""The front (deploy_tool/box/front.py) in front of both real CPU backends on the tiny model, side by side in one run.

Parts (all by default, `--part` picks):
  stream   a streamed chat completion (SSE, 64 tokens) through the front and straight to the server, interleaved
           (the order alternates), N times each: time to first token and tokens/s (the completion's tokens over
           the stream's whole time, request sent to last byte), medians and the front's difference; also the
           decode rate (first token to last, where the server sends about a token per chunk: llama-server) and
           the front's CPU time per completion.
  release  the front started with no backend on its internal port, K requests sent and held, then the server
           started; a poller (this process, every 1 ms, straight to the internal port) notes when the port first
           accepts and when it first answers ready (llama-server GET /health 200, ftllm GET /v1/models 200). The
           figure: from that first ready answer to the first held request's answer (its first byte).
  hold     the server running, `hold 30` on the control socket, K requests sent and held, then `release`: from
           the `release` sent to the first held request's answer.
  proxyd   what a client sees from systemd-socket-proxyd (run by systemd-socket-activate, as its .socket unit
           would) when the upstream port is closed, beside the front: the front with the server started 0.5 s
           after the request, and the front with no server past its bound (--hold 1).

Goals (issue 27, the figures go to bench/RESULTS.md): through the front at most 2% fewer tokens/s and at most
2 ms more time to first token; a held request answered within 50 ms of the backend's port answering ready.

Usage: python bench/bench_front.py [--quick] [--runs N] [--part stream|release|hold|proxyd ...] [--json]
Everything binds 127.0.0.1 and every process started is stopped by its PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support import backends  # noqa: E402
from tests.support.tiny_model import write_model  # noqa: E402

FRONT = REPO / "deploy_tool" / "box" / "front.py"
HOST = "127.0.0.1"
KINDS = ("llamacpp", "ftllm")
READY_PATH = {"llamacpp": "/health", "ftllm": "/v1/models"}  # as deploy_tool.box.probe.health probes them
PROXYD = Path("/usr/lib/systemd/systemd-socket-proxyd")
ACTIVATE = shutil.which("systemd-socket-activate")
MAX_TOKENS = 64
EXTRA: dict[str, list[str]] = {"llamacpp": [], "ftllm": []}  # --server-arg: more of the servers' own flags


# --------------------------------------------------------------------------------------------- HTTP by hand

def _request_bytes(method: str, path: str, body: bytes = b"") -> bytes:
    head = [f"{method} {path} HTTP/1.1", f"Host: {HOST}", "Connection: close"]
    if body:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _dechunk(raw: bytes) -> bytes:
    out, i = bytearray(), 0
    while i < len(raw):
        j = raw.index(b"\r\n", i)
        size = int(raw[i:j].split(b";")[0], 16)
        if size == 0:
            break
        out += raw[j + 2:j + 2 + size]
        i = j + 2 + size + 2
    return bytes(out)


CONTENT = re.compile(rb'"content":"[^"]')  # a delta carrying text (not the role chunk's null or empty content)


def stream_once(port: int) -> dict[str, float]:
    """One streamed chat completion on a fresh connection: time to first token, to the last byte, the tokens."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}).encode()
    t0 = time.monotonic()
    s = socket.create_connection((HOST, port), timeout=60)
    arrivals: list[tuple[float, int]] = []  # (time, bytes received so far)
    raw = bytearray()
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(_request_bytes("POST", "/v1/chat/completions", body))
        while True:
            d = s.recv(65536)
            if not d:
                break
            raw += d
            arrivals.append((time.monotonic(), len(raw)))
    finally:
        s.close()
    head, _, rest = bytes(raw).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"stream answered {head[:200]!r}")
    off = len(head) + 4

    def arrived(pos: int) -> float:  # when the byte at raw[pos] came
        return next(t for t, n in arrivals if n > pos)

    hits = [m.end() + off for m in CONTENT.finditer(rest)]
    if not hits:
        raise RuntimeError(f"no token in the stream: {rest[:300]!r}")
    text = _dechunk(rest) if b"chunked" in head.lower() else rest
    tokens = 0
    for line in text.split(b"\n"):
        if line.startswith(b"data: {"):
            ev = json.loads(line[6:])
            tokens = (ev.get("usage") or {}).get("completion_tokens") or \
                (ev.get("timings") or {}).get("predicted_n") or tokens
    tokens = tokens or MAX_TOKENS
    first, last_tok, end = arrived(hits[0]), arrived(hits[-1]), arrivals[-1][0]
    return {"ttft_s": first - t0, "total_s": end - t0, "tokens": tokens, "tok_s": tokens / (end - t0),
            "decode_tok_s": (tokens - 1) / (last_tok - first) if len(hits) >= tokens // 2 and last_tok > first
            else float("nan")}


def get_first_byte(port: int, path: str, out: list[tuple[float, bytes]], timeout: float = 90) -> None:
    """GET `path`; appends (time of the answer's first byte, its status line) to `out` (threads share it)."""
    try:
        s = socket.create_connection((HOST, port), timeout=timeout)
    except OSError as exc:
        out.append((time.monotonic(), f"connect: {exc!r}".encode()))
        return
    try:
        s.sendall(_request_bytes("GET", path))
        first = s.recv(65536)
        t = time.monotonic()
        data = first
        while True:
            d = s.recv(65536)
            if not d:
                break
            data += d
        out.append((t, data.split(b"\r\n", 1)[0] if data else b"(closed)"))
    except OSError as exc:
        out.append((time.monotonic(), f"error: {exc!r}".encode()))
    finally:
        s.close()


class Poller(threading.Thread):
    """Straight to the internal port every `every` s: when it first accepts a connection, when it answers 200."""

    def __init__(self, port: int, path: str, every: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.port, self.path, self.every = port, path, every
        self.t_open: float | None = None
        self.t_ready: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        req = _request_bytes("GET", self.path)
        nxt = time.monotonic()
        while not self.stop.is_set():
            try:
                with socket.create_connection((HOST, self.port), timeout=1) as s:
                    t = time.monotonic()
                    self.t_open = self.t_open or t
                    s.sendall(req)
                    first = s.recv(64)
                    if first.startswith(b"HTTP/1.1 200"):
                        self.t_ready = time.monotonic()
                        return
            except OSError:
                pass
            nxt += self.every
            time.sleep(max(0.0, nxt - time.monotonic()))


# --------------------------------------------------------------------------------------------- processes

class FrontProc:
    """front.py as the unit runs it (the box's Python -I -S on the file), on --listen instead of fd 3."""

    def __init__(self, tmp: Path, backend_port: int, hold: float) -> None:
        self.port = backends.free_port()
        self.control = str(tmp / f"front-{self.port}.ctl")
        self.log = tmp / f"front-{self.port}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(FRONT), "--listen", f"{HOST}:{self.port}",
                 "--backend", f"{HOST}:{backend_port}", "--hold", str(hold), "--control", self.control],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.control):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the front did not come up: {self.log.read_text()}")
            time.sleep(0.005)

    def ctl(self, command: str) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(self.control)
            s.sendall(command.encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                d = s.recv(4096)
                if not d:
                    break
                buf += d
        return json.loads(buf)

    def wait_in_flight(self, n: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.ctl("stats")["in_flight"] < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the front holds fewer than {n} requests: {self.ctl('stats')}")
            time.sleep(0.005)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def front(tmp: Path, backend_port: int, hold: float = 60) -> Iterator[FrontProc]:
    f = FrontProc(tmp, backend_port, hold)
    try:
        yield f
    finally:
        f.stop()


def ready(kind: str, port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out: list[tuple[float, bytes]] = []
        get_first_byte(port, READY_PATH[kind], out, timeout=5)
        if out and out[0][1].startswith(b"HTTP/1.1 200"):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{kind} on {port} not ready within {timeout} s")


# --------------------------------------------------------------------------------------------- parts

def part_stream(kind: str, srv: backends.Server, fr: FrontProc, runs: int) -> dict:
    for _ in range(3):  # warm both paths
        stream_once(srv.port)
        stream_once(fr.port)
    direct, through = [], []
    cpu0 = _cpu_s(fr.proc.pid)
    for i in range(runs):
        pair = [("d", srv.port), ("f", fr.port)]
        if i % 2:
            pair.reverse()
        for tag, port in pair:
            (direct if tag == "d" else through).append(stream_once(port))
    front_cpu_ms = (_cpu_s(fr.proc.pid) - cpu0) / runs * 1000
    med = {k: (_median(r[k] for r in direct), _median(r[k] for r in through))
           for k in ("ttft_s", "tok_s", "decode_tok_s", "total_s")}
    paired_ttft = statistics.median(f["ttft_s"] - d["ttft_s"] for d, f in zip(direct, through, strict=True))
    paired_tok = statistics.median(f["tok_s"] / d["tok_s"] for d, f in zip(direct, through, strict=True))
    return {"runs": runs, "tokens": statistics.median(r["tokens"] for r in through),
            "direct": {k: v[0] for k, v in med.items()}, "front": {k: v[1] for k, v in med.items()},
            "ttft_more_ms": (med["ttft_s"][1] - med["ttft_s"][0]) * 1000, "ttft_more_ms_paired": paired_ttft * 1000,
            "tok_s_less_pct": (1 - med["tok_s"][1] / med["tok_s"][0]) * 100,
            "tok_s_less_pct_paired": (1 - paired_tok) * 100, "front_cpu_ms_per_completion": front_cpu_ms}


def _median(values: Iterator[float] | list[float]) -> float:
    """The median of the defined values; NaN when fewer than half are (ftllm's tokens come 2-3 chunks at a time, so
    the time from its first token to its last is often nothing: no decode rate)."""
    vals = list(values)
    ok = [v for v in vals if v == v]
    return statistics.median(ok) if len(ok) * 2 >= len(vals) and ok else float("nan")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def part_release(kind: str, model: Path, tmp: Path, reps: int, k: int) -> dict:
    rows = []
    for _ in range(reps):
        bport = backends.free_port()
        with front(tmp, bport) as fr:
            answers: list[tuple[float, bytes]] = []
            clients = [threading.Thread(target=get_first_byte, args=(fr.port, READY_PATH[kind], answers), daemon=True)
                       for _ in range(k)]
            for c in clients:
                c.start()
            fr.wait_in_flight(k)
            time.sleep(0.05)  # they are in the front's retry loop
            poller = Poller(bport, READY_PATH[kind])
            poller.start()
            srv = backends.start(kind, model, model_name="tiny", log_dir=tmp / "logs", port=bport,
                                 extra=EXTRA[kind])
            try:
                for c in clients:
                    c.join(90)
                poller.stop.set()
                poller.join(5)
            finally:
                srv.stop()
            if poller.t_ready is None or len(answers) < k:
                raise RuntimeError(f"{kind}: no ready answer or a held request unanswered: {answers} "
                                   f"{srv.log_text()[-800:]}")
            bad = [a for a in answers if not a[1].startswith(b"HTTP/1.1 200")]
            first = min(t for t, _ in answers)
            rows.append({"open_to_ready_ms": (poller.t_ready - (poller.t_open or poller.t_ready)) * 1000,
                         "ready_to_first_ms": (first - poller.t_ready) * 1000,
                         "ready_to_last_ms": (max(t for t, _ in answers) - poller.t_ready) * 1000,
                         "not_200": len(bad), "start_to_ready_s": poller.t_ready - srv.started})
    return {"reps": reps, "held": k, "runs": rows,
            "ready_to_first_ms": statistics.median(r["ready_to_first_ms"] for r in rows),
            "ready_to_first_ms_max": max(r["ready_to_first_ms"] for r in rows),
            "ready_to_last_ms": statistics.median(r["ready_to_last_ms"] for r in rows),
            "not_200": sum(r["not_200"] for r in rows)}


def part_hold(kind: str, fr: FrontProc, reps: int, k: int) -> dict:
    rows = []
    for _ in range(reps):
        fr.ctl("hold 30")
        answers: list[tuple[float, bytes]] = []
        clients = [threading.Thread(target=get_first_byte, args=(fr.port, READY_PATH[kind], answers), daemon=True)
                   for _ in range(k)]
        for c in clients:
            c.start()
        fr.wait_in_flight(k)
        time.sleep(0.05)
        t0 = time.monotonic()
        fr.ctl("release")
        for c in clients:
            c.join(30)
        if len(answers) < k:
            raise RuntimeError(f"{kind}: a held request unanswered after release: {answers}")
        rows.append({"release_to_first_ms": (min(t for t, _ in answers) - t0) * 1000,
                     "release_to_last_ms": (max(t for t, _ in answers) - t0) * 1000,
                     "not_200": sum(not s.startswith(b"HTTP/1.1 200") for _, s in answers)})
    return {"reps": reps, "held": k,
            "release_to_first_ms": statistics.median(r["release_to_first_ms"] for r in rows),
            "release_to_first_ms_max": max(r["release_to_first_ms"] for r in rows),
            "release_to_last_ms": statistics.median(r["release_to_last_ms"] for r in rows),
            "not_200": sum(r["not_200"] for r in rows)}


def _one_request(port: int, path: str = "/health", timeout: float = 30) -> tuple[str, float, str]:
    """What a client sees for one GET: ('answer'|'reset'|'closed'|'timeout', seconds, status line or error)."""
    t0 = time.monotonic()
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(_request_bytes("GET", path))
            data = b""
            while True:
                d = s.recv(65536)
                if not d:
                    break
                data += d
    except ConnectionResetError as exc:
        return "reset", time.monotonic() - t0, repr(exc)
    except TimeoutError:
        return "timeout", time.monotonic() - t0, ""
    dt = time.monotonic() - t0
    if not data:
        return "closed", dt, "EOF before any byte"
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    extra = [h for h in head[1:] if h.lower().startswith("retry-after")]
    return "answer", dt, " ".join([head[0], *extra])


def part_proxyd(model: Path, tmp: Path) -> dict:
    """systemd-socket-proxyd before a closed port vs the front before the same port, then the backend started."""
    out: dict[str, object] = {}
    if ACTIVATE is None or not PROXYD.exists():
        return {"skipped": "needs /usr/bin/systemd-socket-activate and /usr/lib/systemd/systemd-socket-proxyd"}
    bport, pport = backends.free_port(), backends.free_port()
    log = tmp / "proxyd.log"
    with open(log, "wb") as lf:
        # as deploytool-front.socket would hand it over: the listening socket as fd 3, LISTEN_FDS=1, LISTEN_PID
        proc = subprocess.Popen([ACTIVATE, "-l", f"{HOST}:{pport}", str(PROXYD), f"{HOST}:{bport}"],
                                stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while b"Listening on" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"systemd-socket-activate did not listen: {log.read_text()}")
            time.sleep(0.005)
        seen = [_one_request(pport) for _ in range(5)]  # the first execs the proxy; all meet the closed port
        out["proxyd_closed"] = {"outcomes": sorted({s[0] for s in seen}), "detail": seen[-1][2],
                                "median_ms": statistics.median(s[1] for s in seen) * 1000,
                                "first_ms": seen[0][1] * 1000}
        # the backend started 0.5 s after the request: the client has long been turned away
        res: list[tuple[str, float, str]] = []
        t = threading.Thread(target=lambda: res.append(_one_request(pport, READY_PATH["llamacpp"])), daemon=True)
        t.start()
        time.sleep(0.5)
        with backends.running("llamacpp", model, model_name="tiny", log_dir=tmp / "logs", port=bport,
                              extra=EXTRA["llamacpp"]):
            t.join(30)
            ready("llamacpp", bport)
            out["proxyd_backend_late"] = {"outcome": res[0][0], "ms": res[0][1] * 1000, "detail": res[0][2]}
            after = _one_request(pport, READY_PATH["llamacpp"])
            out["proxyd_backend_up"] = {"outcome": after[0], "ms": after[1] * 1000, "detail": after[2]}
        proxyd_log = log.read_text(errors="replace")
        out["proxyd_log"] = sorted({ln for ln in proxyd_log.splitlines() if "Failed" in ln})
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    # the front before the same kind of closed port, the server started 0.5 s after the request
    bport = backends.free_port()
    with front(tmp, bport, hold=60) as fr:
        res = []
        t = threading.Thread(target=lambda: res.append(_one_request(fr.port, READY_PATH["llamacpp"], 60)),
                             daemon=True)
        t.start()
        time.sleep(0.5)
        with backends.running("llamacpp", model, model_name="tiny", log_dir=tmp / "logs", port=bport,
                              extra=EXTRA["llamacpp"]):
            t.join(60)
        out["front_backend_late"] = {"outcome": res[0][0], "ms": res[0][1] * 1000, "detail": res[0][2]}
    # the front with no server at all, past its bound
    with front(tmp, backends.free_port(), hold=1) as fr:
        r = _one_request(fr.port, "/health", 30)
        out["front_past_bound"] = {"outcome": r[0], "ms": r[1] * 1000, "detail": r[2], "hold_s": 1}
    return out


# --------------------------------------------------------------------------------------------- main

def _num(v: float) -> str:
    return "-" if v != v else f"{v:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (stream 10, release 2, hold 5; default 100, 8, 20)")
    ap.add_argument("--runs", type=int, help="streamed completions each way (default 100, --quick 10)")
    ap.add_argument("--held", type=int, default=3, help="requests held at once in the release and hold parts")
    ap.add_argument("--part", action="append", choices=("stream", "release", "hold", "proxyd"))
    ap.add_argument("--size", choices=("tiny", "24m"), default="tiny")
    ap.add_argument("--kind", action="append", choices=KINDS, help="only this backend (repeatable; default both)")
    ap.add_argument("--model", type=Path, help="serve this GGUF instead of writing one of --size (a machine without "
                                               "the gguf package, e.g. the GPU machine)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="KIND=ARG",
                    help="one more flag for that backend's server, e.g. llamacpp=-ngl --server-arg llamacpp=99 "
                         "(DEPLOYTOOL_LLAMA_SERVER picks the llama-server binary)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    for sa in a.server_arg:
        k, sep, v = sa.partition("=")
        if not sep or k not in EXTRA:
            ap.error(f"--server-arg {sa!r}: give KIND=ARG with KIND one of {', '.join(KINDS)}")
        EXTRA[k].append(v)
    kinds = tuple(a.kind or KINDS)
    # a SIGTERM (`timeout`, make) unwinds like Ctrl-C: the servers run in their own sessions and are stopped by PID
    # in the `finally` blocks, which a default SIGTERM would skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parts = a.part or ["stream", "release", "hold", "proxyd"]
    runs = a.runs or (10 if a.quick else 100)
    reps_release, reps_hold = (2, 5) if a.quick else (8, 20)
    t_start = time.monotonic()
    load0 = os.getloadavg()[0]
    res: dict[str, dict] = {kind: {} for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-front-") as td:
        tmp = Path(td)
        model = a.model.resolve() if a.model else write_model(tmp / f"{a.size}-f16.gguf", size=a.size, f16=True)
        for kind in kinds:
            if "stream" in parts or "hold" in parts:
                with backends.running(kind, model, model_name="tiny", log_dir=tmp / "logs",
                                     extra=EXTRA[kind]) as srv:
                    ready(kind, srv.port)
                    with front(tmp, srv.port) as fr:
                        if "stream" in parts:
                            res[kind]["stream"] = part_stream(kind, srv, fr, runs)
                        if "hold" in parts:
                            res[kind]["hold"] = part_hold(kind, fr, reps_hold, a.held)
                        res[kind]["front_stats"] = fr.ctl("stats")
            if "release" in parts:
                res[kind]["release"] = part_release(kind, model, tmp, reps_release, a.held)
        proxyd = part_proxyd(model, tmp) if "proxyd" in parts else None
    wall = time.monotonic() - t_start
    load1 = os.getloadavg()[0]
    if a.json:
        print(json.dumps({"model": str(a.model or a.size), "extra": EXTRA, "load": [load0, load1], "wall_s": wall, "results": res,
                          "proxyd": proxyd}, indent=2, default=str))
        return 0
    print(f"the front vs straight to the server, {a.model or a.size} F16 model, {EXTRA}, 127.0.0.1; load {load0:.2f} -> {load1:.2f}, "
          f"{wall:.0f} s")
    if "stream" in parts:
        print(f"\nstreamed chat completion, {MAX_TOKENS} tokens, median of {runs} each way (interleaved); "
              "goal: TTFT +2 ms and tok/s -2% at most; front CPU per completion:")
        print(f"  {'backend':9} {'TTFT direct':>11} {'front':>8} {'+ms':>6} {'(paired)':>8}   "
              f"{'tok/s direct':>12} {'front':>8} {'-%':>6} {'(paired)':>8}   {'decode tok/s d/f':>17} {'front CPU ms':>12}")
        for kind in kinds:
            s = res[kind]["stream"]
            d, f = s["direct"], s["front"]
            goal = "yes" if s["ttft_more_ms"] <= 2 and s["tok_s_less_pct"] <= 2 else "NO"
            print(f"  {kind:9} {d['ttft_s'] * 1000:9.2f}ms {f['ttft_s'] * 1000:6.2f}ms {s['ttft_more_ms']:+6.2f} "
                  f"{s['ttft_more_ms_paired']:+8.2f}   {d['tok_s']:12.0f} {f['tok_s']:8.0f} "
                  f"{s['tok_s_less_pct']:+6.2f} {s['tok_s_less_pct_paired']:+8.2f}   "
                  f"{_num(d['decode_tok_s']):>8}/{_num(f['decode_tok_s']):<8} {s['front_cpu_ms_per_completion']:5.2f} "
                  f"goal: {goal}")
    if "release" in parts:
        print(f"\nheld while no backend listens ({a.held} requests), then the server started; "
              f"from its first ready answer (polled every 1 ms) to the first held answer:")
        for kind in kinds:
            r = res[kind]["release"]
            goal = "yes" if r["ready_to_first_ms_max"] <= 50 else "NO"
            print(f"  {kind:9} median {r['ready_to_first_ms']:6.1f} ms, max {r['ready_to_first_ms_max']:6.1f} ms "
                  f"(all {a.held} answered: median {r['ready_to_last_ms']:.1f} ms; not 200: {r['not_200']}; "
                  f"{r['reps']} starts; port open->ready "
                  f"{statistics.median(x['open_to_ready_ms'] for x in r['runs']):.1f} ms)  goal (<=50 ms): {goal}")
    if "hold" in parts:
        print(f"\nheld by `hold 30` ({a.held} requests), then `release`; from `release` sent to the first answer:")
        for kind in kinds:
            h = res[kind]["hold"]
            print(f"  {kind:9} median {h['release_to_first_ms']:6.2f} ms, max {h['release_to_first_ms_max']:6.2f} ms "
                  f"(all answered: median {h['release_to_last_ms']:.2f} ms; not 200: {h['not_200']}; "
                  f"{h['reps']} holds)")
    if proxyd is not None:
        print("\nwhat a client sees with the backend's port closed:")
        if "skipped" in proxyd:
            print(f"  skipped: {proxyd['skipped']}")
        else:
            pc = proxyd["proxyd_closed"]
            print(f"  systemd-socket-proxyd, port closed:         {'/'.join(pc['outcomes'])} after "
                  f"{pc['median_ms']:.2f} ms (median of 5; first, with the exec: {pc['first_ms']:.1f} ms) "
                  f"{pc['detail']}")
            for key, label in (("proxyd_backend_late", "systemd-socket-proxyd, server up at +0.5 s:"),
                               ("proxyd_backend_up", "systemd-socket-proxyd, server up, next req.: "),
                               ("front_backend_late", "the front, server up at +0.5 s:            "),
                               ("front_past_bound", "the front, no server, --hold 1:            ")):
                x = proxyd[key]
                print(f"  {label} {x['outcome']} after {x['ms']:.1f} ms {x['detail']}")
            print(f"  proxyd's log: {'; '.join(proxyd['proxyd_log'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
