"""Health probes for the two inference servers: wait until ready, then prove one real chat completion.

Readiness differs between the servers (both facts measured on the real programs):

* llama.cpp `llama-server` opens its port before the model is loaded; `GET /health` answers
  503 `Loading model` until it is ready, then 200 `{"status":"ok"}`. `/v1/models` answers 200 even while
  loading, so it is read only after `/health` says 200, to check the served name (`--alias`).
* FastLLM `ftllm server` keeps its port closed (connection refused) until the model is loaded and warmed up;
  then `GET /v1/models` answers 200. It has no `/health` (404).

Both must list the configured model name in `/v1/models`; a server that serves another name is a failure
("serves model X, expected Y"), since clients address the model by name.

While waiting, an optional `unit_state()` callback is polled on every attempt: a unit (or process) that is
failed, inactive, exited or restarting ends the wait at once with the journal tail. ftllm exits with
status 0 on an unsupported model architecture: that is a failure too, whatever the exit status.

The retry policy is `retry.ready` (deploytool's tenacity policies, in one place), with an injectable clock
and sleep so tests drive it with a fake clock and never wait for real time. HTTP goes through the probes' one
client (deploy_tool.box.probe.http: the standard library only, a timeout on every request, no proxy: servers bind
127.0.0.1).

Every failure is a `HealthError` whose `details["reason"]` names what went wrong (see `REASONS`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from deploy_tool.config import Config

from deploy_tool import retry
from deploy_tool.box.probe import http
from deploy_tool.errors import HealthError

Kind = Literal["ftllm", "llamacpp"]
KINDS: tuple[str, ...] = ("ftllm", "llamacpp")

#: Every reason a failed start, gate or switch names in its error's `details["reason"]` (`--json`'s `details`,
#: the fleet modules' `reason`): this module's, then the gate's (deploy_tool.box.probe.gate) and the switch's
#: (deploy_tool.box.switch). tests/test_health.py holds every reason the code raises to this table, and the exit
#: codes page (docs/reference/exit-codes.md) shows it.
REASONS: dict[str, str] = {
    "timeout": "the server did not become ready (or did not answer) in time",
    "connection-refused": "nothing listens on the port",
    "connection-reset": "the server closed the connection without an answer",
    "connection-error": "the connection failed some other way (the error says how)",
    "unit-failed": "the unit or process failed while we waited",
    "unit-exited": "the unit or process exited (even with status 0) while we waited",
    "wrong-model": "the server serves another model name than the configured one",
    "unauthorized": "the server wants an API key (or another one)",
    "not-this-server": "the endpoint does not behave like the expected server kind",
    "empty-content": "the completion's content is empty",
    "stray-think": "the completion's content holds a stray `</think>` (reasoning leaked into content)",
    "no-usage": "the completion has no usable `usage` token counts",
    "bad-response": "the server answered something that is not the expected JSON",
    "gpu-missing": "a cuda server does not hold the GPUs of host.gpus: its CUDA init failed and it would serve on the "
                   "CPU (GpuError, exit 30)",
    "runtime-truth": "the server is up but maps libraries other than its release's pins (RuntimeTruthError, exit 18)",
    "start-job": "the server answered the gate, but its unit's start job (the ExecStartPost readiness wait) did not "
                 "end active",
    "restarted": "systemd restarted the unit after the gate's checks: the server they checked has exited",
    "port-taken": "another process holds the backend port",
    "refused-by-check": "the unit's ExecStartPre check refused to start it (e.g. drifted fingerprints, an unsafe path)",
    "performance": "the performance gate measured the target below its baseline (PerformanceError, exit 19)",
    "config-differs": "the box's config differs from the one the installed release was packed with, which its units "
                      "run: refused at the preflight, nothing stopped (DriftError, exit 7)",
    # plus "http-<code>" for any other unexpected HTTP status, e.g. "http-404", "http-500"
}

STRAY_THINK = "</think>"
DEAD_ACTIVE_STATES = frozenset({"failed", "inactive", "deactivating"})
#: A unit in these sub-states has not executed its server yet: its start job is queued ("queued": what
#: deploytool's gate reports for a unit with a start job still waiting), or it runs its condition checks or
#: ExecStartPre (systemd's "condition", "start-pre").
NOT_STARTED_SUB_STATES = frozenset({"queued", "condition", "start-pre"})
DEAD_SUB_STATES = frozenset({"failed", "exited", "dead", "auto-restart", "stop", "stop-sigterm",
                             "stop-sigkill", "final-sigterm", "final-sigkill"})


@dataclass(frozen=True)
class UnitSnapshot:
    """What the waiter needs to know about the unit (or process) that runs the server, at one moment.

    Field names follow `systemctl show`: ActiveState, SubState, Result, ExecMainCode, ExecMainStatus.
    """

    active_state: str  # active, activating, deactivating, inactive, failed
    sub_state: str = ""  # running, start, exited, dead, failed, auto-restart, ...
    result: str = ""  # success, exit-code, signal, core-dump, timeout, ...
    exec_main_status: int | None = None  # exit status, or signal number when exec_main_code is killed/dumped
    exec_main_code: str = ""  # exited, killed, dumped
    name: str = ""  # unit name (or a label for a bare process), used in messages

    @property
    def dead(self) -> bool:
        """True when the server cannot become ready any more without being started again."""
        return self.active_state in DEAD_ACTIVE_STATES or self.sub_state in DEAD_SUB_STATES

    def describe(self) -> str:
        bits = [f"{self.active_state}/{self.sub_state}" if self.sub_state else self.active_state]
        if self.result:
            bits.append(f"result={self.result}")
        if self.exec_main_status is not None:
            what = "signal" if self.exec_main_code in ("killed", "dumped") else "status"
            bits.append(f"{what}={self.exec_main_status}")
        return ", ".join(bits)


@dataclass(frozen=True)
class ReadyReport:
    kind: str
    base_url: str
    model_name: str
    seconds: float  # time from the start of the wait until ready (by the injected clock)
    attempts: int
    served_models: tuple[str, ...] = ()


@dataclass(frozen=True)
class SmokeReport:
    base_url: str
    model_name: str
    content: str
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    finish_reason: str | None
    seconds: float
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)



def base_url(cfg: Config) -> str:
    """The backends' own endpoint, behind the front (loopback, serve.internal_port): what the gate, the smoke test,
    the perf gate, liveness and drain probe, so that nothing passes because the front answered."""
    return f"http://{cfg.backend_host}:{cfg.backend_port}"


def public_url(cfg: Config) -> str:
    """The public endpoint (the front) as a client on this box reaches it (a wildcard bind on 127.0.0.1)."""
    host = cfg.serve.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{cfg.serve.port}" if ":" in host else f"http://{host}:{cfg.serve.port}"


def api_key(cfg: Config) -> str | None:
    """The API key from serve.api_key_file (None: none configured, or the file missing or empty)."""
    if not cfg.serve.api_key_file:
        return None
    try:
        with open(cfg.serve.api_key_file, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None

def failure_reason(err: BaseException) -> str | None:
    """The named reason of a HealthError raised by this module (None for anything else)."""
    details = getattr(err, "details", None)
    if isinstance(details, Mapping):
        reason = details.get("reason")
        return str(reason) if reason is not None else None
    return None


def _fail(reason: str, message: str, *, hint: str | None = None, **extra: object) -> HealthError:
    details: dict[str, object] = {"reason": reason}
    details.update({k: v for k, v in extra.items() if v is not None})
    return HealthError(message, hint=hint, details=details)


# --------------------------------------------------------------------------------------------- answers

def _served_names(payload: Any) -> tuple[str, ...]:
    """Model names from an OpenAI-style /v1/models answer (ids plus llama.cpp's aliases)."""
    names: list[str] = []
    data = payload.get("data") if isinstance(payload, Mapping) else None
    if isinstance(data, list):
        for item in data:
            if not isinstance(item, Mapping):
                continue
            if isinstance(item.get("id"), str):
                names.append(item["id"])
            aliases = item.get("aliases")
            if isinstance(aliases, list):
                names.extend(a for a in aliases if isinstance(a, str))
    return tuple(dict.fromkeys(names))


# --------------------------------------------------------------------------------------------- waiting

class _NotReady(Exception):
    """One attempt saw a server that is not ready yet (retried until the deadline)."""

    def __init__(self, observed: str) -> None:
        super().__init__(observed)
        self.observed = observed


def _journal(journal_tail: Callable[[], str] | None, lines: int = 30) -> str | None:
    if journal_tail is None:
        return None
    try:
        text = journal_tail()
    except Exception as exc:  # the journal is evidence, never the failure itself
        return f"(journal unavailable: {exc})"
    tail = (text or "").rstrip().splitlines()[-lines:]
    return "\n".join(tail)


def with_journal(message: str, journal: str | None, *, last: int | None = None) -> str:
    """`message` with the unit's journal tail (its `last` lines, else all) indented below it."""
    if not journal:
        return message
    lines = journal.splitlines()
    return message + "\n  journal tail:\n    " + "\n    ".join(lines[-last:] if last else lines)


def _check_unit(kind: str, base: str, unit_state: Callable[[], UnitSnapshot | None] | None,
                journal_tail: Callable[[], str] | None, *, not_started_yet: bool = True) -> None:
    """Raise unit-failed / unit-exited (with the journal tail) if the server's unit is dead now; with
    `not_started_yet`, _NotReady while its server has not been executed yet (a queued start job, its
    ExecStartPre): whatever answers on the port then is not this unit's server (a switch's previous backend)."""
    if unit_state is None:
        return
    snap = unit_state()
    if snap is None:
        return
    if not snap.dead and snap.sub_state in NOT_STARTED_SUB_STATES and not_started_yet:
        raise _NotReady(f"{snap.name or 'the unit'} has not started its server yet ({snap.describe()})")
    if not snap.dead:
        return
    who = snap.name or "the server's unit"
    if snap.result == "timeout" and snap.exec_main_code != "exited":
        journal = _journal(journal_tail)
        raise _fail("timeout", with_journal(f"{kind} at {base} not ready: {who} ran out of its start timeout "
                                             f"(TimeoutStartSec=) and systemd stopped it: {snap.describe()}", journal),
                    hint="raise the backend's start timeout if the model is large, or read the server's log",
                    unit=snap.name or None, state=snap.describe(), journal_tail=journal)
    exited = snap.active_state == "inactive" or snap.sub_state in ("exited", "dead")
    clean = snap.exec_main_code in ("", "exited") and snap.exec_main_status == 0
    reason = "unit-exited" if exited and snap.result in ("", "success") else "unit-failed"
    note = " (an exit with status 0 before ready is still a failure: ftllm does this on an unsupported " \
           "model)" if clean else ""
    journal = _journal(journal_tail)
    raise _fail(reason, with_journal(f"{who} stopped before {kind} at {base} was ready: "
                                      f"{snap.describe()}{note}", journal),
                hint="read the journal tail above; fix the cause, then start it again",
                unit=snap.name or None, state=snap.describe(), journal_tail=journal,
                exec_main=snap.exec_main_code or None)


def _probe(kind: str, base: str, model_name: str, *, api_key: str | None, timeout: float,
           on_unreachable: Callable[[], None]) -> tuple[str, ...]:
    """One readiness probe: the served names when ready; _NotReady when not yet; HealthError when it never will.

    llamacpp: /health first (503 while loading); both kinds: /v1/models must list `model_name`.
    `on_unreachable` runs when nothing answers (a dead server is named at once, not at the deadline)."""
    try:
        if kind == "llamacpp":
            health = http.request("GET", f"{base}/health", timeout=timeout, api_key=api_key)
            if health.status == 503:
                raise _NotReady(f"/health 503 {health.text(80)}")
            _reject_status(kind, base, "/health", health, ok=(200,))
        models = http.request("GET", f"{base}/v1/models", timeout=timeout, api_key=api_key)
    except http.Unreachable as exc:
        on_unreachable()
        raise _NotReady(exc.detail) from exc
    if models.status == 503 or models.status >= 500:
        raise _NotReady(f"/v1/models {models.status} {models.text(80)}")
    _reject_status(kind, base, "/v1/models", models, ok=(200,))
    try:
        names = _served_names(models.json())
    except ValueError as exc:
        raise _fail("bad-response", f"{kind} at {base}: /v1/models is not JSON: {models.text()}") from exc
    if model_name not in names:
        shown = ", ".join(repr(n) for n in names) or "nothing"
        raise _fail("wrong-model", f"{kind} at {base} serves model {shown}, expected {model_name!r}",
                    hint="make the server's model name (ftllm --model_name, llama-server --alias) "
                         "match the configured model_name", served=list(names), expected=model_name)
    return names


def wait_ready(
    kind: Kind | str,
    base_url: str,
    model_name: str,
    *,
    api_key: str | None = None,
    timeout: float,
    interval: float = 0.25,
    request_timeout: float = 2.0,
    unit_state: Callable[[], UnitSnapshot | None] | None = None,
    journal_tail: Callable[[], str] | None = None,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], None] | None = None,
) -> ReadyReport:
    """Wait until the server at `base_url` is ready and serves `model_name`; raise HealthError otherwise.

    `unit_state()` is polled on every attempt (every `interval` seconds): a dead unit ends the wait at
    once. `journal_tail()` is called only on failure and its text is added to the error. `clock` and `sleep`
    default to the real ones (retry.ready, which a test mode replaces). `timeout=0` asks once, each request
    bounded by `request_timeout`.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown backend kind {kind!r}; expected one of {', '.join(KINDS)}")
    if timeout < 0 or interval <= 0:
        raise ValueError("timeout must be >= 0 and interval > 0")
    base = base_url.rstrip("/")
    poll = retry.ready(timeout, interval, retry_on=_NotReady, clock=clock, sleep=sleep)
    attempts = 0
    served: tuple[str, ...] = ()

    def check_unit() -> None:
        _check_unit(kind, base, unit_state, journal_tail)

    try:
        for attempt in poll:
            with attempt:
                attempts += 1
                check_unit()
                # timeout=0 is one look (status): its requests get their whole request_timeout, not what is left
                # of a deadline that has already passed
                served = _probe(kind, base, model_name, api_key=api_key, on_unreachable=check_unit,
                                timeout=request_timeout if timeout == 0 else
                                max(0.05, min(request_timeout, poll.left())))
    except _NotReady as exc:
        # deadline passed: one last look at the unit gives the better message if it died meanwhile
        _check_unit(kind, base, unit_state, journal_tail, not_started_yet=False)
        journal = _journal(journal_tail)
        raise _fail("timeout", with_journal(
            f"{kind} at {base} not ready after {timeout:g}s ({attempts} attempts; last: {exc.observed})",
            journal), hint="raise the health timeout if the model is large, or read the server's log",
            last=exc.observed, attempts=attempts, journal_tail=journal) from None
    return ReadyReport(kind=kind, base_url=base, model_name=model_name, seconds=poll.elapsed(),
                       attempts=attempts, served_models=served)


def _reject_status(kind: str, base: str, path: str, resp: http.Response, *, ok: tuple[int, ...]) -> None:
    if resp.status in ok:
        return
    if resp.status in (401, 403):
        raise _fail("unauthorized", f"{kind} at {base}{path} answered {resp.status}: {resp.text()}",
                    hint="set the API key the server was started with (ftllm --api_key, "
                         "llama-server --api-key / LLAMA_API_KEY)", status=resp.status)
    if resp.status == 404 and path == "/health":
        raise _fail("not-this-server", f"{kind} at {base} has no /health (404): is this really llama-server? "
                    "(ftllm has no /health)", hint="check the backend kind and port in the config",
                    status=404)
    raise _fail(f"http-{resp.status}", f"{kind} at {base}{path} answered HTTP {resp.status}: {resp.text()}",
                status=resp.status)


# --------------------------------------------------------------------------------------------- smoke test

def smoke_completion(
    base_url: str,
    model_name: str,
    *,
    api_key: str | None = None,
    timeout: float,
    max_tokens: int = 8,
    prompt: str = "Say hello.",
    clock: Callable[[], float] = time.monotonic,
) -> SmokeReport:
    """Send one real chat completion (temperature 0) naming `model_name`, and check the answer is usable.

    Fails (HealthError with a named reason) on: no connection, timeout, any HTTP error, an answer for
    another model, empty content, a stray `</think>` in content, or missing `usage` token counts.
    """
    base = base_url.rstrip("/")
    url = f"{base}/v1/chat/completions"
    body = {"model": model_name, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": max_tokens, "stream": False}
    t0 = clock()
    try:
        resp = http.request("POST", url, timeout=timeout, api_key=api_key, body=body)
    except http.Unreachable as exc:
        raise _fail(exc.reason, f"chat completion failed: {exc.detail}",
                    hint="is the server running and bound to this address?", url=url) from None
    seconds = clock() - t0
    if resp.status != 200:
        text = resp.text()
        if resp.status == 404 and "model" in text.lower() and ("exist" in text.lower() or
                                                               "not found" in text.lower()):
            raise _fail("wrong-model", f"{url}: server does not serve model {model_name!r} (404: {text})",
                        hint="make the server's model name match the configured model_name", status=404)
        if resp.status in (401, 403):
            raise _fail("unauthorized", f"{url} answered {resp.status}: {text}",
                        hint="set the API key the server was started with", status=resp.status)
        raise _fail(f"http-{resp.status}", f"{url} answered HTTP {resp.status}: {text}", status=resp.status)
    try:
        payload = resp.json()
        choice = payload["choices"][0]
        message = choice["message"]
        content = message.get("content")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise _fail("bad-response", f"{url}: not a chat completion: {resp.text()}") from exc
    served = payload.get("model")
    if isinstance(served, str) and served and served != model_name:
        raise _fail("wrong-model", f"{url}: answered as model {served!r}, expected {model_name!r}",
                    hint="make the server's model name (--model_name / --alias) match the configured one",
                    served=served, expected=model_name)
    if not isinstance(content, str) or not content.strip():
        raise _fail("empty-content", f"{url}: the completion has empty content ({resp.text()})",
                    hint="check the chat template and the model; the answer must not be empty")
    if STRAY_THINK in content:
        raise _fail("stray-think", f"{url}: the completion's content holds a stray {STRAY_THINK}: "
                    f"{content[:120]!r}",
                    hint="reasoning leaked into content: a custom --chat_template disables ftllm's "
                         "reasoning split; send enable_thinking=false or drop the template",
                    content=content[:500])
    usage = payload.get("usage")
    try:
        prompt_tokens = int(usage["prompt_tokens"])
        completion_tokens = int(usage["completion_tokens"])
        total_tokens = int(usage.get("total_tokens", prompt_tokens + completion_tokens))
    except (TypeError, KeyError, ValueError) as exc:
        raise _fail("no-usage", f"{url}: the completion has no usable usage token counts: {usage!r}",
                    hint="token counts come from usage, never from counting chunks") from exc
    if completion_tokens <= 0:
        raise _fail("no-usage", f"{url}: usage reports {completion_tokens} completion tokens for "
                    f"non-empty content")
    return SmokeReport(base_url=base, model_name=model_name, content=content, prompt_tokens=prompt_tokens,
                       completion_tokens=completion_tokens, total_tokens=total_tokens,
                       finish_reason=choice.get("finish_reason"), seconds=seconds, raw=payload)
