"""`deploytool rebuild --offline BUNDLE`: prove the bundle's wheels rebuild byte-identical native libraries.

The bundle is verified with a trusted key, a fresh venv is built from its wheels with `--no-index
--require-hashes` (no package index can be reached even if the network is up), and the SHA-256 of every native
library (*.so*) inside it is compared with the manifest, file by file.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from deploy_tool import bundle
from deploy_tool.config import Config
from deploy_tool.manifest import hash_native_libs
from deploy_tool.proc import run_tool
from deploy_tool.venv import build_venv


def rebuild(cfg: Config, bundle_path: str, *, keys_dir: str | None = None, python: str | None = None,
            log=lambda s: None) -> dict[str, Any]:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="deploytool-rebuild-") as tmp:
        t = Path(tmp)
        vb = bundle.verify_bundle(bundle_path, keys_dir or cfg.paths.keys_dir, staging=t / "b")
        log(f"bundle {vb.manifest.bundle_id} verified; rebuilding the venv from its wheels, offline")
        venv = t / "venv"
        build_venv(python or cfg.bundle.python, vb.root / "requirements.lock", vb.root / "wheels", venv, run=run_tool)
        got = hash_native_libs(venv)
        want = dict(vb.manifest.native_libs)
        rows = []
        for k in sorted(set(want) | set(got)):
            rows.append({"path": k, "expected": want.get(k), "actual": got.get(k), "same": want.get(k) == got.get(k)})
        shutil.rmtree(venv, ignore_errors=True)
    diff = [r for r in rows if not r["same"]]
    return {"ok": not diff, "bundle_id": vb.manifest.bundle_id, "native_libs": len(rows), "different": diff,
            "identical": len(rows) - len(diff), "seconds": round(time.monotonic() - t0, 2)}


def format_report(rep: dict[str, Any]) -> str:
    head = (f"bundle {rep['bundle_id']}: {rep['identical']}/{rep['native_libs']} native libraries byte-identical "
            f"after an offline rebuild ({rep['seconds']}s)")
    lines = [head]
    for r in rep["different"]:
        lines.append(f"  DIFFERENT {r['path']}: expected {str(r['expected'])[:12]}, actual {str(r['actual'])[:12]}")
    return "\n".join(lines)
