"""Benchmark the live service the way the write-up measured it, store baselines, and gate switches on them.

Method: real streaming chat completions, temperature 0, at most 512 tokens, three prompt kinds (code, math,
prose), three requests each, median, timed at the client. Token counts come from the server's `usage`
(requested with `stream_options.include_usage`); a server that sends none gets its tokens counted from the
stream's content pieces, and such figures are marked *estimated*. Speculative-decoding acceptance is read from
llama.cpp's `timings.draft_n` / `draft_n_accepted` where the server reports them.

Also: prefix-cache rounds (one long shared prefix with N different endings: the first, cold request against the
warm ones, with the cached tokens the server reports) and a needle test (a sentence buried mid-document at
chosen prompt lengths, recalled or not).

Faults never end a run: a request that stalls (no data for `timeout` seconds) or fails mid-stream is reported,
its partial figures kept and marked, and the run goes on. Only an unreachable service, a rejected API key or a
wrong model name (which every later request would meet too) stop it with a HealthError.

Baselines live in `<state_dir>/bench/<release>/<backend>.json`; `perf_gate` runs a short bench and compares.
The figures' arithmetic is in small pure functions (median, tokens_per_second, decode_rate, ttft, ratio).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import statistics
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deploy_tool.errors import HealthError, InputError, PerformanceError, StateError
from deploy_tool.fsutil import atomic_write, os_error

BASELINE_FORMAT = 1
DEFAULT_KINDS = ("code", "math", "prose")
DEFAULT_RUNS = 3
DEFAULT_MAX_TOKENS = 512
DEFAULT_TIMEOUT = 120.0
NEEDLE = "The secret access code for building 7 is MAPLE-4416."
NEEDLE_ANSWER = "MAPLE-4416"
NEEDLE_QUESTION = "What is the secret access code for building 7? Answer with the code only."

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

_FILLER = (
    "The harbour office opened at six, and the first ferry left as soon as the fog lifted from the water.",
    "Farmers brought apples, pears and late plums to the square, where the stalls stood in two long rows.",
    "In the library the clocks were wound on Mondays, and the ledgers were checked against the shelf lists.",
    "A narrow road climbed from the bridge to the old mill, passing gardens, sheds and a stone chapel.",
    "The council met on the first Thursday of each month to discuss roads, water and the winter market.",
    "Children walked to school along the canal, counting the barges and the herons on the far bank.",
    "The bakery sold rye bread in the morning and sweet rolls after noon, until the shelves were empty.",
    "Rain came in from the west most afternoons, and the gutters along the main street ran like streams.",
)

_QUESTIONS = (
    "When did the harbour office open?", "What did the farmers bring to the square?",
    "When were the library clocks wound?", "Where did the narrow road lead?",
    "When did the council meet?", "What did the children count?", "What did the bakery sell?",
    "Where did the rain come from?",
)

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

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


# --------------------------------------------------------------------------------------------- prompts

def load_prompts(path: str | Path) -> dict[str, tuple[str, ...]]:
    """Read a prompt file; it replaces the built-in sets.

    Format: a JSON object `{"kind": ["prompt", ...], ...}` (a `.json` file), or UTF-8 text where a line
    `## kind` starts a kind and a line `---` separates prompts; text without any `## ` line is one kind named
    after the file's stem.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except IsADirectoryError:
        raise InputError(f"prompt file {p} is a directory", hint="pass a text or JSON file to --prompts") from None
    except OSError as exc:
        raise os_error(exc, f"cannot read prompt file {p}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"prompt file {p} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                         hint="save it as UTF-8") from None
    if not text.strip():
        raise InputError(f"prompt file {p} is empty", hint="put at least one prompt in it, or drop --prompts "
                         "to use the built-in code/math/prose sets")
    sets: dict[str, list[str]] = {}
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InputError(f"prompt file {p} is not valid JSON: {exc}",
                             hint='write {"kind": ["prompt", ...]}') from None
        if not isinstance(data, dict):
            raise InputError(f"prompt file {p}: expected a JSON object of kind -> list of prompts",
                             hint='write {"kind": ["prompt", ...]}')
        for key, prompts in data.items():
            if isinstance(prompts, str):
                prompts = [prompts]
            if not isinstance(prompts, list) or not all(isinstance(x, str) for x in prompts):
                raise InputError(f"prompt file {p}: kind {key!r} must map to a list of strings",
                                 hint='write {"kind": ["prompt", ...]}')
            sets[str(key)] = [x.strip() for x in prompts if x.strip()]
    else:
        kind: str | None = None
        current: list[str] = []

        def flush() -> None:
            block = "\n".join(current).strip()
            if block:
                sets.setdefault(kind or p.stem, []).append(block)
            current.clear()

        for line in text.splitlines():
            if line.startswith("## "):
                flush()
                kind = line[3:].strip()
                sets.setdefault(kind, [])
            elif line.strip() == "---":
                flush()
            else:
                current.append(line)
        flush()
    empty = [k for k, v in sets.items() if not v]
    if empty or not sets:
        what = f"kind {empty[0]!r} has no prompts" if empty else "it holds no prompts"
        raise InputError(f"prompt file {p}: {what}", hint="give every kind at least one prompt")
    for k in sets:
        _check_name(k, "prompt kind")
    return {k: tuple(v) for k, v in sets.items()}


def select_kinds(prompts: Mapping[str, Sequence[str]], kinds: Sequence[str] | None) -> list[str]:
    """The kinds to run, in the order asked for (default: all kinds of the set)."""
    if not kinds:
        return list(prompts)
    missing = [k for k in kinds if k not in prompts]
    if missing:
        raise InputError(f"unknown prompt kind {missing[0]!r}", hint=f"the kinds are: {', '.join(prompts)}")
    return list(dict.fromkeys(kinds))


def filler_words(n_words: int, *, start: int = 0) -> str:
    """Deterministic document text of exactly `n_words` words (the filler sentences in turn)."""
    out: list[str] = []
    i = start
    while len(out) < n_words:
        out.extend(_FILLER[i % len(_FILLER)].split())
        i += 1
    return " ".join(out[:n_words])


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


def _headers(ep: Endpoint) -> dict[str, str]:
    h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if ep.api_key:
        h["Authorization"] = f"Bearer {ep.api_key}"
    return h


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
    req = urllib.request.Request(ep.chat_url, data=json.dumps(body).encode(), headers=_headers(ep),
                                 method="POST")
    t_send = clock()
    t_first: float | None = None
    t_last: float | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    parts: list[str] = []
    try:
        resp = _OPENER.open(req, timeout=ep.timeout)
    except urllib.error.HTTPError as exc:
        text = exc.read(500).decode("utf-8", "replace").strip()
        fatal = _fatal_http(ep, exc.code, text)
        if fatal:
            raise fatal from None
        res.error = f"HTTP {exc.code}: {text[:200]}"
        res.total_s = clock() - t_send
        return res
    except TimeoutError:
        res.error = f"no answer within {ep.timeout:g}s (timeout)"
        res.partial = True
        res.total_s = clock() - t_send
        return res
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise HealthError(f"cannot reach the service at {ep.base_url}: {reason}",
                          hint="is the backend running and bound to serve.host/serve.port? "
                               "(`deploytool status`)") from None
    done = False
    try:
        with resp:
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
                    done = True
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
                now = clock()
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if piece:
                        if t_first is None:
                            t_first = now
                        t_last = now
                        res.pieces += 1
                        if delta.get("content"):
                            parts.append(delta["content"])
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                if isinstance(chunk.get("timings"), dict):
                    timings = chunk["timings"]
    except TimeoutError:
        res.error = f"stalled: no data for {ep.timeout:g}s after {res.pieces} pieces"
    except (OSError, ValueError) as exc:  # connection reset, chunked-encoding errors
        res.error = f"connection broke after {res.pieces} pieces: {exc}"
    t_end = clock()
    res.content = "".join(parts)
    res.total_s = t_end - t_send
    res.ttft_s = ttft(t_send, t_first)
    if res.error is None and not done and res.finish_reason is None:
        res.error = f"stream ended without [DONE] after {res.pieces} pieces"
    res.ok = res.error is None
    res.partial = not res.ok
    if usage is not None:
        res.completion_tokens = _int(usage.get("completion_tokens"))
        res.prompt_tokens = _int(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            res.cached_tokens = _int(details.get("cached_tokens"))
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
    if t_first is not None and t_last is not None:
        res.decode_s = t_last - t_first
    res.tokens_per_s = decode_rate(res.completion_tokens, t_first, t_last, res.pieces)
    res.e2e_tokens_per_s = tokens_per_second(res.completion_tokens, res.total_s)
    return res


_SPEC_METRICS = {"llamacpp:spec_decode_num_draft_tokens_total": "draft_tokens",
                 "llamacpp:spec_decode_num_accepted_tokens_total": "accepted"}


def read_spec_metrics(ep: Endpoint, *, timeout: float = 5.0) -> dict[str, float] | None:
    """llama-server's speculative-decoding counters from `/metrics` (started with --metrics); None when the
    server has no such endpoint or reports no such counters (ftllm, llama-server without --metrics)."""
    req = urllib.request.Request(ep.base_url.rstrip("/") + "/metrics", headers=_headers(ep))
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            text = resp.read(1 << 20).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
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


@dataclass
class PrefixResult:
    prefix_tokens: int | None  # prompt tokens of the first round
    rounds: list[RequestResult]
    first_s: float | None  # TTFT of the cold round
    warm_s: float | None  # median TTFT of the warm rounds
    first_total_s: float | None
    warm_total_s: float | None
    cached_tokens: float | None  # median cached tokens of the warm rounds (None: the server does not say)
    speedup: float | None  # first_s / warm_s
    partial: bool

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "rounds"}
        d["rounds"] = [r.to_json(content_chars=60) for r in self.rounds]
        return d


@dataclass
class NeedleResult:
    target_tokens: int
    prompt_tokens: int | None
    recalled: bool
    ttft_s: float | None
    prefill_tokens_per_s: float | None  # prompt tokens over TTFT
    answer: str
    partial: bool
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BenchResult:
    backend: str
    release: str
    base_url: str
    model: str
    started: str
    settings: dict[str, Any]
    requests: list[RequestResult] = field(default_factory=list)
    kinds: dict[str, KindSummary] = field(default_factory=dict)
    prefix: PrefixResult | None = None
    needle: list[NeedleResult] = field(default_factory=list)
    spec_metrics: dict[str, Any] | None = None  # draft acceptance from /metrics over the kinds' requests
    seconds: float = 0.0

    @property
    def partial(self) -> bool:
        return (any(not r.ok for r in self.requests) or bool(self.prefix and self.prefix.partial)
                or any(n.partial for n in self.needle))

    @property
    def estimated(self) -> bool:
        return any(s.estimated for s in self.kinds.values())

    def figures(self) -> dict[str, dict[str, Any]]:
        """Per kind: the median decode tokens/s and TTFT, marked estimated/partial: what baselines keep."""
        return {k: {"tokens_per_s": s.tokens_per_s, "ttft_s": s.ttft_s, "e2e_tokens_per_s": s.e2e_tokens_per_s,
                    "acceptance": s.acceptance, "estimated": s.estimated, "partial": s.partial}
                for k, s in self.kinds.items()}

    def to_json(self) -> dict[str, Any]:
        return {"format": BASELINE_FORMAT, "backend": self.backend, "release": self.release,
                "base_url": self.base_url, "model": self.model, "started": self.started,
                "settings": self.settings, "seconds": round(self.seconds, 3), "partial": self.partial,
                "estimated": self.estimated, "figures": self.figures(),
                "kinds": {k: s.to_json() for k, s in self.kinds.items()},
                "requests": [r.to_json() for r in self.requests],
                "prefix": self.prefix.to_json() if self.prefix else None,
                "needle": [n.to_json() for n in self.needle], "spec_metrics": self.spec_metrics}


# --------------------------------------------------------------------------------------------- runs

def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def calibrate(ep: Endpoint, *, clock: Clock = time.perf_counter) -> float:
    """Prompt tokens per filler word on this server (two one-token requests); 1.3 when it reports no usage."""
    words = 200
    a = stream_chat(ep, _user("Hi."), kind="calibrate", max_tokens=1, clock=clock)
    b = stream_chat(ep, _user("Hi. " + filler_words(words)), kind="calibrate", max_tokens=1, clock=clock)
    if a.prompt_tokens is None or b.prompt_tokens is None or b.prompt_tokens <= a.prompt_tokens:
        return 1.3
    n = len(filler_words(words).split())
    return (b.prompt_tokens - a.prompt_tokens) / n


def run_prefix(ep: Endpoint, *, rounds: int, prefix_tokens: int, max_tokens: int = 16,
               tokens_per_word: float | None = None, on_event: OnEvent = lambda s: None,
               clock: Clock = time.perf_counter) -> PrefixResult:
    """One long shared prefix (made unique per run, so the first round is cold) with `rounds` endings."""
    tpw = tokens_per_word or calibrate(ep, clock=clock)
    nonce = uuid.uuid4().hex[:12]
    doc = f"Document {nonce}.\n" + filler_words(max(1, int(prefix_tokens / tpw)))
    out: list[RequestResult] = []
    for i in range(rounds):
        ending = f"\n\nQuestion {i + 1}: {_QUESTIONS[i % len(_QUESTIONS)]} Answer in one sentence."
        r = stream_chat(ep, _user(doc + ending), kind="prefix", index=i, max_tokens=max_tokens, clock=clock)
        out.append(r)
        on_event(f"prefix {i + 1}/{rounds}: ttft {_fmt_s(r.ttft_s)}, cached {r.cached_tokens}"
                 + ("" if r.ok else f" ({r.error})"))
    first = out[0] if out else None
    warm = out[1:]
    return PrefixResult(prefix_tokens=first.prompt_tokens if first else None, rounds=out,
                        first_s=first.ttft_s if first else None, warm_s=median(r.ttft_s for r in warm),
                        first_total_s=first.total_s if first else None,
                        warm_total_s=median(r.total_s for r in warm),
                        cached_tokens=median(r.cached_tokens for r in warm),
                        speedup=ratio(first.ttft_s if first else None, median(r.ttft_s for r in warm)),
                        partial=any(not r.ok for r in out))


def needle_prompt(target_tokens: int, tokens_per_word: float, *, nonce: str = "") -> str:
    """A document of about `target_tokens` prompt tokens with NEEDLE in the middle, then the question."""
    head_line = f"Read this document{' ' + nonce if nonce else ''}."
    fixed = len(head_line.split()) + len(NEEDLE.split()) + len(NEEDLE_QUESTION.split())
    words = max(2, int((target_tokens - 10) / tokens_per_word) - fixed)  # ~10 tokens of chat template
    half = words // 2
    return f"{head_line}\n\n{filler_words(half)} {NEEDLE} {filler_words(words - half, start=3)}\n\n{NEEDLE_QUESTION}"


def run_needle(ep: Endpoint, lengths: Sequence[int], *, max_tokens: int = 32, tokens_per_word: float | None = None,
               on_event: OnEvent = lambda s: None, clock: Clock = time.perf_counter) -> list[NeedleResult]:
    """The needle test at each length: recall = the answer contains MAPLE-4416."""
    tpw = tokens_per_word or calibrate(ep, clock=clock)
    out: list[NeedleResult] = []
    for n in lengths:
        prompt = needle_prompt(n, tpw, nonce=uuid.uuid4().hex[:12])
        r = stream_chat(ep, _user(prompt), kind="needle", max_tokens=max_tokens, clock=clock)
        res = NeedleResult(target_tokens=n, prompt_tokens=r.prompt_tokens, recalled=NEEDLE_ANSWER in r.content,
                           ttft_s=r.ttft_s, prefill_tokens_per_s=tokens_per_second(r.prompt_tokens, r.ttft_s),
                           answer=r.content[:120], partial=not r.ok, error=r.error)
        out.append(res)
        on_event(f"needle {n}: {r.prompt_tokens} prompt tokens, "
                 f"{'recalled' if res.recalled else 'NOT recalled'}" + ("" if r.ok else f" ({r.error})"))
    return out


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_bench(ep: Endpoint, *, backend: str, release: str, kinds: Sequence[str] | None = None, runs: int = DEFAULT_RUNS,
              max_tokens: int = DEFAULT_MAX_TOKENS, prompts: Mapping[str, Sequence[str]] | None = None,
              prefix_rounds: int = 0, prefix_tokens: int = 4096, needle_lengths: Sequence[int] = (),
              warmup: int = 0, on_event: OnEvent = lambda s: None,
              clock: Clock = time.perf_counter) -> BenchResult:
    """The write-up's method: `runs` requests per kind (cycling through the kind's prompts), medians per kind;
    then the prefix-cache rounds and the needle lengths, if asked for. `warmup` short requests go first and
    are not counted (a freshly started server's first answers are slow)."""
    if runs < 1:
        raise InputError(f"--runs must be at least 1 (got {runs})")
    if max_tokens < 2:
        raise InputError(f"--max-tokens must be at least 2 (got {max_tokens}): a decode rate needs two tokens")
    if prefix_rounds < 0 or prefix_rounds == 1:
        raise InputError(f"--prefix-rounds must be 0 (off) or at least 2 (got {prefix_rounds}): "
                         "the first round is cold, the others warm")
    if any(n < 64 for n in needle_lengths):
        raise InputError("needle lengths must be at least 64 prompt tokens", hint="e.g. --needle 1000,4000")
    prompts = prompts or PROMPTS
    kinds_list = select_kinds(prompts, kinds)
    t0 = clock()
    result = BenchResult(backend=backend, release=release, base_url=ep.base_url, model=ep.model,
                         started=now_iso(),
                         settings={"kinds": kinds_list, "runs": runs, "max_tokens": max_tokens, "temperature": 0,
                                   "timeout_s": ep.timeout, "prompts": "built-in" if prompts is PROMPTS else "file",
                                   "prefix_rounds": prefix_rounds, "prefix_tokens": prefix_tokens,
                                   "needle": list(needle_lengths), "warmup": warmup})
    for i in range(warmup):
        w = stream_chat(ep, _user(prompts[kinds_list[0]][0]), kind="warmup", index=i, max_tokens=16, clock=clock)
        on_event(f"warm-up {i + 1}/{warmup}: {'ok' if w.ok else w.error}")
    total = len(kinds_list) * runs
    done = 0
    metrics_before = read_spec_metrics(ep)
    for kind in kinds_list:
        kind_results: list[RequestResult] = []
        for i in range(runs):
            text = prompts[kind][i % len(prompts[kind])]
            r = stream_chat(ep, _user(text), kind=kind, index=i, max_tokens=max_tokens, clock=clock)
            kind_results.append(r)
            done += 1
            mark = "~" if r.tokens_estimated else ""
            note = "" if r.ok else f"  ({r.error}; partial results kept)"
            on_event(f"[{done}/{total}] {kind} #{i + 1}: {mark}{_fmt_num(r.tokens_per_s)} tok/s, "
                     f"ttft {_fmt_s(r.ttft_s)}, {mark}{r.completion_tokens} tokens{note}")
        result.requests.extend(kind_results)
        result.kinds[kind] = summarize(kind, kind_results)
    if metrics_before is not None:
        result.spec_metrics = metrics_acceptance(metrics_before, read_spec_metrics(ep))
    tpw: float | None = None
    if prefix_rounds or needle_lengths:
        tpw = calibrate(ep, clock=clock)
    if prefix_rounds:
        result.prefix = run_prefix(ep, rounds=prefix_rounds, prefix_tokens=prefix_tokens, tokens_per_word=tpw,
                                   on_event=on_event, clock=clock)
    if needle_lengths:
        result.needle = run_needle(ep, needle_lengths, tokens_per_word=tpw, on_event=on_event, clock=clock)
    result.seconds = clock() - t0
    return result


def _fmt_num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


# --------------------------------------------------------------------------------------------- baselines

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def _check_name(name: str, what: str) -> str:
    if not _NAME.match(name):
        raise InputError(f"{what} {name!r} cannot name a baseline file",
                         hint="use letters, digits, '.', '_', '+' and '-' only")
    return name


def baseline_path(state_dir: str | Path, release: str, backend: str) -> Path:
    return Path(state_dir) / "bench" / _check_name(release, "release") / f"{_check_name(backend, 'backend')}.json"


def save_baseline(state_dir: str | Path, result: BenchResult) -> Path:
    """Store `result` as the baseline of (its release, its backend), atomically; a run with failed or stalled
    requests is refused (a baseline must come from a clean run)."""
    failed = [r for r in result.requests if not r.ok]
    if failed:
        raise PerformanceError(f"baseline not saved: {len(failed)} of {len(result.requests)} requests failed or "
                               f"stalled ({failed[0].kind}: {failed[0].error})",
                               hint="fix the service and run `deploytool bench --save-baseline` again")
    path = baseline_path(state_dir, result.release, result.backend)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, f"cannot create {path.parent}") from None
    atomic_write(path, (json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n").encode())
    return path


def _read_baseline(path: Path) -> dict[str, Any]:
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
    return _read_baseline(path)


def list_baselines(state_dir: str | Path) -> list[dict[str, Any]]:
    """Every stored baseline, sorted by (release, backend); unreadable ones are skipped."""
    root = Path(state_dir) / "bench"
    out = []
    for p in sorted(root.glob("*/*.json")):
        try:
            out.append(_read_baseline(p))
        except (StateError, InputError, OSError):  # a broken file must not stop listing the others
            continue
    return out


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


# --------------------------------------------------------------------------------------------- report

def format_table(result: BenchResult, comparison: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The figures for people: one row per kind, then prefix-cache and needle lines; `~` marks estimated
    token counts, `!` partial figures."""
    lines = [f"bench {result.backend} (release {result.release}) at {result.base_url}, model {result.model}: "
             f"{result.settings['runs']} run(s) per kind, max_tokens {result.settings['max_tokens']}, "
             f"temperature 0, medians"]
    head = (f"{'kind':<10} {'ok':>5} {'tok/s':>9} {'ttft':>9} {'e2e tok/s':>10} {'tokens':>7} {'cached':>7} "
            f"{'accept':>7}")
    if comparison:
        head += f" {'baseline':>9} {'change':>8}"
    lines.append(head)
    for kind, s in result.kinds.items():
        m = ("~" if s.estimated else "") + ("!" if s.partial else "")
        row = (f"{kind:<10} {f'{s.ok}/{s.requests}':>5} {m + _fmt_num(s.tokens_per_s):>9} "
               f"{_fmt_s(s.ttft_s):>9} {m + _fmt_num(s.e2e_tokens_per_s):>10} "
               f"{m + _fmt_num(s.completion_tokens, 0):>7} {_fmt_num(s.cached_tokens, 0):>7} "
               f"{'-' if s.acceptance is None else f'{s.acceptance * 100:.1f}%':>7}")
        if comparison:
            c = comparison.get(kind) or {}
            r = c.get("ratio")
            star = "*" if c.get("metric") == "e2e" else ""
            row += (f" {star + _fmt_num(c.get('baseline_tokens_per_s')):>9} "
                    f"{'-' if r is None else f'{(r - 1) * 100:+.1f}%':>8}")
        lines.append(row)
    if comparison and any(c.get("metric") == "e2e" for c in comparison.values()):
        lines.append("  * compared end to end: a decode rate was missing on one side (pieces sent in one burst)")
    failed = [r for r in result.requests if not r.ok]
    for r in failed:
        lines.append(f"  ! {r.kind} #{r.index + 1}: {r.error} (partial: {r.completion_tokens} tokens kept)")
    if any((s.cached_tokens or 0) > 0 for s in result.kinds.values()):
        lines.append("  cached: prompt tokens the server took from its cache (a repeated prompt): ttft is warm")
    if result.estimated:
        lines.append("  ~ estimated: the server sent no usage; tokens counted from the stream's pieces")
    sm = result.spec_metrics
    if sm and sm.get("draft_tokens"):
        lines.append(f"draft acceptance (/metrics): {sm['acceptance'] * 100:.1f}% of {sm['draft_tokens']} drafted "
                     "tokens")
    if result.prefix:
        p = result.prefix
        lines.append(f"prefix cache: {p.prefix_tokens} prompt tokens, {len(p.rounds)} rounds: first ttft "
                     f"{_fmt_s(p.first_s)}, warm median {_fmt_s(p.warm_s)} "
                     f"(x{_fmt_num(p.speedup)}), cached tokens {_fmt_num(p.cached_tokens, 0)}"
                     + (" ! partial" if p.partial else ""))
    for n in result.needle:
        lines.append(f"needle {n.target_tokens}: {n.prompt_tokens} prompt tokens, "
                     f"{'recalled' if n.recalled else 'NOT recalled'}, ttft {_fmt_s(n.ttft_s)}, prefill "
                     f"{_fmt_num(n.prefill_tokens_per_s)} tok/s" + (f" ! {n.error}" if n.partial else "")
                     + ("" if n.recalled else f"; answer {n.answer[:40]!r}"))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- gate

def endpoint_for(cfg: Any, *, timeout: float = DEFAULT_TIMEOUT, max_request_s: float | None = None) -> Endpoint:
    """The live service of `cfg` (serve.host/port/model_name, the API key from serve.api_key_file)."""
    from deploy_tool import gate

    return Endpoint(base_url=gate.base_url(cfg), model=cfg.serve.model_name, api_key=gate.api_key(cfg),
                    timeout=timeout, max_request_s=max_request_s)


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


def perf_gate(cfg: Any, backend_name: str, release: str, *, fraction: float, max_tokens: int = 128,
              runs: int = 1, warmup: int = 1, timeout: float = 60.0, on_event: OnEvent = lambda s: None,
              endpoint: Endpoint | None = None) -> tuple[bool, dict[str, Any], str]:
    """A short bench (`runs` per kind, `max_tokens`) compared with the stored baseline of (release, backend).

    Not ok when any kind's median decode tokens/s falls below `fraction` of the baseline's, or a request failed
    or stalled. No baseline -> ok, with a message saying the gate was skipped. Returns (ok, figures, message);
    figures hold per kind the current and baseline tokens/s and their ratio.
    """
    if not 0 < fraction <= 10:
        raise InputError(f"performance gate fraction {fraction!r} must be a number above 0 (e.g. 0.8)")
    state_dir = cfg.paths.state_dir
    base = load_baseline(state_dir, release, backend_name)
    if base is None:
        return True, {}, (f"performance gate skipped: no baseline for {backend_name} in release {release} "
                          "(save one with `deploytool bench --save-baseline`)")
    kinds = [k for k in base["figures"] if k in PROMPTS] or list(DEFAULT_KINDS)
    budget = request_budget(base["figures"], fraction=fraction, max_tokens=max_tokens)
    if budget is not None:
        timeout = min(timeout, budget)
        on_event(f"performance gate: each request must finish within {budget:.1f}s (twice what {fraction:.2f} "
                 "of the baseline pace needs)")
    ep = endpoint or endpoint_for(cfg, timeout=timeout, max_request_s=budget)
    res = run_bench(ep, backend=backend_name, release=release, kinds=kinds, runs=runs, max_tokens=max_tokens,
                    warmup=warmup, on_event=on_event)
    cmp = compare(res.figures(), base["figures"])
    low = {k: c for k, c in cmp.items() if c["ratio"] is not None and c["ratio"] < fraction}
    failed = [r for r in res.requests if not r.ok]
    parts = []
    for k, c in cmp.items():
        est = "~" if c["estimated"] else ""
        e2e = " e2e" if c["metric"] == "e2e" else ""
        parts.append(f"{k} {est}{_fmt_num(c['tokens_per_s'])}{e2e} tok/s vs baseline "
                     f"{_fmt_num(c['baseline_tokens_per_s'])} ({_fmt_num(c['ratio'], 2)})")
    figures = {"fraction": fraction, "release": release, "backend": backend_name, "kinds": cmp,
               "failed": [f"{r.kind}: {r.error}" for r in failed], "baseline_started": base.get("started")}
    ok = not low and not failed
    if ok:
        msg = f"performance gate passed (>= {fraction:.2f} of baseline): " + "; ".join(parts)
    else:
        why = []
        if low:
            why.append("below " + f"{fraction:.2f} of baseline: " + ", ".join(sorted(low)))
        if failed:
            why.append(f"{len(failed)} request(s) failed: {failed[0].kind}: {failed[0].error}")
        msg = "performance gate failed (" + "; ".join(why) + "): " + "; ".join(parts)
    return ok, figures, msg
