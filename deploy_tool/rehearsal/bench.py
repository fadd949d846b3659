"""`deploytool bench`: benchmark the live service the way the write-up measured it, and store baselines.

Method (perf.py measures): real streaming chat completions, temperature 0, at most 512 tokens, three prompt
kinds (code, math, prose), three requests each, median, timed at the client; estimated and partial figures are
marked. A prompt file may replace the built-in sets.

Also: prefix-cache rounds (one long shared prefix with N different endings: the first, cold request against the
warm ones, with the cached tokens the server reports) and a needle test (a sentence buried mid-document at
chosen prompt lengths, recalled or not).

Baselines are saved to `<state_dir>/bench/<release>/<backend>.json`, where the performance gate step of a
switch (gate.perf_gate) finds them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deploy_tool.box.probe.perf import (
    BASELINE_FORMAT,
    DEFAULT_MAX_TOKENS,
    DEFAULT_RUNS,
    PROMPTS,
    Clock,
    Endpoint,
    KindSummary,
    OnEvent,
    RequestResult,
    baseline_path,
    check_name,
    fmt_num,
    fmt_s,
    kind_figures,
    measure,
    median,
    ratio,
    read_baseline,
    stream_chat,
    tokens_per_second,
    user_message,
)
from deploy_tool.clock import iso_utc
from deploy_tool.errors import InputError, PerformanceError, StateError
from deploy_tool.fsutil import atomic_write, os_error

NEEDLE = "The secret access code for building 7 is MAPLE-4416."
NEEDLE_ANSWER = "MAPLE-4416"
NEEDLE_QUESTION = "What is the secret access code for building 7? Answer with the code only."

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
        check_name(k, "prompt kind")
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


# --------------------------------------------------------------------------------------------- results

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
        return kind_figures(self.kinds)

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

def calibrate(ep: Endpoint, *, clock: Clock = time.perf_counter) -> float:
    """Prompt tokens per filler word on this server (two one-token requests); 1.3 when it reports no usage."""
    words = 200
    a = stream_chat(ep, user_message("Hi."), kind="calibrate", max_tokens=1, clock=clock)
    b = stream_chat(ep, user_message("Hi. " + filler_words(words)), kind="calibrate", max_tokens=1, clock=clock)
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
        r = stream_chat(ep, user_message(doc + ending), kind="prefix", index=i, max_tokens=max_tokens, clock=clock)
        out.append(r)
        on_event(f"prefix {i + 1}/{rounds}: ttft {fmt_s(r.ttft_s)}, cached {r.cached_tokens}"
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
        r = stream_chat(ep, user_message(prompt), kind="needle", max_tokens=max_tokens, clock=clock)
        res = NeedleResult(target_tokens=n, prompt_tokens=r.prompt_tokens, recalled=NEEDLE_ANSWER in r.content,
                           ttft_s=r.ttft_s, prefill_tokens_per_s=tokens_per_second(r.prompt_tokens, r.ttft_s),
                           answer=r.content[:120], partial=not r.ok, error=r.error)
        out.append(res)
        on_event(f"needle {n}: {r.prompt_tokens} prompt tokens, "
                 f"{'recalled' if res.recalled else 'NOT recalled'}" + ("" if r.ok else f" ({r.error})"))
    return out


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
                         started=iso_utc(),
                         settings={"kinds": kinds_list, "runs": runs, "max_tokens": max_tokens, "temperature": 0,
                                   "timeout_s": ep.timeout, "prompts": "built-in" if prompts is PROMPTS else "file",
                                   "prefix_rounds": prefix_rounds, "prefix_tokens": prefix_tokens,
                                   "needle": list(needle_lengths), "warmup": warmup})
    m = measure(ep, prompts, kinds_list, runs=runs, max_tokens=max_tokens, warmup=warmup, on_event=on_event,
                clock=clock)
    result.requests, result.kinds, result.spec_metrics = m.requests, m.kinds, m.spec_metrics
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


# --------------------------------------------------------------------------------------------- baselines


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


def list_baselines(state_dir: str | Path) -> list[dict[str, Any]]:
    """Every stored baseline, sorted by (release, backend); unreadable ones are skipped."""
    root = Path(state_dir) / "bench"
    out = []
    for p in sorted(root.glob("*/*.json")):
        try:
            out.append(read_baseline(p))
        except (StateError, InputError, OSError):  # a broken file must not stop listing the others
            continue
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
        row = (f"{kind:<10} {f'{s.ok}/{s.requests}':>5} {m + fmt_num(s.tokens_per_s):>9} "
               f"{fmt_s(s.ttft_s):>9} {m + fmt_num(s.e2e_tokens_per_s):>10} "
               f"{m + fmt_num(s.completion_tokens, 0):>7} {fmt_num(s.cached_tokens, 0):>7} "
               f"{'-' if s.acceptance is None else f'{s.acceptance * 100:.1f}%':>7}")
        if comparison:
            c = comparison.get(kind) or {}
            r = c.get("ratio")
            star = "*" if c.get("metric") == "e2e" else ""
            row += (f" {star + fmt_num(c.get('baseline_tokens_per_s')):>9} "
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
                     f"{fmt_s(p.first_s)}, warm median {fmt_s(p.warm_s)} "
                     f"(x{fmt_num(p.speedup)}), cached tokens {fmt_num(p.cached_tokens, 0)}"
                     + (" ! partial" if p.partial else ""))
    for n in result.needle:
        lines.append(f"needle {n.target_tokens}: {n.prompt_tokens} prompt tokens, "
                     f"{'recalled' if n.recalled else 'NOT recalled'}, ttft {fmt_s(n.ttft_s)}, prefill "
                     f"{fmt_num(n.prefill_tokens_per_s)} tok/s" + (f" ! {n.error}" if n.partial else "")
                     + ("" if n.recalled else f"; answer {n.answer[:40]!r}"))
    return "\n".join(lines)
