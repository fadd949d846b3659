"""The probes' one HTTP client (deploy_tool.box.probe.http) against real listeners on 127.0.0.1: every status is an
answer, no answer is an Unreachable with a named reason (and whether the request had gone out), no proxy from
the environment is used; and the two probes that read small JSON answers through it (drain's /slots, perf's
/metrics) say "cannot tell" for anything but a good answer."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from deploy_tool.box.probe import drain, http, perf


@contextmanager
def serve(routes: dict[str, tuple[int, bytes]]) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A listener answering GET PATH with routes[PATH] (404 otherwise); yields its base URL and the headers seen."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(dict(self.headers))
            status, body = routes.get(self.path, (404, b"not found"))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


@contextmanager
def silent() -> Iterator[str]:
    """A listener that accepts and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def test_every_status_is_an_answer_and_the_key_goes_as_a_bearer_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # never used: the backends are on 127.0.0.1
    with serve({"/ok": (200, b'{"a": 1}'), "/busy": (503, b"Loading model")}) as (base, seen):
        ok = http.request("GET", f"{base}/ok", timeout=5, api_key="k")
        busy = http.request("GET", f"{base}/busy", timeout=5)
        missing = http.request("GET", f"{base}/nope", timeout=5)
    assert ok.ok and ok.json() == {"a": 1}
    assert (busy.status, busy.ok, busy.text()) == (503, False, "Loading model")
    assert (missing.status, missing.text()) == (404, "not found")
    assert seen[0]["Authorization"] == "Bearer k" and seen[0]["Accept"] == "application/json"
    assert "Authorization" not in seen[1]


def test_no_answer_is_unreachable_with_its_reason() -> None:
    url = f"http://127.0.0.1:{closed_port()}/health"
    with pytest.raises(http.Unreachable) as refused:
        http.request("GET", url, timeout=2)
    assert (refused.value.reason, refused.value.detail, refused.value.sent) == (
        "connection-refused", f"connection refused: {url}", False)
    with silent() as base, pytest.raises(http.Unreachable) as late:
        http.request("GET", f"{base}/health", timeout=0.2)
    assert (late.value.reason, late.value.detail, late.value.sent) == (
        "timeout", f"no answer in time: {base}/health", True)


def test_perf_counts_a_silent_server_as_one_timed_out_request() -> None:
    with silent() as base:
        r = perf.stream_chat(perf.Endpoint(base, "m", timeout=0.2), [{"role": "user", "content": "hi"}])
    assert not r.ok and r.partial and r.error == "no answer within 0.2s (timeout)"


def test_slots_and_metrics_say_what_they_read_or_nothing() -> None:
    busy = json.dumps([{"id": 0, "is_processing": True}]).encode()
    metrics = b"llamacpp:spec_decode_num_draft_tokens_total 8\nllamacpp:spec_decode_num_accepted_tokens_total 6\n"
    routes = {"/slots": (200, busy), "/metrics": (200, metrics)}
    cfg = SimpleNamespace(backend_host="127.0.0.1", backend_port=0, serve=SimpleNamespace(api_key_file=None))
    b = SimpleNamespace(kind="llamacpp")
    with serve(routes) as (base, _seen):
        cfg.backend_port = int(base.rsplit(":", 1)[1])
        assert drain.slots_idle(cfg, b) is False  # type: ignore[arg-type]
        assert perf.read_spec_metrics(perf.Endpoint(base, "m")) == {"draft_tokens": 8.0, "accepted": 6.0}
        routes["/slots"] = (503, b"[]")
        routes["/metrics"] = (404, b"")
        assert drain.slots_idle(cfg, b) is None  # type: ignore[arg-type]
        assert perf.read_spec_metrics(perf.Endpoint(base, "m")) is None
    assert drain.slots_idle(cfg, b) is None  # type: ignore[arg-type]  (nothing listens any more)
