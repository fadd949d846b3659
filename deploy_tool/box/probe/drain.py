"""Requests in flight on the backends' internal port, and waiting until there are none before a planned stop (drain).

What counts as a request in flight does not depend on either server's API: the ESTABLISHED TCP connections whose
local end is the served port, read from /proc/net/tcp and tcp6 (deploy_tool.procfs.connections_in). The servers
bind 127.0.0.1 (or a local address) and deploytool reaches them there, so the network namespace deploytool runs in
is the servers' (the sandbox shares the host's). A client that went away leaves its server end in CLOSE_WAIT,
which does not count; deploytool's own probes are not counted either.

Those connections are the front's, one per request (`Connection: close`): a client's idle keep-alive ends at the
front. The known limit is a local process that opens the internal port itself and leaves the connection idle: it
looks like a request in flight. Two answers:
* llama-server (its /slots endpoint is on by default): when connections are open but /slots says no slot is
  processing, twice in a row `SLOTS_IDLE_S` apart, and no connection has bytes left to deliver (a finished
  answer still on its way to a slow reader keeps the drain going), the backend is drained (the open
  connections are idle).
* ftllm has no such endpoint: an idle keep-alive connection holds the drain until its bound (`--drain-timeout`,
  supervision.drain_timeout_s), after which the stop proceeds as before; the wait and what was left are
  recorded in the switch's history entry.

Time goes through deploy_tool.retry's clock and sleep, so the fast tests drive a drain on virtual time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from deploy_tool import procfs, retry
from deploy_tool.box.probe import health, http
from deploy_tool.config import Backend, Config

POLL_S = 0.2  # how often the connections are counted while draining (a /proc read: ~0.1 ms)
SLOTS_IDLE_S = 0.5  # llama-server: /slots must say idle this far apart, twice, to end a drain with connections open

Log = Callable[[str], None]


@dataclass(frozen=True)
class DrainReport:
    backend: str
    in_flight: int  # connections in flight when the drain began
    left: int  # ... when it ended (0 when drained)
    waited_s: float
    outcome: str  # "idle" (nothing in flight), "drained", "slots-idle" (only idle keep-alive left), "timeout"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def in_flight(cfg: Config) -> int:
    """Connections to the backends' port now (the front opens one per request in flight; this process's own not
    counted)."""
    return procfs.connections_in(cfg.backend_port)


def slots_idle(cfg: Config, b: Backend, *, timeout: float = 1.0) -> bool | None:
    """llama-server's own view: True when no slot is processing, False when one is, None when it cannot say
    (another kind, the endpoint off or unreachable, an answer of another shape)."""
    if b.kind != "llamacpp":
        return None
    try:
        resp = http.request("GET", f"{health.base_url(cfg)}/slots", timeout=timeout, api_key=health.api_key(cfg))
        slots = resp.json() if resp.ok else None
    except (http.Unreachable, ValueError):
        return None
    if not isinstance(slots, list) or not all(isinstance(s, dict) and "is_processing" in s for s in slots):
        return None
    return not any(bool(s["is_processing"]) for s in slots)


def drain(cfg: Config, b: Backend, timeout: float, *, log: Log = lambda s: None,
          count: Callable[[], int] | None = None, slots: Callable[[], bool | None] | None = None,
          sending: Callable[[], int] | None = None) -> DrainReport:
    """Wait until backend `b` (the one serving now) has no request in flight, at most `timeout` seconds; the
    caller stops it afterwards whatever the outcome. `count`, `slots` and `sending` default to the real
    readings."""
    count = count or (lambda: in_flight(cfg))
    slots = slots or (lambda: slots_idle(cfg, b))
    sending = sending or (lambda: procfs.connections_in(cfg.backend_port, sending=True))
    clock, sleep = retry.clock_for(), retry.sleep_for()
    t0 = clock()
    first = n = count()
    if n == 0:
        return DrainReport(b.name, 0, 0, 0.0, "idle")
    log(f"draining {b.unit}: {n} request(s) in flight; waiting up to {timeout:g}s before stopping it")
    idle_since: float | None = None
    while True:
        now = clock()
        if n == 0:
            return DrainReport(b.name, first, 0, round(now - t0, 3), "drained")
        idle = bool(slots()) and sending() == 0
        if idle:
            if idle_since is not None and now - idle_since >= SLOTS_IDLE_S:
                log(f"{b.unit}: {n} connection(s) open but no slot processing: idle keep-alive; stopping it")
                return DrainReport(b.name, first, n, round(now - t0, 3), "slots-idle")
            idle_since = idle_since if idle_since is not None else now
        else:
            idle_since = None
        if now - t0 >= timeout:
            log(f"{b.unit}: {n} request(s) still in flight after {timeout:g}s; stopping it anyway")
            return DrainReport(b.name, first, n, round(now - t0, 3), "timeout")
        sleep(max(0.0, min(POLL_S if idle_since is None else SLOTS_IDLE_S, timeout - (now - t0))))
        n = count()
