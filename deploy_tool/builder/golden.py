"""The golden unit and env files: the committed `units/` are the renders of the two-2080ti example.

    python -m deploy_tool.builder.golden            rewrite units/ from the current templates (on purpose: `make golden`)
    python -m deploy_tool.builder.golden --check    exit 1 with a unified diff when units/ differs from a fresh render

The example is rendered as it would be installed on the box (its config at /etc/deploytool/deploytool.yaml),
so the output depends only on the example, the templates and the version.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

GOLDEN_EXAMPLE = "two-2080ti"
BOX_CONFIG_PATH = "/etc/deploytool/deploytool.yaml"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "units"


def render_golden(example: str = GOLDEN_EXAMPLE) -> dict[str, str]:
    """File name -> content of every unit and env file the example renders."""
    from deploy_tool import config, render, yamlread

    raw = yamlread.read(config.example_text(example), source=example)
    cfg = config.from_dict(raw, source_path=BOX_CONFIG_PATH)
    return {f.name: f.content for f in render.render_all(cfg)}


def diff(directory: Path = DEFAULT_DIR, example: str = GOLDEN_EXAMPLE) -> str:
    """A unified diff from the files in `directory` to a fresh render ('' when identical; extra files count)."""
    want = render_golden(example)
    have = {p.name: p.read_text("utf-8") for p in sorted(directory.glob("*")) if p.is_file()} \
        if directory.is_dir() else {}
    out: list[str] = []
    for name in sorted(set(want) | set(have)):
        a = have.get(name, "").splitlines(keepends=True)
        b = want.get(name, "").splitlines(keepends=True)
        out += difflib.unified_diff(a, b, f"{directory.name}/{name}" if name in have else "/dev/null",
                                    f"render/{name}" if name in want else "/dev/null")
    return "".join(out)


def write(directory: Path = DEFAULT_DIR, example: str = GOLDEN_EXAMPLE) -> list[Path]:
    """Rewrite `directory` with a fresh render (stale files removed); returns the files written."""
    from deploy_tool.fsutil import atomic_write

    files = render_golden(example)
    directory.mkdir(parents=True, exist_ok=True)
    for p in directory.glob("*"):
        if p.is_file() and p.name not in files:
            p.unlink()
    written = []
    for name, content in sorted(files.items()):
        atomic_write(directory / name, content.encode("utf-8"), 0o644)
        written.append(directory / name)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy_tool.builder.golden", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 with a diff when they differ")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the golden directory (default: units/)")
    args = ap.parse_args(argv)
    if args.check:
        d = diff(args.dir)
        if d:
            sys.stdout.write(d)
            print(f"\n{args.dir} differs from a fresh render of {GOLDEN_EXAMPLE}; run `make golden` if the "
                  f"change is intended", file=sys.stderr)
            return 1
        print(f"{args.dir}: up to date")
        return 0
    for p in write(args.dir):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
