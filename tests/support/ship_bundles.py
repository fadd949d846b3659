"""Two real cpu-demo bundles that differ by one wheel, for the ship tests and bench/bench_ship.py.

    pack_pair(d) -> (bundle dir A, bundle dir B)

A is `make_demo`'s bundle (tests/support/demo_box.py: init --example cpu-demo, keygen, lock, pack). B is packed from
a second config beside it whose wheel directory is A's with one small pure-Python wheel rebuilt (one module changed,
its RECORD line updated, as a patched rebuild of that wheel would be) and whose lock names the new wheel's hash.
So B differs from A in that wheel, the venv archive built from it (the package's files inside; deploytool's
archive cuts its zstd frames at member boundaries, so the rest of the archive stays the same bytes), the lock, and
config.json: what a one-wheel update of a release is.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import zipfile
from pathlib import Path

import yaml

from tests.support.demo_box import REPO, make_demo, pack
from tests.support.sandbox import RUN_PARENT

WHEEL = "sniffio"  # small, pure Python, in the cpu-demo lock


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rebuild_wheel(src: Path, dst: Path, stamp: str) -> None:
    """`src` with one line appended to its first module and that module's RECORD entry updated."""
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        data = {i.filename: zin.read(i.filename) for i in infos}
    target = next(n for n in sorted(data) if n.endswith(".py"))
    data[target] += f"\n# rebuilt: {stamp}\n".encode()
    rec = next(n for n in data if n.endswith(".dist-info/RECORD"))
    lines = []
    for line in data[rec].decode().splitlines():
        if line.startswith(target + ","):
            line = f"{target},{_record_hash(data[target])},{len(data[target])}"
        lines.append(line)
    data[rec] = ("\n".join(lines) + "\n").encode()
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for i in infos:
            zout.writestr(i, data[i.filename])


def bundle_dir(artifacts: Path) -> Path:
    found = [p for p in artifacts.iterdir() if p.is_dir() and (p / "MANIFEST").is_file()]
    assert len(found) == 1, f"expected one bundle directory in {artifacts}, found {found}"
    return found[0]


def one_wheel_variant(cfg: Path, stamp: str = "b") -> Path:
    """Pack B beside `cfg` (see the module doc); returns B's bundle directory."""
    d = cfg.parent
    src_wheels = (d / "wheels").resolve()
    wb = d / f"wheels-{stamp}"
    wb.mkdir()
    old = next(src_wheels.glob(f"{WHEEL}-*.whl"))
    for p in sorted(src_wheels.glob("*.whl")):
        if p != old:
            os.symlink(p, wb / p.name)
    rebuild_wheel(old, wb / old.name, stamp)
    old_sha = hashlib.sha256(old.read_bytes()).hexdigest()
    new_sha = hashlib.sha256((wb / old.name).read_bytes()).hexdigest()
    lock = (d / "requirements.lock").read_text()
    assert old_sha in lock, f"{old.name} is not the wheel the lock names"
    (d / f"requirements-{stamp}.lock").write_text(re.sub(old_sha, new_sha, lock))
    data = yaml.safe_load(cfg.read_text())
    data["bundle"]["wheels_dir"] = wb.name
    data["bundle"]["lock"] = f"requirements-{stamp}.lock"
    cfg_b = d / f"deploytool-{stamp}.yaml"
    cfg_b.write_text(yaml.safe_dump(data, sort_keys=False))
    out = d / f"artifacts-{stamp}"
    pack(cfg_b, out)
    return bundle_dir(out)


def pack_pair(d: Path) -> tuple[Path, Path]:
    """Bundles A and B (one wheel apart) under `d`, packed for real; returns their directories."""
    cfg = make_demo(d / "box", sandbox_dir=None, unit_dir=d / "units", port=1)
    return bundle_dir(d / "box" / "artifacts"), one_wheel_variant(cfg)


__all__ = ["cached_pair", "pack_pair", "one_wheel_variant", "rebuild_wheel", "bundle_dir", "REPO"]


def _inputs_key() -> str:
    """What the two bundles are a function of: deploytool's code and templates, the demo recipe, the wheels."""
    h = hashlib.sha256()
    for top in ("deploy_tool", "templates"):
        for p in sorted((REPO / top).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(p.relative_to(REPO).as_posix().encode() + b"\0" + p.read_bytes())
    for name in ("ship_bundles.py", "demo_box.py", "tiny_model.py"):
        h.update((Path(__file__).with_name(name)).read_bytes())
    for p in sorted((REPO / ".cache" / "wheels-demo").glob("*.whl")):
        h.update(f"{p.name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def cached_pair() -> tuple[Path, Path]:
    """pack_pair's two bundle directories, packed once per change of their inputs (a pack of each takes about a
    minute on a 2-core machine) and kept under $DEPLOYTOOL_TEST_ROOT/ship-bundles/<inputs key>/ (default
    /var/lib/deploytool-test; older keys are removed), never under the checkout: its path may hold a space, which
    a config's paths cannot (the pack refuses them).
    The key leaves out the collection files a bundle may carry (ansible/): a pair packed with an older copy of
    them is still two valid bundles one wheel apart, which is all the ship tests and bench need."""
    import shutil
    import uuid

    root = Path(RUN_PARENT) / "ship-bundles"
    key = _inputs_key()
    done = root / key
    if not (done / "ok").is_file():
        root.mkdir(parents=True, exist_ok=True)
        work = root / f".work-{uuid.uuid4().hex[:8]}"
        try:
            a, b = pack_pair(work)
            shutil.rmtree(done, ignore_errors=True)
            done.mkdir()
            a.rename(done / "a")
            b.rename(done / "b")
            (done / "ok").write_text(f"{a.name}\n{b.name}\n")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for old in root.iterdir():
            if old.name != key:
                shutil.rmtree(old, ignore_errors=True)
    return done / "a", done / "b"
