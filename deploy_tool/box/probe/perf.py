"""Throughput of the live service, measured the way the write-up did: the client (real streaming chat
completions, timed at the client), the figures' arithmetic, medians per prompt kind, and stored baselines to
compare with. The benchmark command (bench.py) and the performance gate step (gate.perf_gate) both measure
through this module.

Method: temperature 0, three prompt kinds (code, math, prose). Token counts come from the server's `usage`
(requested with `stream_options.include_usage`); a server that sends none gets its tokens counted from the
stream's content pieces, and such figures are marked *estimated*. Speculative-decoding acceptance is read from
llama.cpp's `timings.draft_n` / `draft_n_accepted` where the server reports them.

Faults never end a run: a request that stalls (no data for `timeout` seconds) or fails mid-stream is reported,
its partial figures kept and marked, and the run goes on. Only an unreachable service, a rejected API key or a
wrong model name (which every later request would meet too) stop it with a HealthError.

Baselines live in `<state_dir>/bench/<release>/<backend>.json`.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deploy_tool.box.probe import http
from deploy_tool.errors import HealthError, InputError, StateError
from deploy_tool.fsutil import os_error

BASELINE_FORMAT = 1
DEFAULT_KINDS = ("code", "math", "prose")
DEFAULT_RUNS = 3
DEFAULT_MAX_TOKENS = 512
DEFAULT_TIMEOUT = 120.0

PROMPTS: dict[str, tuple[str, ...]] = {
    "code": (
        "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals given "
        "as a list of (start, end) tuples and returns them sorted. Include type hints, a docstring and three "
        "pytest tests.",
        "Implement an LRU cache class in Python with get(key) and put(key, value) in O(1) time, without "
        "functools. Explain the data structures you use, then give the full code.",
        "Write a Bash script that finds the ten largest files under a directory given as its first argument, "
        "prints their sizes in human-readable form, and exits with status 2 when the argument is missing.",
    ),
    "math": (
        "A train leaves at 9:40 and travels 210 km at 84 km/h, stops for 18 minutes, then travels 135 km at "
        "90 km/h. At what time does it arrive? Solve step by step.",
        "Find all real solutions of x^4 - 5x^2 + 4 = 0, then compute the sum of their squares. Show every step "
        "of the work.",
        "A bag holds 5 red, 4 blue and 3 green marbles. Three are drawn without replacement. What is the "
        "probability that all three have different colours? Give the exact fraction and explain.",
    ),
    "prose": (
        "Write a short story of about 400 words about a lighthouse keeper who finds a message in a bottle "
        "written in her own handwriting.",
        "Describe a busy morning market in a coastal town, using all five senses, in three vivid paragraphs.",
        "Write a friendly letter to a neighbour apologising for a noisy weekend party and inviting them to "
        "dinner next week.",
    ),
}

Clock = Callable[[], float]
OnEvent = Callable[[str], None]


# --------------------------------------------------------------------------------------------- pure math

def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def tokens_per_second(tokens: int | None, seconds: float | None) -> float | None:
    """`tokens / seconds`; None when either is missing or the time is not positive."""
    if tokens is None or seconds is None or seconds <= 0 or tokens < 0:
        return None
    return tokens / seconds


MIN_DECODE_S = 0.005  # a shorter first-to-last span is one burst of packed pieces, not a measurable rate


def decode_rate(tokens: int | None, t_first: float | None, t_last: float | None,
                pieces: int | None = None) -> float | None:
    """Generation speed after the first piece: the tokens that came after it over the time from the first to
    the last content piece (the quantity llama.cpp reports as `timings.predicted_per_second`).

    Servers may pack several tokens into one piece (ftllm does, most of all with speculative decoding); the
    first piece is then taken to hold an average share, tokens / pieces. None with fewer than two pieces or a
    span under MIN_DECODE_S (everything arrived in one burst).
    """
    pieces = tokens if pieces is None else pieces
    if tokens is None or t_first is None or t_last is None or pieces is None or pieces < 2 or tokens < 2:
        return None
    span = t_last - t_first
    if span < MIN_DECODE_S:
        return None
    return tokens * (pieces - 1) / pieces / span


def ttft(t_send: float, t_first: float | None) -> float | None:
    """Time to first token: from sending the request to the first piece of content (not the role-only chunk)."""
    if t_first is None:
        return None
    return max(0.0, t_first - t_send)


def ratio(current: float | None, baseline: float | None) -> float | None:
    """`current / baseline`; None when either is missing or the baseline is not positive."""
    if current is None or baseline is None or baseline <= 0:
        return None
    return current / baseline


def acceptance(draft_n: int | None, accepted: int | None) -> float | None:
    """The share of drafted tokens the target model accepted; None when nothing was drafted."""
    if not draft_n or accepted is None:
        return None
    return accepted / draft_n


# --------------------------------------------------------------------------------------------- requests

@dataclass(frozen=True)
class Endpoint:
    """Where the service answers: base URL (http://host:port), the model name clients send, the API key."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = DEFAULT_TIMEOUT  # seconds without any data before a request counts as stalled
    max_request_s: float | None = None  # whole-request limit (a server trickling data slowly); None: no limit

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/chat/completions"


@dataclass
class RequestResult:
    """One streamed chat completion as seen by the client (plus what the server reported about it)."""

    kind: str
    index: int = 0
    ok: bool = False
    partial: bool = False  # ended early (stall, error); its figures cover what arrived
    error: str | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    decode_s: float | None = None  # first to last content piece
    pieces: int = 0  # content pieces received (one token each on most servers; ftllm may pack several)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    tokens_estimated: bool = False  # completion_tokens counted from pieces: the server sent no usage
    tokens_per_s: float | None = None  # decode rate (after the first token)
    e2e_tokens_per_s: float | None = None  # completion tokens over the whole request
    cached_tokens: int | None = None
    draft_n: int | None = None
    draft_accepted: int | None = None
    finish_reason: str | None = None
    content: str = ""
    server_timings: dict[str, Any] | None = None

    @property
    def acceptance(self) -> float | None:
        return acceptance(self.draft_n, self.draft_accepted)

    def to_json(self, *, content_chars: int = 200) -> dict[str, Any]:
        d = asdict(self)
        d["content"] = self.content[:content_chars]
        d["acceptance"] = self.acceptance
        return d


#: What every request of the client sends (the API key goes with it as a bearer token).
_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _fatal_http(ep: Endpoint, status: int, text: str) -> HealthError | None:
    """HTTP answers every later request would get too: stop the run with one clear message."""
    if status in (401, 403):
        return HealthError(f"{ep.chat_url} answered {status}: {text}",
                           hint="the API key is wrong or missing: check serve.api_key_file")
    if status == 404:
        return HealthError(f"{ep.chat_url} answered 404 for model {ep.model!r}: {text}",
                           hint="the configured serve.model_name must equal the server's model name")
    if status in (400, 422):
        return HealthError(f"{ep.chat_url} rejected the request ({status}): {text}",
                           hint="the prompt may be longer than the server's context; lower the lengths")
    return None


def stream_chat(ep: Endpoint, messages: list[dict[str, str]], *, kind: str = "", index: int = 0,
                max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float = 0.0,
                clock: Clock = time.perf_counter) -> RequestResult:
    """Send one streaming chat completion and time it at the client.

    A stall (no data for `ep.timeout` s), a dropped connection or a server error ends the request with
    `ok=False`, `partial=True` and the figures of what arrived; it does not raise. Raises HealthError only for
    what would fail every request (unreachable service, 401/403, 404 unknown model, 400 prompt rejected).
    """
    res = RequestResult(kind=kind, index=index)
    body = {"model": ep.model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    t_send = clock()
    resp = _send(ep, body, res, t_send, clock)
    if resp is None:
        return res
    seen = _Stream()
    try:
        with resp:
            _read_events(resp, ep, res, seen, t_send, clock)
    except TimeoutError:
        res.error = f"stalled: no data for {ep.timeout:g}s after {res.pieces} pieces"
    except (OSError, ValueError) as exc:  # connection reset, chunked-encoding errors
        res.error = f"connection broke after {res.pieces} pieces: {exc}"
    _figures(res, seen, t_send, clock())
    return res


@dataclass
class _Stream:
    """What a stream delivered: the content pieces and their times, the server's usage and timings, [DONE]."""

    t_first: float | None = None
    t_last: float | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    parts: list[str] = field(default_factory=list)
    done: bool = False


def _send(ep: Endpoint, body: dict[str, Any], res: RequestResult, t_send: float, clock: Clock) -> Any:
    """The open response; None when no stream came (`res` says why); HealthError for what fails every request."""
    try:
        resp = http.send("POST", ep.chat_url, timeout=ep.timeout, api_key=ep.api_key, body=body, headers=_HEADERS)
    except http.Unreachable as exc:
        if exc.reason == "timeout" and exc.sent:  # connected and sent, then no answer in time
            res.error = f"no answer within {ep.timeout:g}s (timeout)"
            res.partial = True
            res.total_s = clock() - t_send
            return None
        raise HealthError(f"cannot reach the service at {ep.base_url}: {exc.cause}",
                          hint="is the backend running and bound to its internal port (serve.internal_port)? "
                               "(`deploytool status`)") from None
    if http.ok(resp.status):
        return resp
    try:
        text = resp.read(500).decode("utf-8", "replace").strip()
    finally:
        resp.close()
    fatal = _fatal_http(ep, resp.status, text)
    if fatal:
        raise fatal from None
    res.error = f"HTTP {resp.status}: {text[:200]}"
    res.total_s = clock() - t_send
    return None


def _read_events(resp: Any, ep: Endpoint, res: RequestResult, seen: _Stream, t_send: float, clock: Clock) -> None:
    """Read the server-sent events until [DONE], the end of the stream, an error event or the request's limit."""
    while True:
        line = resp.readline()
        if not line:
            break
        if ep.max_request_s is not None and clock() - t_send > ep.max_request_s:
            res.error = f"exceeded {ep.max_request_s:g}s for the request after {res.pieces} pieces"
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            seen.done = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            continue
        if not isinstance(chunk, dict):
            continue
        if chunk.get("error"):
            err = chunk["error"]
            res.error = "server error mid-stream: " + (err.get("message", str(err)) if isinstance(err, dict)
                                                       else str(err))[:200]
            break
        _take_chunk(chunk, res, seen, clock())


def _take_chunk(chunk: dict[str, Any], res: RequestResult, seen: _Stream, now: float) -> None:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        if piece:
            if seen.t_first is None:
                seen.t_first = now
            seen.t_last = now
            res.pieces += 1
            if delta.get("content"):
                seen.parts.append(delta["content"])
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
    if isinstance(chunk.get("usage"), dict):
        seen.usage = chunk["usage"]
    if isinstance(chunk.get("timings"), dict):
        seen.timings = chunk["timings"]


def _figures(res: RequestResult, seen: _Stream, t_send: float, t_end: float) -> None:
    """The request's figures from what arrived: the server's token counts where it sent them, else the pieces."""
    res.content = "".join(seen.parts)
    res.total_s = t_end - t_send
    res.ttft_s = ttft(t_send, seen.t_first)
    if res.error is None and not seen.done and res.finish_reason is None:
        res.error = f"stream ended without [DONE] after {res.pieces} pieces"
    res.ok = res.error is None
    res.partial = not res.ok
    if seen.usage is not None:
        res.completion_tokens = _int(seen.usage.get("completion_tokens"))
        res.prompt_tokens = _int(seen.usage.get("prompt_tokens"))
        details = seen.usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            res.cached_tokens = _int(details.get("cached_tokens"))
    timings = seen.timings
    if timings is not None:
        res.server_timings = timings
        res.draft_n = _int(timings.get("draft_n"))
        res.draft_accepted = _int(timings.get("draft_n_accepted"))
        if res.cached_tokens is None:
            res.cached_tokens = _int(timings.get("cache_n"))
        if res.prompt_tokens is None and timings.get("prompt_n") is not None:
            res.prompt_tokens = (_int(timings.get("prompt_n")) or 0) + (_int(timings.get("cache_n")) or 0)
        if res.completion_tokens is None:
            res.completion_tokens = _int(timings.get("predicted_n"))
    if res.completion_tokens is None:
        res.completion_tokens = res.pieces
        res.tokens_estimated = True
    if seen.t_first is not None and seen.t_last is not None:
        res.decode_s = seen.t_last - seen.t_first
    res.tokens_per_s = decode_rate(res.completion_tokens, seen.t_first, seen.t_last, res.pieces)
    res.e2e_tokens_per_s = tokens_per_second(res.completion_tokens, res.total_s)


_SPEC_METRICS = {"llamacpp:spec_decode_num_draft_tokens_total": "draft_tokens",
                 "llamacpp:spec_decode_num_accepted_tokens_total": "accepted"}


def read_spec_metrics(ep: Endpoint, *, timeout: float = 5.0) -> dict[str, float] | None:
    """llama-server's speculative-decoding counters from `/metrics` (started with --metrics); None when the
    server has no such endpoint or reports no such counters (ftllm, llama-server without --metrics)."""
    try:
        resp = http.request("GET", ep.base_url.rstrip("/") + "/metrics", timeout=timeout, api_key=ep.api_key,
                            headers=_HEADERS, limit=1 << 20)
    except http.Unreachable:
        return None
    if not resp.ok:
        return None
    text = resp.body.decode("utf-8", "replace")
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _SPEC_METRICS:
            try:
                out[_SPEC_METRICS[name]] = float(value.strip())
            except ValueError:
                continue
    return out if len(out) == len(_SPEC_METRICS) else None


def metrics_acceptance(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict | None:
    """Draft tokens and accepted tokens between two /metrics readings, and their ratio."""
    if not before or not after:
        return None
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    return {"draft_tokens": int(drafted), "accepted": int(accepted), "acceptance": acceptance(int(drafted),
                                                                                             int(accepted))}


# --------------------------------------------------------------------------------------------- summaries

@dataclass
class KindSummary:
    kind: str
    requests: int
    ok: int
    tokens_per_s: float | None  # median decode rate
    ttft_s: float | None
    e2e_tokens_per_s: float | None
    completion_tokens: float | None
    acceptance: float | None
    cached_tokens: float | None  # median prompt tokens served from the server's cache (a repeated prompt)
    estimated: bool  # some token counts were counted from pieces (no usage)
    partial: bool  # some requests failed or stalled; their figures are left out of the medians if any succeeded

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(kind: str, results: Sequence[RequestResult]) -> KindSummary:
    """Medians over the successful requests of one kind (over the partial ones when none succeeded)."""
    good = [r for r in results if r.ok] or list(results)
    drafted = sum(r.draft_n or 0 for r in good)
    accepted = sum(r.draft_accepted or 0 for r in good)
    return KindSummary(
        kind=kind, requests=len(results), ok=sum(r.ok for r in results),
        tokens_per_s=median(r.tokens_per_s for r in good), ttft_s=median(r.ttft_s for r in good),
        e2e_tokens_per_s=median(r.e2e_tokens_per_s for r in good),
        completion_tokens=median(r.completion_tokens for r in good),
        acceptance=acceptance(drafted, accepted) if any(r.draft_n is not None for r in good) else None,
        cached_tokens=median(r.cached_tokens for r in good),
        estimated=any(r.tokens_estimated for r in good), partial=any(not r.ok for r in results))


# --------------------------------------------------------------------------------------------- runs

def user_message(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@dataclass
class Measurement:
    """`runs` requests of each kind and their medians per kind."""

    requests: list[RequestResult] = field(default_factory=list)
    kinds: dict[str, KindSummary] = field(default_factory=dict)
    spec_metrics: dict[str, Any] | None = None  # draft acceptance from /metrics over the kinds' requests

    def figures(self) -> dict[str, dict[str, Any]]:
        return kind_figures(self.kinds)


def kind_figures(kinds: Mapping[str, KindSummary]) -> dict[str, dict[str, Any]]:
    """Per kind: the median decode tokens/s and TTFT, marked estimated/partial: what baselines keep."""
    return {k: {"tokens_per_s": s.tokens_per_s, "ttft_s": s.ttft_s, "e2e_tokens_per_s": s.e2e_tokens_per_s,
                "acceptance": s.acceptance, "estimated": s.estimated, "partial": s.partial}
            for k, s in kinds.items()}


def measure(ep: Endpoint, prompts: Mapping[str, Sequence[str]], kinds: Sequence[str], *, runs: int,
            max_tokens: int, warmup: int = 0, on_event: OnEvent = lambda s: None,
            clock: Clock = time.perf_counter) -> Measurement:
    """`warmup` short requests (not counted: a freshly started server's first answers are slow), then `runs`
    requests per kind, cycling through the kind's prompts; medians per kind."""
    out = Measurement()
    for i in range(warmup):
        w = stream_chat(ep, user_message(prompts[kinds[0]][0]), kind="warmup", index=i, max_tokens=16, clock=clock)
        on_event(f"warm-up {i + 1}/{warmup}: {'ok' if w.ok else w.error}")
    total = len(kinds) * runs
    done = 0
    metrics_before = read_spec_metrics(ep)
    for kind in kinds:
        kind_results: list[RequestResult] = []
        for i in range(runs):
            text = prompts[kind][i % len(prompts[kind])]
            r = stream_chat(ep, user_message(text), kind=kind, index=i, max_tokens=max_tokens, clock=clock)
            kind_results.append(r)
            done += 1
            mark = "~" if r.tokens_estimated else ""
            note = "" if r.ok else f"  ({r.error}; partial results kept)"
            on_event(f"[{done}/{total}] {kind} #{i + 1}: {mark}{fmt_num(r.tokens_per_s)} tok/s, "
                     f"ttft {fmt_s(r.ttft_s)}, {mark}{r.completion_tokens} tokens{note}")
        out.requests.extend(kind_results)
        out.kinds[kind] = summarize(kind, kind_results)
    if metrics_before is not None:
        out.spec_metrics = metrics_acceptance(metrics_before, read_spec_metrics(ep))
    return out


def fmt_num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


# --------------------------------------------------------------------------------------------- baselines

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def check_name(name: str, what: str) -> str:
    if not _NAME.match(name):
        raise InputError(f"{what} {name!r} cannot name a baseline file",
                         hint="use letters, digits, '.', '_', '+' and '-' only")
    return name


def baseline_path(state_dir: str | Path, release: str, backend: str) -> Path:
    return Path(state_dir) / "bench" / check_name(release, "release") / f"{check_name(backend, 'backend')}.json"

def read_baseline(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise os_error(exc, f"cannot read baseline {path}") from None
    except ValueError:
        raise StateError(f"baseline {path} is not valid JSON",
                         hint="delete it and save a new one with `deploytool bench --save-baseline`") from None
    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT or not isinstance(data.get("figures"), dict):
        raise StateError(f"baseline {path} is not a deploytool baseline of format {BASELINE_FORMAT}",
                         hint="delete it and save a new one with `deploytool bench --save-baseline`")
    return data


def load_baseline(state_dir: str | Path, release: str, backend: str) -> dict[str, Any] | None:
    """The stored baseline of (release, backend) as saved (`figures` per kind), or None when there is none."""
    path = baseline_path(state_dir, release, backend)
    if not path.exists():
        return None
    return read_baseline(path)

def compare(current: Mapping[str, Mapping[str, Any]], baseline: Mapping[str, Mapping[str, Any]]) -> dict[str, dict]:
    """Per kind in `current`: tokens/s now and in the baseline and their ratio, TTFT likewise.

    The decode rate is compared when both sides have one (`metric: decode`); otherwise the end-to-end rate
    (`metric: e2e`, e.g. a server that sent everything in one burst)."""
    out: dict[str, dict[str, Any]] = {}
    for kind, cur in current.items():
        base = baseline.get(kind) or {}
        metric = "decode" if cur.get("tokens_per_s") and base.get("tokens_per_s") else "e2e"
        key = "tokens_per_s" if metric == "decode" else "e2e_tokens_per_s"
        out[kind] = {"metric": metric, "tokens_per_s": cur.get(key), "baseline_tokens_per_s": base.get(key),
                     "ratio": ratio(cur.get(key), base.get(key)),
                     "ttft_s": cur.get("ttft_s"), "baseline_ttft_s": base.get("ttft_s"),
                     "ttft_ratio": ratio(cur.get("ttft_s"), base.get("ttft_s")),
                     "estimated": bool(cur.get("estimated") or base.get("estimated")),
                     "partial": bool(cur.get("partial"))}
    return out


def request_budget(figures: dict[str, Any], *, fraction: float, max_tokens: int) -> float | None:
    """Seconds a gate request may take: twice what the slowest kind needs at `fraction` of its baseline pace
    (TTFT / fraction + max_tokens / (fraction * tokens/s)), plus 1 s. A request past it is already below the
    gate, so a backend slowed to a crawl fails the gate in seconds instead of trickling tokens for minutes.
    None when the baseline has no usable figures (then only the stall timeout applies)."""
    worst = 0.0
    for f in figures.values():
        tps = f.get("tokens_per_s") or f.get("e2e_tokens_per_s")
        if not tps or tps <= 0:
            continue
        worst = max(worst, ((f.get("ttft_s") or 0.0) + max_tokens / tps) / fraction)
    return round(2 * worst + 1.0, 3) if worst else None
