"""Health probes: the retry policy under a fake clock, canned HTTP answers, and the two real servers on CPU."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import deploy_tool
from deploy_tool.box.probe.health import (
    REASONS,
    ReadyReport,
    UnitSnapshot,
    failure_reason,
    smoke_completion,
    wait_ready,
)
from deploy_tool.errors import ExitCode, HealthError
from tests.support import backends
from tests.support.tiny_model import write_model, write_unsupported_model

# --------------------------------------------------------------------------------------------- fakes

class FakeClock:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


Route = Callable[["Canned"], tuple[int, object]]


class Canned:
    """A tiny local HTTP server whose answers are scripted per path; it counts the requests it saw."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.hits: dict[str, int] = {}
        self.headers: list[dict[str, str]] = []
        self.bodies: list[object] = []
        self.delay = 0.0
        canned = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                canned.hits[self.path] = canned.hits.get(self.path, 0) + 1
                canned.headers.append({k.lower(): v for k, v in self.headers.items()})
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    canned.bodies.append(json.loads(self.rfile.read(length)))
                route = canned.routes.get((method, self.path))
                status, payload = route(canned) if route else (404, {"detail": "Not Found"})
                if canned.delay:
                    time.sleep(canned.delay)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:  # noqa: N802
                self._answer("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._answer("POST")

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def on(self, method: str, path: str, route: Route) -> None:
        self.routes[(method, path)] = route

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def canned() -> Iterator[Canned]:
    srv = Canned()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def models(*names: str) -> dict[str, object]:
    return {"object": "list", "data": [{"id": n, "object": "model"} for n in names]}


def chat(content: object, *, model: str = "tiny", usage: object = None) -> dict[str, object]:
    usage = usage if usage is not None else {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    out: dict[str, object] = {
        "object": "chat.completion", "model": model,
        "choices": [{"index": 0, "finish_reason": "length",
                     "message": {"role": "assistant", "content": content}}],
    }
    if usage != "omit":
        out["usage"] = usage
    return out


def loading_then_ok(n_loading: int) -> Route:
    def route(srv: Canned) -> tuple[int, object]:
        if srv.hits["/health"] <= n_loading:
            return 503, {"error": {"message": "Loading model", "code": 503}}
        return 200, {"status": "ok"}
    return route


def closed_port() -> str:
    return f"http://127.0.0.1:{backends.free_port()}"


def reason_of(excinfo: pytest.ExceptionInfo[HealthError]) -> str | None:
    return failure_reason(excinfo.value)


# --------------------------------------------------------------------------------------------- retry policy

def test_llamacpp_ready_after_503s_without_real_waiting(canned: Canned, clock: FakeClock) -> None:
    """llama.cpp: /health 503 three times then 200 is ready on attempt 4, after 3 fake intervals and no real wait."""
    canned.on("GET", "/health", loading_then_ok(3))
    canned.on("GET", "/v1/models", lambda s: (200, models("tiny")))
    t0 = time.monotonic()
    report = wait_ready("llamacpp", canned.url, "tiny", timeout=60, interval=0.5, clock=clock, sleep=clock.sleep)
    assert isinstance(report, ReadyReport)
    assert report.attempts == 4
    assert clock.sleeps == [0.5, 0.5, 0.5]
    assert report.seconds == pytest.approx(1.5)
    assert report.served_models == ("tiny",)
    assert time.monotonic() - t0 < 2.0


def test_timeout_never_sleeps_past_the_deadline(canned: Canned, clock: FakeClock) -> None:
    """A server stuck at 503 fails with reason 'timeout' exactly at the deadline, naming the last status."""
    canned.on("GET", "/health", loading_then_ok(10**9))
    with pytest.raises(HealthError) as ei:
        wait_ready("llamacpp", canned.url, "tiny", timeout=2.0, interval=0.3, clock=clock, sleep=clock.sleep)
    assert reason_of(ei) == "timeout"
    assert ei.value.exit_code == ExitCode.HEALTH
    assert "503" in ei.value.message and "Loading model" in ei.value.message
    assert sum(clock.sleeps) == pytest.approx(2.0)
    assert max(clock.sleeps) <= 0.3 + 1e-9
    assert clock.sleeps[-1] == pytest.approx(0.2)  # the last sleep is cut to the deadline


def test_ftllm_refused_then_models_listing(canned: Canned, clock: FakeClock) -> None:
    """ftllm: connection refused is retried; ready only once /v1/models lists the configured name."""
    url = closed_port()
    calls = {"n": 0}

    def sleep(seconds: float) -> None:
        calls["n"] += 1
        clock.sleep(seconds)

    with pytest.raises(HealthError) as ei:
        wait_ready("ftllm", url, "tiny", timeout=1.0, interval=0.25, clock=clock, sleep=sleep)
    assert reason_of(ei) == "timeout"
    assert "connection refused" in ei.value.message
    assert calls["n"] == 4

    canned.on("GET", "/v1/models", lambda s: (200, models("tiny")))
    report = wait_ready("ftllm", canned.url, "tiny", timeout=1.0, interval=0.25, clock=clock, sleep=clock.sleep)
    assert report.attempts == 1 and canned.hits.get("/health") is None  # ftllm has no /health: never asked


def test_one_look_waits_for_a_slow_answer(canned: Canned) -> None:
    """timeout=0 (status's look) asks once and gives each request its request_timeout: a box whose server answers
    in 0.3 s under load is serving, not down."""
    canned.on("GET", "/health", lambda s: (200, {"status": "ok"}))
    canned.on("GET", "/v1/models", lambda s: (200, models("tiny")))
    canned.delay = 0.3
    r = wait_ready("llamacpp", canned.url, "tiny", timeout=0, request_timeout=2.0)
    assert r.attempts == 1 and r.served_models == ("tiny",)
    canned.delay = 1.0
    with pytest.raises(HealthError):
        wait_ready("llamacpp", canned.url, "tiny", timeout=0, request_timeout=0.2)


def test_wrong_model_fails_at_once(canned: Canned, clock: FakeClock) -> None:
    """A server listing another model name fails at once: 'serves model X, expected Y', reason wrong-model."""
    canned.on("GET", "/v1/models", lambda s: (200, models("qwen-old")))
    with pytest.raises(HealthError) as ei:
        wait_ready("ftllm", canned.url, "tiny", timeout=60, interval=0.5, clock=clock, sleep=clock.sleep)
    assert reason_of(ei) == "wrong-model"
    assert "serves model 'qwen-old', expected 'tiny'" in ei.value.message
    assert clock.sleeps == []


def test_llamacpp_aliases_count_as_served_names(canned: Canned, clock: FakeClock) -> None:
    """llama.cpp lists --alias names under `aliases`; any of them satisfies the configured name."""
    canned.on("GET", "/health", lambda s: (200, {"status": "ok"}))
    canned.on("GET", "/v1/models", lambda s: (200, {"data": [{"id": "a", "aliases": ["a", "tiny"]}]}))
    assert wait_ready("llamacpp", canned.url, "tiny", timeout=5, clock=clock, sleep=clock.sleep).attempts == 1


def test_failed_unit_ends_the_wait_at_once_with_journal(canned: Canned, clock: FakeClock) -> None:
    """A unit that turns failed while /health says 503 ends the wait on the next poll, carrying the journal tail."""
    canned.on("GET", "/health", loading_then_ok(10**9))
    states = iter([UnitSnapshot("activating", "start"), UnitSnapshot("active", "running"),
                   UnitSnapshot("failed", "failed", result="signal", exec_main_code="killed",
                                exec_main_status=9, name="llamacpp-tensor.service")])
    journal = "\n".join(f"line {i}" for i in range(100)) + "\nggml: out of memory"
    with pytest.raises(HealthError) as ei:
        wait_ready("llamacpp", canned.url, "tiny", timeout=600, interval=1.0, clock=clock, sleep=clock.sleep,
                   unit_state=lambda: next(states), journal_tail=lambda: journal)
    assert reason_of(ei) == "unit-failed"
    assert len(clock.sleeps) == 2
    assert "llamacpp-tensor.service" in ei.value.message and "signal=9" in ei.value.message
    assert "ggml: out of memory" in ei.value.message and "line 5\n" not in ei.value.message  # tail only
    details = ei.value.details
    assert isinstance(details, dict) and details["journal_tail"].endswith("ggml: out of memory")


def test_exit_status_zero_is_still_a_failure(clock: FakeClock) -> None:
    """A unit that exited with status 0 before ready (ftllm on an unsupported model) is a failure: unit-exited."""
    snap = UnitSnapshot("inactive", "dead", result="success", exec_main_code="exited", exec_main_status=0,
                        name="ftllm-dflash.service")
    with pytest.raises(HealthError) as ei:
        wait_ready("ftllm", closed_port(), "tiny", timeout=600, interval=1.0, clock=clock, sleep=clock.sleep,
                   unit_state=lambda: snap, journal_tail=lambda: "FastLLM Error: Unsupport graph model type x")
    assert reason_of(ei) == "unit-exited"
    assert "status=0" in ei.value.message and "Unsupport graph model type" in ei.value.message
    assert clock.sleeps == []


def test_unit_state_none_and_running_do_not_stop_the_wait(canned: Canned, clock: FakeClock) -> None:
    """unit_state() returning None (unknown) or an active unit keeps waiting until the server is ready."""
    canned.on("GET", "/health", loading_then_ok(2))
    canned.on("GET", "/v1/models", lambda s: (200, models("tiny")))
    states = iter([None, UnitSnapshot("activating", "start"), UnitSnapshot("active", "running")])
    report = wait_ready("llamacpp", canned.url, "tiny", timeout=10, interval=0.1, clock=clock, sleep=clock.sleep,
                        unit_state=lambda: next(states))
    assert report.attempts == 3


def test_auto_restart_counts_as_dead() -> None:
    """A unit in activating/auto-restart (it crashed and systemd will retry) can never become ready in this wait."""
    assert UnitSnapshot("activating", "auto-restart").dead
    assert UnitSnapshot("deactivating", "stop-sigterm").dead
    assert not UnitSnapshot("activating", "start").dead
    assert not UnitSnapshot("active", "running").dead


def test_api_key_is_sent_and_missing_key_is_named(canned: Canned, clock: FakeClock) -> None:
    """With an API key the probe sends Bearer auth; without it a 401 fails at once with reason unauthorized."""
    def guarded(srv: Canned) -> tuple[int, object]:
        if srv.headers[-1].get("authorization") != "Bearer s3cret":
            return 401, {"detail": "Invalid API key"}
        return 200, models("tiny")

    canned.on("GET", "/v1/models", guarded)
    with pytest.raises(HealthError) as ei:
        wait_ready("ftllm", canned.url, "tiny", timeout=10, clock=clock, sleep=clock.sleep)
    assert reason_of(ei) == "unauthorized"
    assert wait_ready("ftllm", canned.url, "tiny", api_key="s3cret", timeout=10, clock=clock,
                      sleep=clock.sleep).attempts == 1


def test_health_404_means_not_llama_server(canned: Canned, clock: FakeClock) -> None:
    """Probing an ftllm-like server (no /health) as llama.cpp fails at once with reason not-this-server."""
    canned.on("GET", "/v1/models", lambda s: (200, models("tiny")))
    with pytest.raises(HealthError) as ei:
        wait_ready("llamacpp", canned.url, "tiny", timeout=10, clock=clock, sleep=clock.sleep)
    assert reason_of(ei) == "not-this-server"


def test_probes_ignore_http_proxy(canned: Canned, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """An http_proxy in the environment is not used for probes of 127.0.0.1 (a dead proxy changes nothing)."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    canned.on("GET", "/v1/models", lambda s: (200, models("tiny")))
    assert wait_ready("ftllm", canned.url, "tiny", timeout=5, clock=clock, sleep=clock.sleep).attempts == 1


def test_bad_kind_is_rejected() -> None:
    """An unknown backend kind is a programming error, reported before any request."""
    with pytest.raises(ValueError, match="unknown backend kind"):
        wait_ready("vllm", "http://127.0.0.1:1", "x", timeout=1)


# --------------------------------------------------------------------------------------------- smoke checks

def test_smoke_request_shape_and_report(canned: Canned) -> None:
    """The smoke test sends the configured model at temperature 0 with small max_tokens and reads usage."""
    canned.on("POST", "/v1/chat/completions", lambda s: (200, chat("hello world")))
    rep = smoke_completion(canned.url, "tiny", api_key="k", timeout=5)
    sent = canned.bodies[-1]
    assert isinstance(sent, dict)
    assert sent["model"] == "tiny" and sent["temperature"] == 0 and 0 < sent["max_tokens"] <= 16
    assert canned.headers[-1]["authorization"] == "Bearer k"
    assert (rep.content, rep.prompt_tokens, rep.completion_tokens, rep.total_tokens) == ("hello world", 5, 3, 8)


@pytest.mark.parametrize(("status", "payload", "reason"), [
    (200, chat("the answer</think>more"), "stray-think"),
    (200, chat(""), "empty-content"),
    (200, chat("   \n"), "empty-content"),
    (200, chat(None), "empty-content"),
    (404, {"detail": "Not Found"}, "http-404"),
    (500, {"error": "boom"}, "http-500"),
    (404, {"object": "error", "message": "The model `tiny` does not exist.", "code": 404}, "wrong-model"),
    (200, chat("hi", model="qwen-old"), "wrong-model"),
    (200, chat("hi", usage="omit"), "no-usage"),
    (200, chat("hi", usage={"prompt_tokens": 3}), "no-usage"),
    (200, b"<html>not json</html>", "bad-response"),
    (401, {"detail": "Invalid API key"}, "unauthorized"),
])
def test_smoke_failures_have_named_reasons(canned: Canned, status: int, payload: object, reason: str) -> None:
    """Each bad answer from a local HTTP server maps to its own named reason (stray </think>, empty, 404, ...)."""
    canned.on("POST", "/v1/chat/completions", lambda s: (status, payload))
    with pytest.raises(HealthError) as ei:
        smoke_completion(canned.url, "tiny", timeout=5)
    assert reason_of(ei) == reason
    assert reason in REASONS or reason.startswith("http-")


def test_smoke_connection_refused() -> None:
    """Nothing listening: reason connection-refused."""
    with pytest.raises(HealthError) as ei:
        smoke_completion(closed_port(), "tiny", timeout=5)
    assert reason_of(ei) == "connection-refused"


def test_smoke_timeout_is_bounded(canned: Canned) -> None:
    """A server slower than the timeout: reason timeout, and the call returns close to the timeout."""
    canned.on("POST", "/v1/chat/completions", lambda s: (200, chat("late")))
    canned.delay = 1.5
    t0 = time.monotonic()
    with pytest.raises(HealthError) as ei:
        smoke_completion(canned.url, "tiny", timeout=0.3)
    assert reason_of(ei) == "timeout"
    assert time.monotonic() - t0 < 1.2


# --------------------------------------------------------------------------------------------- real servers

KINDS = ("llamacpp", "ftllm")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    write_model(d / "tiny-f16.gguf", f16=True)
    write_unsupported_model(d / "unsupported.gguf")
    return d


@pytest.fixture(scope="module", params=KINDS)
def ready_server(request: pytest.FixtureRequest, models_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[backends.Server]:
    """One real server per backend kind, on the tiny F16 model, ready; stopped by PID afterwards."""
    kind = request.param
    with backends.running(kind, models_dir / "tiny-f16.gguf", model_name="tiny",
                          log_dir=tmp_path_factory.mktemp(f"{kind}-logs")) as srv:
        wait_ready(kind, srv.base_url, "tiny", timeout=60, interval=0.1, unit_state=srv.unit_state,
                   journal_tail=srv.log_text)
        yield srv
    assert srv.proc.poll() is not None, "the server must be gone after the fixture"


@pytest.mark.backends
def test_real_server_ready_and_smoke(ready_server: backends.Server) -> None:
    """Each real server (llama-server, ftllm) on CPU passes the readiness probe and a real chat completion."""
    srv = ready_server
    report = wait_ready(srv.kind, srv.base_url, "tiny", timeout=10, interval=0.1, unit_state=srv.unit_state)
    assert report.attempts == 1 and "tiny" in report.served_models
    smoke = smoke_completion(srv.base_url, "tiny", timeout=30, max_tokens=8)
    assert smoke.content.strip() and "</think>" not in smoke.content
    assert smoke.completion_tokens == 8  # the tiny model never emits end-of-turn: runs to max_tokens
    assert smoke.prompt_tokens > 0


@pytest.mark.backends
def test_real_server_wrong_model_name(ready_server: backends.Server) -> None:
    """A real server started as 'tiny' fails both probes for model 'other' with reason wrong-model."""
    srv = ready_server
    with pytest.raises(HealthError) as ei:
        wait_ready(srv.kind, srv.base_url, "other", timeout=10, interval=0.1)
    assert reason_of(ei) == "wrong-model"
    assert "serves model 'tiny', expected 'other'" in ei.value.message
    with pytest.raises(HealthError) as ei:
        smoke_completion(srv.base_url, "other", timeout=30)
    assert reason_of(ei) == "wrong-model"


@pytest.mark.backends
def test_real_server_argv_is_cpu_on_loopback(ready_server: backends.Server) -> None:
    """The launch lines bind 127.0.0.1 on the chosen port and pin the CPU thread counts measured to work."""
    argv = ready_server.argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == str(ready_server.port)
    if ready_server.kind == "ftllm":
        assert argv[1] == "server" and argv[argv.index("--device") + 1] == "cpu"
        assert argv[argv.index("-t") + 1] == "1"
        maps = Path(f"/proc/{ready_server.pid}/maps").read_text()
        assert "libfastllm_tools-cpu.so" in maps  # no CUDA here: the CPU library is the one loaded
    else:
        assert argv[argv.index("--alias") + 1] == "tiny"


@pytest.mark.backends
@pytest.mark.parametrize(("kind", "model"), [("llamacpp", "m24-f16.gguf"), ("ftllm", "tiny-f16.gguf")])
def test_killed_server_ends_wait_within_a_second(kind: str, model: str, models_dir: Path, tmp_path: Path) -> None:
    """A real server SIGKILLed while loading (probe waiting) is reported failed via unit_state within a second."""
    if not (models_dir / model).exists():
        write_model(models_dir / model, size="24m", f16=True)  # loads in ~0.8 s: time to kill it mid-load
    with backends.running(kind, models_dir / model, model_name="tiny", log_dir=tmp_path) as srv:
        killed_at: list[float] = []
        waiting = threading.Event()

        def kill_once_waiting() -> None:
            waiting.wait(30)
            time.sleep(0.05)
            killed_at.append(time.monotonic())
            srv.send_signal(9)

        def watched_state() -> UnitSnapshot:
            waiting.set()  # the probe has started polling: kill the server under it
            return srv.unit_state()

        threading.Thread(target=kill_once_waiting, daemon=True).start()
        with pytest.raises(HealthError) as ei:
            wait_ready(kind, srv.base_url, "tiny", timeout=60, interval=0.1, unit_state=watched_state,
                       journal_tail=srv.log_text)
        ended = time.monotonic()
    assert reason_of(ei) == "unit-failed"
    assert "signal=9" in ei.value.message
    assert killed_at and ended - killed_at[0] < 1.0


@pytest.mark.backends
def test_real_ftllm_exit_zero_on_unsupported_model(models_dir: Path, tmp_path: Path) -> None:
    """Real ftllm exits with status 0 on an unsupported architecture; the probe still fails, with its output."""
    with backends.running("ftllm", models_dir / "unsupported.gguf", model_name="tiny", log_dir=tmp_path) as srv:
        with pytest.raises(HealthError) as ei:
            wait_ready("ftllm", srv.base_url, "tiny", timeout=60, interval=0.1, unit_state=srv.unit_state,
                       journal_tail=srv.log_text)
        assert srv.proc.returncode == 0
    assert reason_of(ei) == "unit-exited"
    assert "Unsupport graph model type bogusarch" in ei.value.message


@pytest.mark.backends
@pytest.mark.parametrize(("kind", "flag"), [("llamacpp", "--api-key"), ("ftllm", "--api_key")])
def test_real_server_with_api_key(kind: str, flag: str, models_dir: Path, tmp_path: Path) -> None:
    """With an API key the probes pass with the key and fail 'unauthorized' without it (ftllm guards /v1/models too)."""
    with backends.running(kind, models_dir / "tiny-f16.gguf", model_name="tiny", log_dir=tmp_path,
                          extra=[flag, "k3y"]) as srv:
        wait_ready(kind, srv.base_url, "tiny", api_key="k3y", timeout=60, interval=0.05,
                   unit_state=srv.unit_state, journal_tail=srv.log_text)
        assert smoke_completion(srv.base_url, "tiny", api_key="k3y", timeout=30).completion_tokens > 0
        with pytest.raises(HealthError) as ei:
            smoke_completion(srv.base_url, "tiny", api_key="wrong", timeout=30)
        assert reason_of(ei) == "unauthorized"
        if kind == "ftllm":  # llama-server keeps /health and /v1/models public
            with pytest.raises(HealthError) as ei:
                wait_ready(kind, srv.base_url, "tiny", timeout=5, interval=0.05)
            assert reason_of(ei) == "unauthorized"


def test_every_reason_the_code_names_is_in_the_table() -> None:
    """Each reason slug the package names for a failed start, gate or switch (a `details["reason"]`, a `_fail(...)`
    in the probes, an http.Unreachable's) is in health.REASONS, which the exit codes page shows users and
    playbooks; and the table names nothing the code never raises."""
    root = Path(deploy_tool.__file__).parent
    named: set[str] = set()
    pats = [re.compile(r'"reason":\s*"([a-z0-9-]+)"'), re.compile(r'"reason":\s*"([a-z0-9-]+)"\s+if\b.*?else\s+"([a-z0-9-]+)"'),
            re.compile(r'\b_fail\(\s*"([a-z0-9-]+)"'), re.compile(r'\bUnreachable\(\s*"([a-z0-9-]+)"'),
            re.compile(r'\breason\s*=\s*"([a-z0-9-]+)"\s+if\b.*?else\s+"([a-z0-9-]+)"')]
    for py in sorted((root / "box").rglob("*.py")):
        text = py.read_text()
        for pat in pats:
            for m in pat.finditer(text):
                named.update(g for g in m.groups() if g)
    assert named - set(REASONS) == set(), "named in the code, missing from health.REASONS"
    assert set(REASONS) - named == set(), "in health.REASONS, named nowhere in the code"
