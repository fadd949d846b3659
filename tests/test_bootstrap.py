"""A fresh box with nothing but the system python3 gets deploytool from the bundle: `python3 BUNDLE/bootstrap`.

The box is a directory tree under .cache/ (its demo-root/ holds the paths the config names, empty but for the
trusted public key), the bundle directory is copied next to it as it would be copied to a real box, and every
run of the bootstrap gets a cleared environment (no dev venv, no PYTHONPATH: only /usr/bin/python3) inside an
empty network namespace (`unshare --net`). The backends then run under a real sandboxed systemd with their
ExecStartPre calling the deploytool the bootstrap installed. No GPU here: the cpu-demo backends run on the CPU.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from deploy_tool.box import bootstrap

pytestmark = [pytest.mark.sandbox, pytest.mark.backends, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"
CLEAN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
OLD_PYTHONS = sorted(Path("/root/.pyenv/versions").glob("3.10*/bin/python3")) + \
    sorted(Path("/root/.pyenv/versions").glob("2.7*/bin/python"))


def clean_env(box: Path) -> dict[str, str]:
    return {"PATH": CLEAN_PATH, "LANG": "C.UTF-8", "HOME": str(box / "home"), "TMPDIR": str(box / "tmp")}


def on_box(box: Path, argv: list[str], *, netns: bool = True, wrap: list[str] | None = None,
           timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """argv as a person runs it on the fresh box: env cleared, cwd the box, no network unless netns=False."""
    pre = (wrap or []) + (["unshare", "--net", "--"] if netns and not wrap else [])
    return subprocess.run([*pre, *argv], capture_output=True, text=True, timeout=timeout, env=clean_env(box),
                          cwd=box)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and mtime (what "nothing written" is checked against)."""
    out = {}
    for top, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(top, n)
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if not p.is_dir() else 0, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def fresh(own_sandbox):
    """A packed cpu-demo bundle (directory form, copied to the box) and an empty box; torn down afterwards."""
    from tests.support.demo_box import make_demo
    from tests.support.sandbox import free_port, new_run_dir, restore, snapshot

    root = new_run_dir("bootstrap")  # where the units can see it, wherever the checkout is
    d = root / "box"
    snap = snapshot(own_sandbox)
    try:
        cfg = make_demo(d, sandbox_dir=own_sandbox.sandbox.dir, unit_dir=own_sandbox.unit_dir, port=free_port())
        data = yaml.safe_load(cfg.read_text())
        packed = next(p for p in (d / "artifacts").iterdir() if p.is_dir() and (p / "MANIFEST").is_file())
        box = d / "box"
        for sub in ("home", "tmp"):
            (box / sub).mkdir(parents=True)
        bundle_dir = box / packed.name
        shutil.copytree(packed, bundle_dir)  # as scp -rp / rsync -a bring it to the box
        yield {"dir": d, "cfg": cfg, "box": box, "bundle": bundle_dir, "root": d / "demo-root",
               "port": data["serve"]["port"], "env": own_sandbox}
    finally:
        restore(own_sandbox, snap)
        if not os.environ.get("DEPLOYTOOL_E2E_KEEP"):
            shutil.rmtree(root, ignore_errors=True)


def _nothing_written(fresh, before: dict) -> None:
    assert tree(fresh["root"]) == before, "the box's paths changed"
    assert not list((fresh["box"] / "tmp").iterdir()), "the staging dir was left behind"
    assert not (fresh["root"] / "opt" / "deploytool" / "releases").exists()


def _refused(fresh, bundle: Path, code: int, python: str = SYSTEM_PYTHON) -> subprocess.CompletedProcess[str]:
    """Run BUNDLE/bootstrap on the box (--no-start); assert exit `code` and that nothing was written."""
    before = tree(fresh["root"])
    r = on_box(fresh["box"], [python, str(bundle / "bootstrap"), "--config", str(fresh["cfg"]), "--no-start"])
    assert r.returncode == code, r.stdout + r.stderr
    _nothing_written(fresh, before)
    return r


# ------------------------------------------------------------------------------------------------ bad input


def test_bundle_carries_the_bootstrap_listed_in_its_manifest(fresh):
    """pack writes deploy_tool/box/bootstrap.py as BUNDLE/bootstrap, mode 0755, listed in the MANIFEST."""
    man = json.loads((fresh["bundle"] / "MANIFEST").read_text())
    ent = {f["path"]: f for f in man["files"]}
    assert ent["bootstrap"]["mode"] == "0755"
    assert (fresh["bundle"] / "bootstrap").read_bytes() == (REPO / "deploy_tool" / "box" / "bootstrap.py").read_bytes()
    assert any(p.startswith("tool/wheels/deploytool-") for p in ent)


@pytest.mark.skipif(not OLD_PYTHONS, reason="no Python older than 3.11 on this machine (pyenv's 3.10/2.7)")
@pytest.mark.parametrize("python", OLD_PYTHONS, ids=lambda p: p.parts[-3])
def test_old_python_is_refused_before_anything_is_written(fresh, python):
    """A python3 older than 3.11 (even 2.7) gets one clear line and exit 16; the box stays untouched."""
    r = _refused(fresh, fresh["bundle"], 16, python=str(python))
    assert "needs Python 3.11 or newer" in r.stderr and "Traceback" not in r.stderr


def test_bundle_without_tool_wheels_is_refused(fresh, tmp_path):
    """A signed bundle that carries no deploytool wheels: exit 6 naming tool/wheels, nothing written."""
    from deploy_tool import bundle as bundle_mod

    info = bundle_mod.write_bundle(
        [bundle_mod.Entry("bootstrap", (REPO / "deploy_tool" / "box" / "bootstrap.py").read_bytes(), 0o755),
         bundle_mod.Entry("config.json", b"{}\n", 0o644)],
        fresh["box"] / "no-tool", name="cpu-demo", key_path=fresh["dir"] / "keys" / "deploytool.key",
        archive=False)
    try:
        r = _refused(fresh, info.directory, 6)
        assert "no deploytool wheels" in r.stderr and "tool/wheels/" in r.stderr and "Traceback" not in r.stderr
    finally:
        shutil.rmtree(fresh["box"] / "no-tool")


def test_damaged_tool_wheel_is_refused_before_install(fresh):
    """One flipped byte in a tool wheel: exit 6 naming the wheel (checked against the MANIFEST), nothing written."""
    bad = fresh["box"] / "damaged"
    shutil.copytree(fresh["bundle"], bad)
    try:
        whl = next((bad / "tool" / "wheels").glob("click-*.whl"))
        data = bytearray(whl.read_bytes())
        data[len(data) // 2] ^= 0xFF
        whl.write_bytes(bytes(data))
        r = _refused(fresh, bad, 6)
        assert whl.name in r.stderr and "does not match the MANIFEST" in r.stderr
    finally:
        shutil.rmtree(bad)


def test_untrusted_signer_is_refused_before_any_bundle_code_runs(fresh, tmp_path):
    """MANIFEST.sig by a key the box does not trust: exit 6 untrusted-key from the stdlib check, no venv made."""
    from deploy_tool import manifest

    manifest.generate_keypair(tmp_path / "other.key", tmp_path / "other.pub")
    bad = fresh["box"] / "other-signer"
    shutil.copytree(fresh["bundle"], bad)
    try:
        (bad / "MANIFEST.sig").write_bytes(manifest.sign((bad / "MANIFEST").read_bytes(), tmp_path / "other.key"))
        r = _refused(fresh, bad, 6)
        assert "untrusted-key" in r.stderr and "creating deploytool's venv" not in r.stderr
    finally:
        shutil.rmtree(bad)


def test_wheel_swapped_with_its_manifest_line_is_refused_by_the_signature(fresh):
    """A tool wheel changed and its MANIFEST hash updated to match: the signature fails first (exit 6)."""
    bad = fresh["box"] / "swapped"
    shutil.copytree(fresh["bundle"], bad)
    try:
        whl = next((bad / "tool" / "wheels").glob("click-*.whl"))
        old = hashlib.sha256(whl.read_bytes()).hexdigest()
        data = bytearray(whl.read_bytes())
        data[len(data) // 2] ^= 0xFF
        whl.write_bytes(bytes(data))
        man = (bad / "MANIFEST").read_bytes()
        assert old.encode() in man
        (bad / "MANIFEST").write_bytes(man.replace(old.encode(), hashlib.sha256(data).hexdigest().encode()))
        r = _refused(fresh, bad, 6)
        assert "signature-invalid" in r.stderr and "creating deploytool's venv" not in r.stderr
    finally:
        shutil.rmtree(bad)


def test_read_only_target_is_refused_before_anything_is_written(fresh):
    """The box's paths on a read-only mount: bundle verified, then exit 17 naming them; nothing written."""
    root = fresh["root"]
    before = tree(root)
    script = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && exec "$@"')
    r = on_box(fresh["box"], [SYSTEM_PYTHON, str(fresh["bundle"] / "bootstrap"), "--config", str(fresh["cfg"]),
                              "--no-start"],
               wrap=["unshare", "--net", "--mount", "--", "sh", "-c", script, "sh", str(root)])
    assert r.returncode == 17, r.stdout + r.stderr
    assert "read-only file system" in r.stderr and str(root / "opt" / "deploytool" / "releases") in r.stderr
    assert "OK: signed by trusted key" in r.stderr  # the real signature check ran first, from staging
    _nothing_written(fresh, before)


def test_unsupported_wheel_and_record_mismatch_are_refused(tmp_path):
    """The stdlib installer refuses a wheel for another Python and a wheel whose file differs from its RECORD."""
    assert bootstrap.wheel_supported("x-1-cp312-cp312-manylinux_2_17_x86_64.whl", (3, 11), "x86_64")
    assert bootstrap.wheel_supported("x-1-cp311-cp311-manylinux_2_17_aarch64.whl", (3, 11), "x86_64")
    assert bootstrap.wheel_supported("x-1-cp39-abi3-manylinux_2_17_x86_64.whl", (3, 11), "x86_64") is None
    assert bootstrap.wheel_supported("x-1-py3-none-any.whl", (3, 11), "x86_64") is None
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True)
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("demo.py", "print('changed')\n")
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
        z.writestr("demo-1.0.dist-info/RECORD", "demo.py,sha256=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA,17\n"
                   "demo-1.0.dist-info/RECORD,,\n")
    with pytest.raises(bootstrap.Refused) as ei:
        bootstrap.install_wheel(str(whl), str(tmp_path / "v"))
    assert "demo.py does not match its RECORD" in ei.value.message


def test_stdlib_ed25519_agrees_with_cryptography(tmp_path):
    """The bootstrap's pure-Python Ed25519 check: RFC 8032 vector 1, and the same verdicts as `cryptography`."""
    from deploy_tool import manifest

    pk = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
    sig = bytes.fromhex("e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e3970"
                        "1cf9b46bd25bf5f0595bbe24655141438e7a100b")
    assert bootstrap.ed25519_verify(pk, b"", sig)
    assert not bootstrap.ed25519_verify(pk, b"\0", sig)
    manifest.generate_keypair(tmp_path / "k.key", tmp_path / "keys" / "k.pub")
    for n in range(8):
        msg = os.urandom(n * 37)
        s = manifest.sign(msg, tmp_path / "k.key")
        assert bootstrap.check_signature(msg, s, str(tmp_path / "keys")) == \
            manifest.verify_signature(msg, s, tmp_path / "keys")
        with pytest.raises(bootstrap.Refused, match="signature-invalid"):
            bootstrap.check_signature(msg + b"x", s, str(tmp_path / "keys"))
        body = json.loads(s)
        raw = bytearray(base64.b64decode(body["signature"]))
        raw[n] ^= 1
        body["signature"] = base64.b64encode(bytes(raw)).decode()
        keys, _revoked = bootstrap.load_public_keys(str(tmp_path / "keys"))
        assert not bootstrap.ed25519_verify(keys[body["key_id"]][0], msg, bytes(raw))


def test_keys_dir_comes_from_the_config(tmp_path):
    """--keys is optional: paths.keys_dir of the config (relative to it), else /etc/deploytool/keys."""
    c = tmp_path / "deploytool.yaml"
    c.write_text("version: 1\nserve:\n  keys_dir: nope\npaths:\n  root: r  # x\n  keys_dir: 'k/keys'  # trusted\n")
    assert bootstrap.keys_dir_from_config(str(c)) == str(tmp_path / "k" / "keys")
    c.write_text("version: 1\npaths:\n  root: /opt/deploytool\n")
    assert bootstrap.keys_dir_from_config(str(c)) == "/etc/deploytool/keys"


# ------------------------------------------------------------------------------------------------ the real thing


@pytest.fixture(scope="module")
def bootstrapped(fresh):
    """bootstrap -> install --no-start in an empty network namespace with only the system python3."""
    r = on_box(fresh["box"], [SYSTEM_PYTHON, str(fresh["bundle"] / "bootstrap"), "--config", str(fresh["cfg"]),
                              "--no-start"])
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"\n--- bootstrap stdout:\n{r.stdout}\n--- bootstrap stderr:\n{r.stderr}")
    return {**fresh, "out": r}


def test_bootstrap_installs_the_release_with_its_own_deploytool(bootstrapped):
    """The release holds deploytool's venv from the bundle's wheels; the units' ExecStartPre calls it via current."""
    f = bootstrapped
    assert "installed" in f["out"].stdout + f["out"].stderr
    assert not list((f["box"] / "tmp").iterdir()), "staging left behind"
    cur = f["root"] / "opt" / "deploytool" / "current"
    rid = os.readlink(cur).rsplit("/", 1)[-1]
    tool = cur / "tool" / "bin" / "deploytool"
    real = Path(os.path.realpath(tool))
    assert real == (f["root"] / "opt" / "deploytool" / "releases" / rid / "tool" / "venv" / "bin" / "deploytool")
    sp = real.parent.parent / "lib" / "python3.11" / "site-packages"
    assert (next(sp.glob("deploytool-*.dist-info")) / "INSTALLER").read_text() == "deploytool-bootstrap\n"
    assert not (real.parent / "pip").exists()  # no pip, no ensurepip needed on the box
    unit = (f["env"].unit_dir / "ftllm-dflash.service").read_text()
    pre = next(ln for ln in unit.splitlines() if ln.startswith("ExecStartPre="))
    # systemd's exec prefixes (+ full privileges, - ignore failure, ...) aside, the command is the release's tool
    assert pre.split("=", 1)[1].lstrip("+!@:") == f"{cur}/tool/bin/deploytool --config {f['cfg']} verify ftllm-dflash --await-port"
    r = on_box(f["box"], [str(tool), "--version"])
    assert r.returncode == 0 and "deploytool" in r.stdout


def test_backend_starts_with_the_bootstrapped_verifier(bootstrapped):
    """switch (by the bootstrapped deploytool, host netns) starts ftllm; the journal shows its ExecStartPre verify."""
    f = bootstrapped
    cur = f["root"] / "opt" / "deploytool" / "current"
    tool = str(cur / "tool" / "bin" / "deploytool")
    r = on_box(f["box"], [tool, "--config", str(f["cfg"]), "switch", "ftllm"], netns=False)
    assert r.returncode == 0, r.stdout + r.stderr
    sd = f["env"].systemd
    deadline = time.monotonic() + 60  # the switch's gate passed; the unit's own readiness wait ends moments later
    while sd.show("ftllm-dflash.service").active_state == "activating" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sd.show("ftllm-dflash.service").active_state == "active"
    # the unit as systemd loaded it runs the bootstrapped deploytool before the server...
    show = subprocess.run(f["env"].sandbox.exec_argv("systemctl", "show", "-p", "ExecStartPre",
                                                     "ftllm-dflash.service"), capture_output=True, text=True,
                          timeout=60).stdout
    assert f"path={tool} ;" in show and f"argv[]={tool} --config {f['cfg']} verify ftllm-dflash --await-port ;" in show, show
    # ...and its verify line is in the unit's journal (journald reads _CMDLINE from /proc when the line arrives,
    # so a process that already exited has none: where it is there, it must be the bootstrapped tool)
    j = subprocess.run(f["env"].sandbox.exec_argv("journalctl", "-u", "ftllm-dflash.service", "-o", "json",
                                                  "--no-pager"), capture_output=True, text=True, timeout=60)
    entries = [json.loads(ln) for ln in j.stdout.splitlines() if ln.strip()]
    hits = [e for e in entries if str(e.get("MESSAGE", "")).startswith("ftllm-dflash: all ")
            and "fingerprints match" in str(e.get("MESSAGE", ""))]
    assert hits, j.stdout[-3000:]
    assert all(e.get("SYSLOG_IDENTIFIER") == "deploytool" for e in hits)
    assert all(f"{tool} --config {f['cfg']} verify ftllm-dflash" in e["_CMDLINE"] for e in hits if e.get("_CMDLINE"))


def test_modified_tool_file_fails_verify_and_the_start(bootstrapped):
    """A changed module in the tool venv: verify exits 7 naming the file; systemd refuses the start; restored ok."""
    f = bootstrapped
    cur = f["root"] / "opt" / "deploytool" / "current"
    tool = str(cur / "tool" / "bin" / "deploytool")
    sp = Path(os.path.realpath(tool)).parent.parent / "lib" / "python3.11" / "site-packages"
    victim = sp / "deploy_tool" / "errors.py"
    orig = victim.read_bytes()
    victim.write_bytes(orig + b"\n# changed after install\n")
    try:
        r = on_box(f["box"], [tool, "--config", str(f["cfg"]), "verify", "llamacpp-tensor"], netns=False)
        assert r.returncode == 7, r.stdout + r.stderr
        assert "deploy_tool/errors.py" in r.stdout
        assert "release/tool/venv/lib/python3.11/site-packages/deploy_tool/errors.py" in r.stdout
        res = subprocess.run(f["env"].sandbox.exec_argv("systemctl", "start", "llamacpp-tensor.service"),
                             capture_output=True, text=True, timeout=120)
        assert res.returncode != 0
        assert "deploy_tool/errors.py" in f["env"].systemd.journal("llamacpp-tensor.service", lines=60)
    finally:
        victim.write_bytes(orig)
        f["env"].systemd.reset_failed("llamacpp-tensor.service")
    r = on_box(f["box"], [tool, "--config", str(f["cfg"]), "verify", "llamacpp-tensor"], netns=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_added_pth_file_in_tool_venv_is_named(bootstrapped):
    """A .pth file dropped into the tool venv (run at every Python start) is drift, named by verify (exit 7)."""
    f = bootstrapped
    tool = str(f["root"] / "opt" / "deploytool" / "current" / "tool" / "bin" / "deploytool")
    sp = Path(os.path.realpath(tool)).parent.parent / "lib" / "python3.11" / "site-packages"
    pth = sp / "zz-injected.pth"
    pth.write_text("# nothing\n")
    try:
        r = on_box(f["box"], [tool, "--config", str(f["cfg"]), "verify", "ftllm-dflash"], netns=False)
        assert r.returncode == 7, r.stdout + r.stderr
        assert "zz-injected.pth" in r.stdout
    finally:
        pth.unlink()


@pytest.mark.parametrize("dirname", ["plain", "with space", "x" * 120])
def test_console_script_runs_under_any_interpreter_path(tmp_path: Path, dirname: str) -> None:
    """A console script of deploytool's wheel installer runs from a venv under a path with a space or longer
    than the kernel's 127-byte shebang (a checkout in "/tmp/x y" holds the test and bench boxes)."""
    d = tmp_path / dirname
    d.mkdir()
    python = d / "python"
    python.symlink_to(sys.executable)
    script = d / "tool"
    script.write_bytes(bootstrap._script(str(python), "json", "tool.main"))
    script.chmod(0o755)
    r = subprocess.run([str(script)], input='{"a": [1]}', capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"a": [1]}
    assert script.read_text().startswith("#!/bin/sh\n" if " " in str(python) or len(str(python)) > 125 else "#!/")
