"""deploytool bench: figures from real CPU servers (llama-server, ftllm) on the 24M F16 tiny model, checked
against the servers' own `timings`/`usage`; faults (stall mid-stream, no usage) from a stdlib stub server,
because real servers do not misbehave on demand; baselines, the performance gate, the chart and the CLI.

Run with -s to see the measured figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deploy_tool.box.probe import gate, perf
from deploy_tool.box.probe.health import wait_ready
from deploy_tool.errors import ExitCode, InputError
from deploy_tool.rehearsal import bench, pngchart
from tests.support import backends
from tests.support.bench_stub import MODEL as STUB_MODEL
from tests.support.bench_stub import stub_server
from tests.support.configs import load_example
from tests.support.tiny_model import write_model

NAME = "bench-m"


# --------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bench-models")
    return {"24m": write_model(d / "m24-f16.gguf", size="24m", f16=True),
            "tiny": write_model(d / "tiny-f16.gguf", size="tiny", f16=True)}


@contextlib.contextmanager
def live(kind: str, model: Path, log_dir: Path, extra: tuple[str, ...] = (),
         port: int | None = None) -> Iterator[backends.Server]:
    with backends.running(kind, model, model_name=NAME, log_dir=log_dir, extra=extra, port=port) as srv:
        wait_ready(kind, srv.base_url, NAME, timeout=120, interval=0.2, unit_state=srv.unit_state,
                   journal_tail=srv.log_text)
        yield srv


@pytest.fixture(scope="module")
def llama(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[backends.Server]:
    with live("llamacpp", models["24m"], tmp_path_factory.mktemp("bench-llama")) as srv:
        yield srv


def cfg_at(tmp: Path, port: int, state_dir: Path | None = None):
    """The cpu-demo config pointed at `port`, with its state dir under `tmp` (or `state_dir`)."""
    changes: dict[str, object] = {"serve.internal_port": port, "serve.model_name": NAME}
    if state_dir is not None:
        changes["paths.state_dir"] = str(state_dir)
    return load_example(tmp, "cpu-demo", **changes)


def show(title: str, rows: list[str]) -> None:
    print(f"\n{title}")
    for r in rows:
        print(f"  {r}")


# --------------------------------------------------------------------------------------------- pure math

def test_median_rate_and_ttft_math() -> None:
    """median ignores None and averages the middle pair; rates need positive time; TTFT is first-piece minus send."""
    assert perf.median([3.0, None, 1.0, 2.0]) == 2.0
    assert perf.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert perf.median([None, None]) is None
    assert perf.tokens_per_second(512, 2.0) == 256.0
    assert perf.tokens_per_second(512, 0.0) is None
    assert perf.tokens_per_second(None, 1.0) is None
    assert perf.decode_rate(101, 10.0, 10.5) == pytest.approx(200.0)  # 100 tokens after the first
    assert perf.decode_rate(32, 0.0, 0.016, pieces=5) == pytest.approx(1600.0)  # packed: 4/5 after the first
    assert perf.decode_rate(100, 1.0, 1.001, pieces=3) is None  # one burst: no measurable span
    assert perf.decode_rate(50, 1.0, 2.0, pieces=1) is None
    assert perf.decode_rate(1, 10.0, 10.0) is None
    assert perf.ttft(100.0, 100.25) == pytest.approx(0.25)
    assert perf.ttft(100.0, None) is None
    assert perf.ratio(80.0, 100.0) == pytest.approx(0.8)
    assert perf.ratio(80.0, 0.0) is None
    assert perf.acceptance(372, 1) == pytest.approx(1 / 372)
    assert perf.acceptance(0, 0) is None


def test_summary_takes_medians_of_successful_requests_and_marks_partial() -> None:
    """A kind's median leaves a stalled request out, but the summary is marked partial and counts it."""
    rs = [perf.RequestResult("code", 0, ok=True, tokens_per_s=100.0, ttft_s=0.1, completion_tokens=64),
          perf.RequestResult("code", 1, ok=False, partial=True, tokens_per_s=5.0, ttft_s=9.0, completion_tokens=3),
          perf.RequestResult("code", 2, ok=True, tokens_per_s=120.0, ttft_s=0.3, completion_tokens=64,
                              draft_n=10, draft_accepted=7)]
    s = perf.summarize("code", rs)
    assert (s.requests, s.ok, s.partial) == (3, 2, True)
    assert s.tokens_per_s == pytest.approx(110.0)
    assert s.ttft_s == pytest.approx(0.2)
    assert s.acceptance == pytest.approx(0.7)
    only_bad = perf.summarize("code", rs[1:2])
    assert only_bad.tokens_per_s == 5.0 and only_bad.partial


def test_needle_prompt_buries_the_sentence_mid_document() -> None:
    """The needle sits near the middle of a document of the asked length, the question comes last."""
    p = bench.needle_prompt(2000, 1.0)
    words = p.split()
    at = p.index(bench.NEEDLE) / len(p)
    assert 0.4 < at < 0.6
    assert p.rstrip().endswith(bench.NEEDLE_QUESTION)
    assert 1900 < len(words) < 2000


# --------------------------------------------------------------------------------------------- prompt files

def test_prompt_files_text_and_json(tmp_path: Path) -> None:
    """Text files split on '## kind' and '---'; headerless text is one kind named after the file; JSON maps kinds."""
    t = tmp_path / "p.txt"
    t.write_text("## code\nwrite a sort\n---\nwrite a parser\n## poem\nan ode to ports\n", "utf-8")
    assert bench.load_prompts(t) == {"code": ("write a sort", "write a parser"), "poem": ("an ode to ports",)}
    h = tmp_path / "story.txt"
    h.write_text("once upon a time\n---\nonce more\n", "utf-8")
    assert bench.load_prompts(h) == {"story": ("once upon a time", "once more")}
    j = tmp_path / "p.json"
    j.write_text(json.dumps({"math": ["1+1?", "2+2?"], "zh": "写一首诗"}), "utf-8")
    assert bench.load_prompts(j) == {"math": ("1+1?", "2+2?"), "zh": ("写一首诗",)}
    with pytest.raises(InputError, match="unknown prompt kind 'prose'"):
        bench.select_kinds(bench.load_prompts(j), ["prose"])


@pytest.mark.parametrize("content,expect", [
    (b"", "is empty"), (b"  \n\n", "is empty"), (b"## code\nok\n\xff\xfe bad", "not UTF-8 text (byte 0xff at offset 11)"),
    (b"## code\n## math\nx\n", "kind 'code' has no prompts"),
])
def test_bad_prompt_files_are_one_clear_input_error(tmp_path: Path, content: bytes, expect: str) -> None:
    """Empty, whitespace-only, non-UTF-8 and kind-without-prompts files raise InputError naming the file."""
    p = tmp_path / "prompts.txt"
    p.write_bytes(content)
    with pytest.raises(InputError) as ei:
        bench.load_prompts(p)
    assert expect in ei.value.message and str(p) in ei.value.message


# --------------------------------------------------------------------------------------------- real servers

@pytest.mark.backends
@pytest.mark.slow
def test_llamacpp_client_figures_agree_with_server_timings(llama: backends.Server) -> None:
    """Against real llama-server: usage tokens = timings.predicted_n = max_tokens; the client's total time and
    (median) decode rate agree with the server's own timings within 10%, each request's within 25%
    (the first piece's delivery jitters when the 2 cores are busy: a late first piece shortens the client's decode
    window, while its total time still agrees), and TTFT comes after the server's prefill."""
    ep = perf.Endpoint(llama.base_url, NAME, timeout=60)
    res = bench.run_bench(ep, backend="llamacpp", release="test", runs=3, max_tokens=256)
    rows, rate_ratios, total_ratios = [], [], []
    for r in res.requests:
        t = r.server_timings
        assert r.ok and t is not None and not r.tokens_estimated
        assert r.completion_tokens == t["predicted_n"] == 256
        assert r.prompt_tokens == t["prompt_n"] + t["cache_n"]
        server_rate = t["predicted_per_second"]
        server_total = (t["prompt_ms"] + t["predicted_ms"]) / 1000
        rate_ratios.append(r.tokens_per_s / server_rate)
        total_ratios.append(r.total_s / server_total)
        rows.append(f"{r.kind:<6} client {r.tokens_per_s:7.1f} tok/s vs server {server_rate:7.1f} "
                    f"({(rate_ratios[-1] - 1) * 100:+.1f}%); ttft {r.ttft_s * 1000:6.1f} ms vs "
                    f"prompt_ms {t['prompt_ms']:6.1f}; total {r.total_s:.3f}s vs server {server_total:.3f}s "
                    f"({(total_ratios[-1] - 1) * 100:+.1f}%)")
        assert r.ttft_s * 1000 >= t["prompt_ms"] * 0.95  # the first token comes after the prefill
    show("llama-server 24M F16, 256 tokens (client vs server timings):", rows)
    print(bench.format_table(res))
    # the bounds hold under a full test run on 2 cores, where the client's own scheduling and the server's
    # tokenization and HTTP work (outside its timings) take longer; a wrong token count or clock is off by far more
    assert perf.median(rate_ratios) == pytest.approx(1.0, abs=0.08), rows
    assert all(abs(x - 1) < 0.25 for x in rate_ratios), rows
    assert all(1.0 <= x < 1.25 for x in total_ratios), rows  # the client also waits for the network
    assert perf.median(total_ratios) < 1.10, rows
    assert set(res.kinds) == {"code", "math", "prose"} and not res.partial and not res.estimated


@pytest.mark.backends
@pytest.mark.slow
def test_ftllm_tokens_come_from_usage(models: dict[str, Path], tmp_path: Path) -> None:
    """Against real ftllm (no timings in its answers): token counts come from usage, not from pieces, and the
    client's rates are consistent with them."""
    with live("ftllm", models["24m"], tmp_path) as srv:
        ep = perf.Endpoint(srv.base_url, NAME, timeout=120)
        res = bench.run_bench(ep, backend="ftllm", release="test", runs=1, max_tokens=32)
    rows = []
    for r in res.requests:
        assert r.ok and not r.tokens_estimated and r.server_timings is None
        assert r.completion_tokens == 32 and r.prompt_tokens and r.prompt_tokens > 10
        assert r.tokens_per_s and r.e2e_tokens_per_s and r.tokens_per_s > r.e2e_tokens_per_s
        assert r.e2e_tokens_per_s == pytest.approx(32 / r.total_s)
        rows.append(f"{r.kind:<6} usage {r.completion_tokens} tokens ({r.pieces} pieces), decode "
                    f"{r.tokens_per_s:.1f} tok/s, e2e {r.e2e_tokens_per_s:.1f} tok/s, ttft {r.ttft_s:.3f}s")
    show("ftllm 24M F16, 32 tokens, 1 thread:", rows)


@pytest.mark.backends
@pytest.mark.slow
def test_prefix_cache_rounds_on_llamacpp(llama: backends.Server) -> None:
    """A ~1000-token shared prefix: warm rounds reuse the cache (cached tokens from usage = timings.cache_n)
    and answer faster than the cold first round."""
    ep = perf.Endpoint(llama.base_url, NAME, timeout=60)
    p = bench.run_prefix(ep, rounds=4, prefix_tokens=1000, max_tokens=8)
    rows = [f"round {i + 1}: ttft {r.ttft_s:.3f}s, prompt {r.prompt_tokens}, cached {r.cached_tokens} "
            f"(cache_n {r.server_timings['cache_n']})" for i, r in enumerate(p.rounds)]
    show("prefix cache, llama-server:", rows)
    assert not p.partial and p.prefix_tokens and 850 < p.prefix_tokens < 1200
    assert p.rounds[0].cached_tokens is not None and p.rounds[0].cached_tokens < 50
    for r in p.rounds[1:]:
        assert r.cached_tokens == r.server_timings["cache_n"]
        assert r.cached_tokens >= 0.9 * p.prefix_tokens
    assert p.first_s and p.warm_s and p.warm_s < p.first_s / 2, (p.first_s, p.warm_s)


@pytest.mark.backends
@pytest.mark.slow
def test_needle_lengths_on_llamacpp_and_recall_logic(llama: backends.Server) -> None:
    """Needle prompts land near the asked lengths on a real server (a random model does not recall); a server
    that answers with the code counts as recalled."""
    ep = perf.Endpoint(llama.base_url, NAME, timeout=60)
    out = bench.run_needle(ep, [300, 1500], max_tokens=8)
    show("needle, llama-server:", [f"{n.target_tokens}: {n.prompt_tokens} prompt tokens, prefill "
                                   f"{n.prefill_tokens_per_s:.0f} tok/s, recalled {n.recalled}" for n in out])
    for n in out:
        assert not n.partial and n.prompt_tokens
        assert abs(n.prompt_tokens - n.target_tokens) / n.target_tokens < 0.15
        assert not n.recalled  # random weights
    with stub_server() as s:
        got = bench.run_needle(perf.Endpoint(s.base_url, STUB_MODEL, timeout=10), [200], max_tokens=4)
    assert got[0].recalled and "MAPLE-4416" in got[0].answer


@pytest.mark.backends
@pytest.mark.slow
def test_draft_acceptance_from_llamacpp_timings(models: dict[str, Path], tmp_path: Path) -> None:
    """llama-server drafting with the model itself reports draft_n/draft_n_accepted; acceptance is near 100%.
    Where the build exports speculative-decoding counters on /metrics (newer builds), they agree exactly with the
    per-request timings; where it does not (builds of the b100xx era, like the production box's b10064), the bench
    reports none rather than a figure of its own making."""
    with live("llamacpp", models["24m"], tmp_path,
              extra=("-md", str(models["24m"]), "--spec-type", "draft-simple", "--metrics")) as srv:
        res = bench.run_bench(perf.Endpoint(srv.base_url, NAME, timeout=60), backend="llamacpp", release="t",
                              kinds=["code"], runs=1, max_tokens=64)
        with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as resp:
            exported = "llamacpp:spec_decode_num_draft_tokens_total" in resp.read().decode()
    r = res.requests[0]
    show("self-drafting llama-server:", [f"draft_n {r.draft_n}, accepted {r.draft_accepted}, "
                                         f"acceptance {r.acceptance:.1%}, {r.tokens_per_s:.1f} tok/s, "
                                         f"/metrics counters: {exported}"])
    assert r.draft_n and r.draft_n > 0
    assert res.kinds["code"].acceptance is not None and res.kinds["code"].acceptance > 0.9
    if exported:
        assert res.spec_metrics == {"draft_tokens": r.draft_n, "accepted": r.draft_accepted,
                                    "acceptance": r.acceptance}
        assert "draft acceptance (/metrics)" in bench.format_table(res)
    else:
        assert res.spec_metrics is None and "draft acceptance (/metrics)" not in bench.format_table(res)


# --------------------------------------------------------------------------------------------- faults

def test_stall_mid_stream_times_out_and_the_run_goes_on() -> None:
    """A server stuck mid-stream: that request ends after the timeout with its pieces kept and marked partial;
    the following requests run normally."""
    with stub_server(stall_requests={1}, stall_after=3) as s:
        ep = perf.Endpoint(s.base_url, STUB_MODEL, timeout=1.0)
        res = bench.run_bench(ep, backend="stub", release="t", kinds=["code", "math"], runs=2, max_tokens=20)
        assert s.cfg.requests == 4
    first = res.requests[0]
    assert not first.ok and first.partial and "stalled: no data for 1s after 3 pieces" in first.error
    assert first.pieces == 3 and first.completion_tokens == 3 and first.tokens_estimated
    assert first.total_s is not None and 1.0 <= first.total_s < 5
    assert all(r.ok for r in res.requests[1:])
    assert res.kinds["code"].partial and res.kinds["code"].ok == 1 and not res.kinds["math"].partial
    assert res.partial
    table = bench.format_table(res)
    assert "!" in table.splitlines()[2] and "stalled" in table
    assert res.to_json()["partial"] is True and res.to_json()["requests"][0]["partial"] is True


def test_whole_request_limit_cuts_a_trickling_server() -> None:
    """A server that keeps sending, but too slowly for the whole-request limit, is cut off and marked partial."""
    with stub_server(token_delay=0.25) as s:
        ep = perf.Endpoint(s.base_url, STUB_MODEL, timeout=5, max_request_s=1.0)
        r = perf.stream_chat(ep, [{"role": "user", "content": "hi"}], max_tokens=40)
    assert not r.ok and r.partial and r.error.startswith("exceeded 1s for the request after ")
    assert 2 <= r.pieces <= 5 and r.total_s is not None and r.total_s < 2


def test_no_usage_marks_token_counts_estimated() -> None:
    """A server sending no usage: tokens are counted from the stream's pieces and every figure says estimated."""
    with stub_server(usage=False) as s:
        res = bench.run_bench(perf.Endpoint(s.base_url, STUB_MODEL, timeout=10), backend="stub", release="t",
                              kinds=["prose"], runs=2, max_tokens=24)
    for r in res.requests:
        assert r.ok and r.tokens_estimated and r.completion_tokens == r.pieces == 24
    assert res.estimated and res.figures()["prose"]["estimated"]
    assert "~" in bench.format_table(res) and "estimated" in bench.format_table(res)
    assert s.cfg.bodies[0]["stream_options"] == {"include_usage": True}
    assert s.cfg.bodies[0]["temperature"] == 0


def test_unreachable_service_and_wrong_model_stop_the_run() -> None:
    """What every request would meet (nothing listening, unknown model) is one HealthError, not N failures."""
    from deploy_tool.errors import HealthError

    port = backends.free_port()
    with pytest.raises(HealthError, match="cannot reach the service"):
        bench.run_bench(perf.Endpoint(f"http://127.0.0.1:{port}", "x", timeout=2), backend="b", release="r",
                        runs=1)
    with stub_server() as s, pytest.raises(HealthError, match="404 for model 'other'"):
        bench.run_bench(perf.Endpoint(s.base_url, "other", timeout=2), backend="b", release="r", runs=1)


# --------------------------------------------------------------------------------------------- baselines, gate

def test_baseline_save_load_compare(tmp_path: Path) -> None:
    """A run is stored per (release, backend) atomically and compared by kind; a run with a stall is refused."""
    from deploy_tool.errors import PerformanceError

    # 1 ms against 20 ms a token: twenty times slower, so the ratio stays far below 0.6 even when a loaded
    # machine adds several milliseconds to every token of the fast run
    with stub_server(token_delay=0.001) as s:
        ep = perf.Endpoint(s.base_url, STUB_MODEL, timeout=2)
        fast = bench.run_bench(ep, backend="llamacpp-tensor", release="r1", kinds=["code"], runs=2, max_tokens=30)
        path = bench.save_baseline(tmp_path, fast)
        assert path == tmp_path / "bench" / "r1" / "llamacpp-tensor.json"
        assert [p.name for p in path.parent.iterdir()] == ["llamacpp-tensor.json"]  # no temp file left
        s.cfg.token_delay = 0.02
        slow = bench.run_bench(ep, backend="llamacpp-tensor", release="r1", kinds=["code"], runs=2, max_tokens=30)
        s.cfg.stall_requests = {s.cfg.requests + 1}
        stalled = bench.run_bench(ep, backend="llamacpp-tensor", release="r1", kinds=["code"], runs=1,
                                  max_tokens=30)
    base = perf.load_baseline(tmp_path, "r1", "llamacpp-tensor")
    assert base is not None and base["figures"]["code"]["tokens_per_s"] == pytest.approx(fast.kinds["code"].tokens_per_s)
    cmp = perf.compare(slow.figures(), base["figures"])
    assert cmp["code"]["ratio"] < 0.6 and cmp["code"]["metric"] == "decode", cmp
    burst = {"code": {"tokens_per_s": None, "e2e_tokens_per_s": 50.0}}
    assert perf.compare(burst, {"code": {"tokens_per_s": 90.0, "e2e_tokens_per_s": 100.0}})["code"]["ratio"] == 0.5
    assert "change" in bench.format_table(slow, cmp)
    assert perf.load_baseline(tmp_path, "r2", "llamacpp-tensor") is None
    with pytest.raises(PerformanceError, match="baseline not saved: 1 of 1 requests failed or stalled"):
        bench.save_baseline(tmp_path, stalled)
    assert json.loads(path.read_text())["figures"] == base["figures"]  # the good baseline is untouched
    with pytest.raises(InputError, match="cannot name a baseline file"):
        perf.baseline_path(tmp_path, "../etc", "x")


def test_perf_gate_without_baseline_is_ok_and_says_so(tmp_path: Path) -> None:
    """No stored baseline: the gate passes without sending a request and says it was skipped."""
    cfg = cfg_at(tmp_path, backends.free_port())
    ok, figures, msg = gate.perf_gate(cfg, "llamacpp-tensor", "r1", fraction=0.8)
    assert ok and figures == {} and "skipped: no baseline for llamacpp-tensor in release r1" in msg


def test_request_budget_math() -> None:
    """Twice the time the slowest kind needs at the gate's fraction of its baseline pace, plus 1 s."""
    figs = {"code": {"tokens_per_s": 50.0, "ttft_s": 0.2}, "math": {"tokens_per_s": 100.0, "ttft_s": 0.1},
            "prose": {"tokens_per_s": None, "e2e_tokens_per_s": None}}
    # code: (0.2 + 100/50) / 0.5 = 4.4 s -> 2 * 4.4 + 1
    assert perf.request_budget(figs, fraction=0.5, max_tokens=100) == pytest.approx(9.8)
    assert perf.request_budget({"code": {"tokens_per_s": None, "e2e_tokens_per_s": 20.0, "ttft_s": None}},
                                fraction=1.0, max_tokens=40) == pytest.approx(5.0)
    assert perf.request_budget({"code": {"tokens_per_s": None}}, fraction=0.5, max_tokens=10) is None


def stub_with_baseline(tmp_path: Path, s: Any) -> tuple[Any, Any]:
    """A cpu-demo config on the stub server `s` and the baseline of release r1 saved from it (code, 2 runs, 40
    tokens) in its state dir."""
    state = tmp_path / "state"
    cfg = load_example(tmp_path / "c", "cpu-demo", **{"serve.internal_port": s.port, "serve.model_name": STUB_MODEL,
                                                       "paths.state_dir": str(state)})
    base = bench.run_bench(gate.endpoint_for(cfg), backend="llamacpp-tensor", release="r1", kinds=["code"],
                           runs=2, max_tokens=40)
    bench.save_baseline(state, base)
    return cfg, base


def test_perf_gate_fails_a_crawling_backend_within_its_budget(tmp_path: Path) -> None:
    """A backend far below its baseline (a stub now 40x slower than when the baseline was taken) fails the gate
    after about one request budget, not after trickling every token: the figures and the cut are in the message."""
    with stub_server(token_delay=0.005) as s:
        cfg, base = stub_with_baseline(tmp_path, s)
        s.cfg.token_delay = 0.2  # 40 tokens would take 8 s
        budget = perf.request_budget(base.figures(), fraction=0.5, max_tokens=40)
        # about 1.8 s on an idle machine; a loaded one slows the baseline (a longer budget), never the crawl's
        # 8 s: the cut must still come well before the crawl would end
        assert budget is not None and budget < 8 / 2, budget
        t = time.monotonic()
        ok, figures, msg = gate.perf_gate(cfg, "llamacpp-tensor", "r1", fraction=0.5, max_tokens=40, warmup=0)
        took = time.monotonic() - t
    assert not ok and "request(s) failed" in msg and "exceeded" in msg, msg
    assert took < budget + 1.5, (took, budget)
    assert figures["failed"]


@pytest.mark.parametrize("recovers", [True, False], ids=["one-stall", "slow-each-time"])
def test_perf_gate_measures_a_low_figure_again(tmp_path: Path, recovers: bool) -> None:
    """A backend 3.5x slower than its baseline (below 0.5 of it, each request still within its budget) is measured
    once more: if it is back at its pace (one stall of a busy machine), the gate passes in its second try; slow
    each time, it fails with both tries named.
    The delays are long next to the stub's own cost per token, which a loaded machine stretches and which narrows
    the measured ratio: with 5 and 15 ms a token, 5 ms more of it put the slow try at 0.54 of its baseline (a run
    under `make test`); with 20 and 70 ms it takes 30 ms more."""
    with stub_server(token_delay=0.02) as s:
        cfg, base = stub_with_baseline(tmp_path, s)
        s.cfg.token_delay = 0.07
        events: list[str] = []

        def on_event(line: str) -> None:
            events.append(line)
            if recovers and "measuring again" in line:
                s.cfg.token_delay = 0.02

        ok, figures, msg = gate.perf_gate(cfg, "llamacpp-tensor", "r1", fraction=0.5, max_tokens=40, warmup=0,
                                          on_event=on_event)
    again = [e for e in events if "measuring again" in e]
    assert again == ["performance gate: code below 0.50 of baseline in try 1 of 2; measuring again"], events
    assert figures["tries"] == 2 and not figures["failed"], figures
    if recovers:
        assert ok and msg.startswith("performance gate passed"), msg
    else:
        assert not ok and "below 0.50 of baseline: code, in each of 2 tries" in msg, msg


@pytest.mark.backends
@pytest.mark.slow
def test_perf_gate_catches_a_real_speculation_regression(models: dict[str, Path], llama: backends.Server,
                                                          tmp_path: Path) -> None:
    """Baseline from plain llama-server; the same server passes the gate (at 0.4, medians of 3, in one of up to
    three tries: this 2-core machine is noisy while the suite runs);
    llama-server with a useless draft model (about 1 in 300 drafted tokens accepted, a fifth of the speed when
    the machine is idle) falls below 0.8 of it and the gate says so with figures, naming the kinds that fell."""
    state = tmp_path / "state"
    cfg = cfg_at(tmp_path / "c1", llama.port, state)  # plain llama-server: the module's
    # Load from the suite's other workers only ever slows a run down, so one pass in up to three tries shows
    # the gate passes the server its baseline came from; a failing try is printed, never hidden. Each try takes
    # its baseline just before it gates, as below: a baseline from a quiet moment gives requests budgets that
    # a busy moment after it overran (three requests past a 6.8 s budget in one fresh-clone `make test`, a 6x stall).
    tries = []
    for _ in range(3):
        bench.save_baseline(state, bench.run_bench(gate.endpoint_for(cfg), backend="llamacpp-tensor",
                                                   release="r1", runs=3, max_tokens=96, warmup=1))
        ok, figures, msg = gate.perf_gate(cfg, "llamacpp-tensor", "r1", fraction=0.4, runs=3, max_tokens=96)
        tries.append(msg)
        if ok:
            break
    show("perf gate, same server:", tries)
    assert ok, tries
    with live("llamacpp", models["24m"], tmp_path / "draft",
              extra=("-md", str(models["tiny"]), "--spec-type", "draft-simple")) as srv:
        cfg2 = cfg_at(tmp_path / "c2", srv.port, state)
        # each try takes a fresh baseline of the plain server just before it gates the slow one, so the two are
        # measured under the same load (a baseline taken while the other workers were busy is low, and the slow
        # server, gated in a quiet moment after it, would pass);
        # the slow server must fail in one of up to three tries
        bad_tries = []
        for _ in range(3):
            bench.save_baseline(state, bench.run_bench(gate.endpoint_for(cfg), backend="llamacpp-tensor",
                                                       release="r1", runs=3, max_tokens=96, warmup=1))
            bad_ok, bad, bad_msg = gate.perf_gate(cfg2, "llamacpp-tensor", "r1", fraction=0.8, runs=3,
                                                  max_tokens=96)
            bad_tries.append(bad_msg)
            if not bad_ok:
                break
    show("perf gate:", [msg, *bad_tries])
    assert not bad_ok
    # the gate fails on any kind below the fraction and names exactly those (idle, all three are at about a fifth;
    # under the suite's load one may sit near 0.8): the named kinds are the figures' kinds below 0.8
    low = sorted(k for k, c in bad["kinds"].items() if c["ratio"] is not None and c["ratio"] < 0.8)
    assert low, bad
    assert bad_msg.startswith(f"performance gate failed (below 0.80 of baseline: {', '.join(low)}"), bad_msg
    for kind in ("code", "math", "prose"):
        assert f"{kind} " in bad_msg and "tok/s vs baseline" in bad_msg
    assert bad["fraction"] == 0.8 and bad["release"] == "r1"


# --------------------------------------------------------------------------------------------- chart, CLI

def test_png_chart_is_a_valid_image_with_one_colour_per_kind(tmp_path: Path) -> None:
    """The stdlib PNG writer produces a PNG whose CRCs check and whose bars use one palette colour per kind."""
    out = pngchart.write_bar_chart(tmp_path / "c.png", [("ftllm @ r1", {"code": 156.0, "math": 134.9}),
                                                       ("llamacpp @ r1", {"code": 59.6, "math": None})],
                                   title="tok/s")
    w, h, px = pngchart.decode_png(out.read_bytes())
    colours = {px[i:i + 3] for i in range(0, len(px), 3)}
    assert w >= 360 and h > 300 and len(px) == w * h * 3
    assert bytes(pngchart.PALETTE[0]) in colours and bytes(pngchart.PALETTE[1]) in colours
    assert bytes(pngchart.PALETTE[2]) not in colours  # only two kinds


def _cli(args: list[str], cfg_path: Path) -> tuple[int, str, str]:
    from deploy_tool.cli import main
    from deploy_tool.cli.bench import bench as bench_cmd

    if "bench" not in main.commands:
        main.add_command(bench_cmd)
    r = CliRunner().invoke(main, ["--config", str(cfg_path), *args], catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def test_cli_bad_prompt_file_exit_code_and_one_line(tmp_path: Path) -> None:
    """`bench --prompts` with an empty or non-UTF-8 file exits 5 with one error line and a hint, no traceback,
    and sends no request."""
    with stub_server() as s:
        cfg = cfg_at(tmp_path / "c", s.port)
        for content, what in ((b"", "is empty"), (b"caf\xe9\n", "is not UTF-8 text")):
            f = tmp_path / "p.txt"
            f.write_bytes(content)
            code, out, err = _cli(["bench", "llamacpp", "--prompts", str(f)], Path(cfg.source_path))
            lines = err.strip().splitlines()
            assert code == ExitCode.INPUT, (out, err)
            assert lines[0] == f"error: prompt file {f} {what}" + (" (byte 0xe9 at offset 3)" if "UTF" in what else "")
            assert lines[1].startswith("hint: ") and len(lines) == 2 and "Traceback" not in err
        assert s.cfg.requests == 0


def test_cli_save_compare_chart_json_and_stall_exit(tmp_path: Path) -> None:
    """The CLI stores a baseline in the state dir, compares against it, writes the chart, prints JSON, and exits
    9 after a run with a stalled request whose partial figures it still prints."""
    with stub_server(token_delay=0.002) as s:
        cfg = cfg_at(tmp_path / "c", s.port)
        cfg_path = Path(cfg.source_path)
        os.environ.pop("DEPLOYTOOL_CONFIG", None)
        base_args = ["bench", "llamacpp", "--kinds", "code,math", "--runs", "2", "--max-tokens", "16",
                     "--timeout", "1"]
        s.cfg.model = NAME
        code, out, err = _cli([*base_args, "--save-baseline"], cfg_path)
        assert code == 0, err
        saved = Path(cfg.paths.state_dir) / "bench" / "unreleased" / "llamacpp-tensor.json"
        assert saved.is_file() and f"baseline saved: {saved}" in out
        assert out.splitlines()[1].split()[:2] == ["kind", "ok"]
        chart = tmp_path / "chart.png"
        code, out, err = _cli([*base_args, "--compare", "--chart", str(chart), "--json"], cfg_path)
        assert code == 0, err
        data = json.loads(out)
        assert set(data["compare"]) == {"code", "math"} and data["compare"]["code"]["ratio"] > 0.3
        assert data["chart"] == str(chart) and pngchart.decode_png(chart.read_bytes())[0] > 0
        s.cfg.stall_requests = {s.cfg.requests + 2}
        code, out, err = _cli(base_args, cfg_path)
        assert code == ExitCode.HEALTH
        assert "stalled: no data for 1s after 3 pieces" in out and "1 request(s) failed or stalled" in err
        code, out, err = _cli(["bench", "ftllm", "--kinds", "poetry"], cfg_path)
        assert code == ExitCode.INPUT and "unknown prompt kind 'poetry'" in err


# --------------------------------------------------------------------------------------------- end to end

_CLI_WITH_BENCH = ("from deploy_tool.cli import main\n"
                   "from deploy_tool.cli.bench import bench\n"
                   "'bench' in main.commands or main.add_command(bench)\n"
                   "main()")


@pytest.mark.sandbox
@pytest.mark.backends
@pytest.mark.slow
@pytest.mark.e2e
def test_bench_the_installed_service_with_backend_and_release_from_state(installed: Path) -> None:
    """Against the service a real install runs under sandboxed systemd: BACKEND and release default to what
    state.json records, the baseline lands in <state_dir>/bench/<release>/<backend>.json, and perf_gate on the
    same service passes against it (with every kind compared)."""
    cfg_path = installed
    import subprocess
    import sys

    from deploy_tool import config

    cfg = config.load(cfg_path)
    st = json.loads((Path(cfg.paths.state_dir) / "state.json").read_text())
    r = subprocess.run([sys.executable, "-c", _CLI_WITH_BENCH, "--config", str(cfg_path), "bench", "--runs", "1",
                        "--max-tokens", "256", "--save-baseline", "--json"], capture_output=True, text=True,
                       timeout=300, cwd=cfg_path.parent,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert (data["backend"], data["release"]) == (st["active_backend"], st["release"]) and st["release"]
    assert data["model"] == cfg.serve.model_name and data["base_url"].endswith(f":{cfg.backend_port}")
    saved = Path(cfg.paths.state_dir) / "bench" / st["release"] / f"{st['active_backend']}.json"
    assert data["baseline_saved"] == str(saved) and saved.is_file()
    assert all(k["ok"] == 1 and (k["tokens_per_s"] or k["e2e_tokens_per_s"]) for k in data["kinds"].values())
    # fraction 0.01: the tiny model through ftllm runs at thousands of tokens/s, so single requests vary by
    # more than 10x on these busy 2 cores; telling a regression apart is test_perf_gate_catches_... 's job
    ok, figures, msg = gate.perf_gate(cfg, st["active_backend"], st["release"], fraction=0.01, max_tokens=256)
    show("installed service:", [f"{k}: decode {v['tokens_per_s']} tok/s, e2e {v['e2e_tokens_per_s']:.1f} tok/s"
                                for k, v in data["figures"].items()] + [msg])
    assert ok, msg
    assert set(figures["kinds"]) == {"code", "math", "prose"}
    # the tiny model through ftllm can arrive in one burst: then the gate compares end to end, never nothing
    assert all(k["ratio"] is not None and k["metric"] in ("decode", "e2e") for k in figures["kinds"].values())
