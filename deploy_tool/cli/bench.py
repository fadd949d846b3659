"""bench: the write-up's measurement method against the live service, baselines, comparison, chart.

The command's library modules are imported when it runs, not when the CLI starts (`deploytool --help` stays
fast: they pull in the HTTP client, the gate and the config loader)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from deploy_tool.cli.context import Ctx, pass_ctx
from deploy_tool.cli.names import BACKEND, SECONDS
from deploy_tool.errors import ExitCode, InputError
from deploy_tool.progress import progress_for


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _lengths(value: str | None) -> list[int]:
    out = []
    for v in _csv(value):
        t = v.lower().replace("_", "")
        mult = 1000 if t.endswith("k") else 1
        try:
            n = int(float(t[:-1] if mult > 1 else t) * mult)
        except ValueError:
            raise InputError(f"--needle: {v!r} is not a token count",
                             hint="give prompt lengths in tokens, e.g. --needle 1000,8k,32k") from None
        out.append(n)
    return out


@click.command("bench")
@click.argument("backend", required=False, type=BACKEND)
@click.option("--kinds", default=None, help="Prompt kinds to run, comma-separated (default: all of the set: "
                                            "code,math,prose).")
@click.option("--runs", type=int, default=3, show_default=True, help="Requests per kind (the median is reported).")
@click.option("--max-tokens", type=int, default=512, show_default=True, help="max_tokens of each request.")
@click.option("--prefix-rounds", type=int, default=0, show_default=True,
              help="Prefix-cache test: one long shared prefix with N different endings (0: off).")
@click.option("--prefix-tokens", type=int, default=4096, show_default=True, help="Length of the shared prefix.")
@click.option("--needle", default=None, help="Needle test at these prompt lengths in tokens, e.g. 1000,8k.")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
              help="Prompt file replacing the built-in sets (JSON {kind: [prompts]}, or text with '## kind' "
                   "headers and '---' between prompts).")
@click.option("--compare", is_flag=True, help="Show the change against the stored baseline.")
@click.option("--save-baseline", is_flag=True, help="Store this run as the baseline of (release, backend).")
@click.option("--chart", "chart_path", type=click.Path(path_type=Path), default=None,
              help="Write a PNG bar chart of tokens/s: the stored baselines of every release and backend, "
                   "and this run.")
@click.option("--request-limit", type=SECONDS, default=None,
              help="Seconds a whole request may take (a server trickling data slowly); default: no limit.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Short requests sent first and not counted (a freshly started server is slow at first).")
@click.option("--release", default=None, help="Release the figures belong to (default: the installed one).")
@click.option("--timeout", type=SECONDS, default=120.0, show_default=True,
              help="Seconds without data before a request counts as stalled (reported; the run goes on).")
@pass_ctx
def bench(ctx: Ctx, backend: str | None, kinds: str | None, runs: int, max_tokens: int, prefix_rounds: int,
          prefix_tokens: int, needle: str | None, prompts_file: Path | None, compare: bool, save_baseline: bool,
          chart_path: Path | None, request_limit: float | None, warmup: int, release: str | None, timeout: float) -> None:
    """Benchmark the live service: streaming chat requests at temperature 0, medians per prompt kind.

    \b
    Per kind: decode tokens/s (from the server's usage; `~` marks counts estimated from the stream when the
    server sends none), time to first token, draft acceptance where llama.cpp reports it. A request that
    stalls is reported and marked `!`, its partial figures kept, and the run goes on (exit 9 at the end).
    BACKEND (default: the active one) and the release label the figures: baselines are kept per
    (release, backend) in the state dir.
    """
    from deploy_tool.box.probe import perf
    from deploy_tool.box.probe.gate import endpoint_for
    from deploy_tool.box.state import Store
    from deploy_tool.rehearsal import bench as b
    from deploy_tool.rehearsal.pngchart import write_bar_chart

    cfg = ctx.load_config()
    st = Store(cfg.paths.state_dir).load()
    if backend:
        name = cfg.backend(backend).name
        if st.active_backend and st.active_backend != name:
            raise InputError(f"{name} is not the active backend ({st.active_backend} serves port {cfg.serve.port})",
                             hint=f"run `deploytool switch {name}` first, or bench {st.active_backend}")
    elif st.active_backend:
        name = st.active_backend
    else:
        raise InputError("no active backend is recorded in the state dir",
                         hint="name the backend the service runs: `deploytool bench BACKEND`")
    rel = release or st.release or "unreleased"
    perf.baseline_path(cfg.paths.state_dir, rel, name)  # names checked before any request
    prompts = b.load_prompts(prompts_file) if prompts_file else perf.PROMPTS
    kind_list = b.select_kinds(prompts, _csv(kinds))
    lengths = _lengths(needle)
    ep = endpoint_for(cfg, timeout=timeout, max_request_s=request_limit)
    if ctx.dry_run:
        ctx.emit({"would_bench": name, "release": rel, "url": ep.base_url, "kinds": kind_list, "runs": runs},
                 f"would bench {name} (release {rel}) at {ep.base_url}: {', '.join(kind_list)} x {runs}, "
                 f"max_tokens {max_tokens}" + (f", prefix {prefix_rounds} rounds" if prefix_rounds else "")
                 + (f", needle {lengths}" if lengths else ""))
        return
    show = progress_for(json_mode=ctx.json) is not None

    def on_event(msg: str) -> None:
        if show:
            click.echo(f"  {msg}", err=True)

    result = b.run_bench(ep, backend=name, release=rel, kinds=kind_list, runs=runs, max_tokens=max_tokens,
                         prompts=prompts, prefix_rounds=prefix_rounds, prefix_tokens=prefix_tokens,
                         needle_lengths=lengths, warmup=warmup, on_event=on_event)
    data = result.to_json()
    comparison = None
    notes: list[str] = []
    if compare:
        base = perf.load_baseline(cfg.paths.state_dir, rel, name)
        if base is None:
            notes.append(f"no baseline stored for {name} in release {rel}: nothing to compare "
                         "(store one with --save-baseline)")
        else:
            comparison = perf.compare(result.figures(), base["figures"])
            notes.append(f"compared with the baseline of {base.get('started')}")
        data["compare"] = comparison
    saved = None
    if save_baseline:
        saved = b.save_baseline(cfg.paths.state_dir, result)  # refuses a run with failed requests
        data["baseline_saved"] = str(saved)
        notes.append(f"baseline saved: {saved}")
    if chart_path:
        groups = []
        for bl in b.list_baselines(cfg.paths.state_dir):
            if saved and (bl.get("release"), bl.get("backend")) == (rel, name):
                continue
            groups.append((f"{bl.get('backend')} @ {bl.get('release')}",
                           {k: v.get("tokens_per_s") for k, v in bl["figures"].items()}))
        groups.append((f"{name} @ {rel}" + ("" if saved else " (now)"),
                       {k: v["tokens_per_s"] for k, v in result.figures().items()}))
        write_bar_chart(chart_path, groups, title="Decode tokens/s (median)", unit="tok/s")
        data["chart"] = str(chart_path)
        notes.append(f"chart written: {chart_path} ({len(groups)} groups)")
    ctx.emit(data, b.format_table(result, comparison) + "".join(f"\n{n}" for n in notes))
    if result.partial:
        failed = [r for r in result.requests if not r.ok] + [r for r in (result.prefix.rounds if result.prefix
                                                                             else []) if not r.ok]
        failed_needles = [n for n in result.needle if n.partial]
        if not ctx.json:
            click.secho(f"error: {len(failed) + len(failed_needles)} request(s) failed or stalled; "
                        "partial figures are marked '!'",
                        fg="red", err=True)
        sys.exit(int(ExitCode.HEALTH))
