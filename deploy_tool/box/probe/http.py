"""The probes' one HTTP client: one opener, one way to send a request and to say what went wrong.

Standard library only (urllib, http.client). The backends bind 127.0.0.1 (or a local address), so a probe is never
routed through an http_proxy from the environment: the opener has no proxies. Every request has a timeout.

An HTTP answer, whatever its status, is an answer: `send` returns it (a 2xx answer still to be read, or urllib's
HTTPError for any other status, which reads the same way) and `request` returns it read whole as a `Response`.
No HTTP answer at all (refused, timed out, reset, ...) is an `Unreachable` with a named reason.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Servers bind 127.0.0.1: never route probes through an http_proxy from the environment.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Response:
    """One HTTP answer read whole."""

    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return ok(self.status)

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8", "replace"))

    def text(self, limit: int = 200) -> str:
        return self.body.decode("utf-8", "replace").strip()[:limit]


class Unreachable(Exception):
    """No HTTP answer at all: `reason` is connection-refused, timeout, connection-reset or connection-error.

    `detail` says it with the URL ("connection refused: URL"); `cause` is what the network said (urllib's reason,
    or the error itself); `sent` is True when the request had gone out whole and the fault came while waiting for
    (or reading) the answer, False when it never got that far (no connection, or the connect timed out)."""

    def __init__(self, reason: str, detail: str, *, cause: object = None, sent: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.cause = cause
        self.sent = sent


def ok(status: int) -> bool:
    """A 2xx status: the one kind of answer urllib hands over without an HTTPError."""
    return 200 <= status < 300


def classify(exc: object, url: str, *, sent: bool = False, cause: object = None) -> Unreachable:
    """What a network fault means, as an Unreachable with a named reason (`cause`: what to name as the fault,
    `exc` itself by default)."""
    cause = exc if cause is None else cause
    if isinstance(exc, ConnectionRefusedError):
        return Unreachable("connection-refused", f"connection refused: {url}", cause=cause, sent=sent)
    if isinstance(exc, socket.timeout | TimeoutError):
        return Unreachable("timeout", f"no answer in time: {url}", cause=cause, sent=sent)
    if isinstance(exc, ConnectionResetError | ConnectionAbortedError | BrokenPipeError):
        return Unreachable("connection-reset", f"connection reset: {url}", cause=cause, sent=sent)
    return Unreachable("connection-error", f"{url}: {exc}", cause=cause, sent=sent)


def send(method: str, url: str, *, timeout: float, api_key: str | None = None,
         body: Mapping[str, Any] | None = None, headers: Mapping[str, str] | None = None) -> Any:
    """Send one request and return the answer still to be read: file-like, with `.status`, `read()` and
    `close()` (a context manager). `body` goes as JSON; `headers` add to (or replace) the JSON Accept header; the
    API key goes as a bearer token. Raises Unreachable when no HTTP answer came."""
    hdrs = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        hdrs["Content-Type"] = "application/json"
    hdrs.update(headers or {})
    if api_key:
        hdrs["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        return OPENER.open(req, timeout=max(timeout, 0.001))
    except urllib.error.HTTPError as exc:
        return exc  # an answer too: its status and body read like a 2xx answer's
    except urllib.error.URLError as exc:  # urllib wraps what failed before the request went out
        raise classify(exc.reason, url) from exc
    except (OSError, http.client.HTTPException) as exc:
        raise _sent(exc, url) from exc


def request(method: str, url: str, *, timeout: float, api_key: str | None = None,
            body: Mapping[str, Any] | None = None, headers: Mapping[str, str] | None = None,
            limit: int | None = None) -> Response:
    """Send one request (as `send`) and read its answer whole (at most `limit` bytes). An answer whose body
    cannot be read is Unreachable when it was a 2xx, an empty body otherwise (the status says enough)."""
    resp = send(method, url, timeout=timeout, api_key=api_key, body=body, headers=headers)
    status = int(resp.status)
    try:
        payload = resp.read() if limit is None else resp.read(limit)
    except (OSError, http.client.HTTPException) as exc:
        if ok(status):
            raise _sent(exc, url) from exc
        payload = b""
    finally:
        resp.close()
    return Response(status, payload)


def _sent(exc: BaseException, url: str) -> Unreachable:
    return classify(exc, url, sent=True, cause=getattr(exc, "reason", exc))
