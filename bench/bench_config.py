"""How long does deploytool take to load a config, and to refuse a hostile one?

Side by side in one run, this checkout against another one (--before DIR, e.g. a `git archive REV | tar -x -C DIR`
of an earlier revision), each command run as the console script runs it (`deploy_tool.cli.main`) from that
checkout, with the same interpreter:
  * `check --no-files` on the two embedded examples (what an operator waits for)
  * `verify` of a small pinned release with the fingerprint cache warm (the units' ExecStartPre, before every start)
  * refusals: a 10 MB config, an alias bomb (600 bytes that expand to 9^10 strings), a 5000-digit integer, a
    1 MiB config of half a million list items, a duplicate key
Each figure is the best of --repeat runs (wall time of the whole command) with its exit code and peak RSS. Every run
is limited to 2 GiB of address space and killed after --timeout seconds, so the old loader's hangs show as such.

Usage: python bench/bench_config.py [--before DIR] [--repeat N] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_verify import build_release  # noqa: E402

from deploy_tool import config  # noqa: E402
from deploy_tool.box import fingerprint  # noqa: E402

ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
AS_LIMIT = 2 << 30
MIN = "version: 1\ndefault_backend: a\nbackends:\n  a:\n    kind: ftllm\n    model: /m\n"


def hostile(d: Path) -> dict[str, Path]:
    """The hostile configs, written into `d`."""
    files = {}

    def put(name: str, text: str) -> None:
        files[name] = d / f"{name}.yaml"
        files[name].write_text(text)

    put("10 MB config", MIN + "    env:\n" + "".join(f"      V{i}: '{'x' * 80}'\n" for i in range(100_000)))
    levels = ['&l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"&l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10)]
    put("alias bomb", MIN + "    extra_args: [[" + ", ".join(levels) + "]]\n")
    put("5000-digit integer", MIN + "    tp: " + "9" * 5000 + "\n")
    put("400-digit timeout", MIN + "    start_timeout_s: " + "9" * 400 + "\n")
    put("1 MiB, 500k items", MIN + "    extra_args: [" + "1," * ((1 << 20) // 2 - 100) + "1]\n")
    put("duplicate key", MIN + "    model: /other\n")
    return files


def run(argv: list[str], cwd: Path, timeout: float) -> tuple[float, int | str, int]:
    """(seconds, exit code or 'killed', peak RSS in KiB) of one run."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    t = time.perf_counter()
    p = subprocess.Popen(argv, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         preexec_fn=limit)
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        p.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    _pid, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t
    timer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    return dt, ("killed" if killed.is_set() else p.returncode), ru.ru_maxrss


def best(argv: list[str], cwd: Path, repeat: int, timeout: float) -> tuple[float, int | str, int]:
    runs = [run(argv, cwd, timeout)]
    if runs[0][1] != "killed":  # a run that hit the timeout is not repeated
        runs += [run(argv, cwd, timeout) for _ in range(repeat - 1)]
    return min(runs)


def cell(r: tuple[float, int | str, int] | None) -> str:
    if r is None:
        return ""
    dt, rc, rss = r
    return f"{'>' if rc == 'killed' else ''}{dt:6.3f} s  {'exit ' + str(rc):9} {rss / 1024:7.0f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="another checkout's root (holding deploy_tool/) to compare with")
    ap.add_argument("--repeat", type=int, default=5, help="runs per figure (the best counts); default 5")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds before a run is killed; default 20")
    a = ap.parse_args()
    trees = [("after (this checkout)", REPO)] + ([("before", a.before.resolve())] if a.before else [])
    entry = [sys.executable, "-c", "from deploy_tool.cli import main; main()"]
    with tempfile.TemporaryDirectory(prefix="bench-config-") as tmp:
        d = Path(tmp)
        for name in config.EXAMPLES:
            (d / f"{name}.yaml").write_text(config.example_text(name))
        rel = d / "release"
        rel.mkdir()
        cp = build_release(rel, Path(sys.prefix), None)
        fingerprint.pin(config.load(cp), "ftllm-dflash", "benchmark")
        cases: list[tuple[str, list[str]]] = [
            (f"check {name}", ["--config", str(d / f"{name}.yaml"), "check", "--no-files"]) for name in config.EXAMPLES]
        cases.append(("verify (fingerprint cache warm)", ["--config", str(cp), "verify", "ftllm-dflash"]))
        cases += [(f"refuse: {name}", ["--config", str(p), "check", "--no-files"]) for name, p in hostile(d).items()]
        for _label, tree in trees:  # warm-up: byte-compile each tree's modules, fill the fingerprint cache
            run([*entry, "--config", str(cp), "verify", "ftllm-dflash"], tree, 60)
            run([*entry, "--version"], tree, 60)
        print(f"best of {a.repeat} runs; wall time, exit code, peak RSS; limit {AS_LIMIT >> 30} GiB address space, "
              f"{a.timeout:g} s")
        print(f"{'':36}" + "".join(f"{label:34}" for label, _ in trees))
        for label, args in cases:
            row = [best([*entry, *args], tree, min(3, a.repeat) if label.startswith("refuse") else a.repeat, a.timeout)
                   for _, tree in trees]
            print(f"{label:36}" + "".join(f"{cell(r):34}" for r in row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
