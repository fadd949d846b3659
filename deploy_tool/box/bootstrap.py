#!/usr/bin/env python3
# ruff: noqa: UP031, B904, SIM105, SIM114, SIM115
"""deploytool bootstrap: a box with nothing but python3 (3.11 or newer) installs a bundle with no network.

    python3 BUNDLE_DIR/bootstrap [--config PATH] [--keys DIR] [--staging-dir DIR] [INSTALL OPTIONS...]

`pack` writes this file (deploy_tool/box/bootstrap.py) to the root of every bundle as `bootstrap`, mode 0755,
listed in the MANIFEST like every other file. It runs in this order and stops at the first problem:

1. The interpreter must be CPython 3.11 or newer. This file parses on Python 2.7 and every 3.x (no f-strings,
   no annotations, no keyword-only arguments), so an old python3 gets this message, not a SyntaxError.
2. The config and the keys directory (with every key in it, and every directory above them) must be root's alone
   (StrictModes, as deploy_tool/strictmodes.py: owned by root, not writable by group or other), else exit 23.
   The MANIFEST's Ed25519 signature is checked against the box's trusted keys (--keys DIR, else paths.keys_dir
   of the config, else /etc/deploytool/keys) with the pure-Python verifier below (RFC 8032), because the
   `cryptography` wheel is itself among what the bundle carries: no code from the bundle runs before this.
   A key listed in KEYS/revoked, or past the `not-after` its key file carries, is refused (exit 25), as
   deploytool's own keyring (deploy_tool/keyring.py) refuses it. The MANIFEST bytes that were verified are the
   ones parsed.
3. The MANIFEST lists deploytool's wheels under tool/wheels/ (deploytool's own wheel and its dependencies').
   Each is copied into a private staging directory and the copy's size and SHA-256 are checked against the
   MANIFEST. A venv is created in staging with `python3 -m venv --without-pip` (no ensurepip, which Debian
   and Ubuntu ship separately as python3-venv) and the copies are unpacked into it by the stdlib installer
   below: every file is checked against its wheel's RECORD, console scripts are generated, a new RECORD lists
   the SHA-256 of every installed file. Wheels for another Python or machine are refused by their tags.
4. The staged deploytool checks the whole bundle again (`bundle verify`: signature with `cryptography`, then
   every file's size, mode and hash, no extra files) and that every directory `install` writes to is
   writable, then runs `deploytool install BUNDLE_DIR`. install lays deploytool's own venv into the release
   from the same wheels; the units' ExecStartPre runs that one through `current`.
5. The staging directory is removed, whatever happened.

Nothing is written outside the staging directory before the checks of step 4 have passed. Exit codes are
deploytool's (deploy_tool/errors.py): 2 usage, 6 bundle, 16 interpreter too old, 17 OS, 23 a config or key
that is not root's alone, 25 a revoked or expired key, else install's own.
The same module, imported, is install's wheel installer for the release's tool venv (`install_wheels`).
"""

import base64
import calendar
import csv
import hashlib
import io
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile

MIN_PYTHON = (3, 11)
TOOL_WHEELS = "tool/wheels/"
DEFAULT_KEYS_DIR = "/etc/deploytool/keys"
EXIT_USAGE, EXIT_BUNDLE, EXIT_TOO_OLD, EXIT_OS, EXIT_UNSAFE, EXIT_KEY = 2, 6, 16, 17, 23, 25
WHEEL_NAME = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^-]+)(-(?P<build>\d[^-]*))?"
                        r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")
CHUNK = 1 << 20
# Environment a child Python must not inherit: it would see other packages than the venv's own.
DROP_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "PYTHONSAFEPATH", "VIRTUAL_ENV",
            "PYTHONINSPECT", "PYTHONEXECUTABLE")


class Refused(Exception):
    """A problem the person can fix; `code` is the exit code, `hint` what to do."""

    def __init__(self, message, code, hint=None):
        Exception.__init__(self, message)
        self.message = message
        self.code = code
        self.hint = hint


def check_python(version_info=None, implementation=None):
    """Refuse an interpreter older than MIN_PYTHON (or not CPython: the bundle's wheels are CPython's)."""
    v = tuple(version_info or sys.version_info)[:3]
    impl = implementation or platform.python_implementation()
    if tuple(v[:2]) < MIN_PYTHON:
        raise Refused("this python3 is %s; deploytool needs Python %d.%d or newer"
                      % (".".join(str(x) for x in v), MIN_PYTHON[0], MIN_PYTHON[1]), EXIT_TOO_OLD,
                      hint="run the bootstrap with a newer interpreter: python3.11 BUNDLE/bootstrap (on Debian 12 "
                           "and Ubuntu 24.04 the system python3 is new enough)")
    if impl != "CPython":
        raise Refused("this python3 is %s; the bundle's wheels are built for CPython" % impl, EXIT_TOO_OLD,
                      hint="run the bootstrap with the system's CPython, e.g. /usr/bin/python3")


# ------------------------------------------------------------------------------------------------ the bundle

def _read(path, limit, what):
    try:
        with open(path, "rb") as f:
            return f.read(limit + 1)[: limit + 1]
    except OSError as exc:
        raise Refused("%s: %s: %s" % (what, path, exc.strerror), EXIT_BUNDLE,
                      hint="run the bootstrap that is inside an unpacked bundle directory")


def read_manifest(bundle_dir):
    """The MANIFEST's exact bytes and MANIFEST.sig's, read once (what is verified is what is parsed)."""
    data = _read(os.path.join(bundle_dir, "MANIFEST"), 64 << 20, "%s is not a bundle directory" % bundle_dir)
    sig = _read(os.path.join(bundle_dir, "MANIFEST.sig"), 4096, "signature-missing: the bundle has no signature")
    return data, sig


def parse_manifest(data, where="MANIFEST"):
    """The MANIFEST's files as {path: (size, mode, sha256)}, plus the bundle id."""
    try:
        obj = json.loads(data.decode("ascii"))
        files = {}
        for e in obj["files"]:
            files[e["path"]] = (int(e["size"]), int(str(e["mode"]), 8), str(e["sha256"]))
        bundle_id = str(obj["bundle_id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise Refused("%s is not a valid MANIFEST (%s)" % (where, exc), EXIT_BUNDLE,
                      hint="the bundle is damaged; copy it again from where it was packed")
    return files, bundle_id


# ------------------------------------------------------------------------------------------------ Ed25519
# Signature verification after RFC 8032 (section 5.1.7), in plain integers: the bundle's signature is checked
# before any code the bundle carries runs (the `cryptography` wheel is among what it carries). Public data only,
# so constant time does not matter here; deploytool itself verifies again with `cryptography`.

_P = 2 ** 255 - 19
_L = 2 ** 252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)
_SPKI_ED25519 = bytes(bytearray([0x30, 0x2A, 0x30, 0x05, 0x06, 0x03, 0x2B, 0x65, 0x70, 0x03, 0x21, 0x00]))


def _ed_add(p, q):
    a = (p[1] - p[0]) * (q[1] - q[0]) % _P
    b = (p[1] + p[0]) * (q[1] + q[0]) % _P
    c = 2 * p[3] * q[3] * _D % _P
    d = 2 * p[2] * q[2] % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return (e * f % _P, g * h % _P, f * g % _P, e * h % _P)


def _ed_mul(s, p):
    q = (0, 1, 1, 0)
    while s > 0:
        if s & 1:
            q = _ed_add(q, p)
        p = _ed_add(p, p)
        s >>= 1
    return q


def _ed_decompress(b):
    y = int.from_bytes(b, "little")
    sign = y >> 255
    y &= (1 << 255) - 1
    if y >= _P:
        return None
    x2 = (y * y - 1) * pow(_D * y * y + 1, _P - 2, _P) % _P
    if x2 == 0:
        if sign:
            return None
        return (0, y, 1, 0)
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P:
        x = x * _SQRT_M1 % _P
    if (x * x - x2) % _P:
        return None
    if (x & 1) != sign:
        x = _P - x
    return (x, y, 1, x * y % _P)


def _base_point():
    return _ed_decompress((4 * pow(5, _P - 2, _P) % _P).to_bytes(32, "little"))


def ed25519_verify(public, message, signature):
    """True if `signature` (64 bytes) is a valid Ed25519 signature of `message` by `public` (32 bytes)."""
    if len(public) != 32 or len(signature) != 64:
        return False
    a = _ed_decompress(public)
    r = _ed_decompress(signature[:32])
    s = int.from_bytes(signature[32:], "little")
    if a is None or r is None or s >= _L:
        return False
    h = int.from_bytes(hashlib.sha512(signature[:32] + public + message).digest(), "little") % _L
    sb = _ed_mul(s, _base_point())
    rha = _ed_add(r, _ed_mul(h, a))
    return (sb[0] * rha[2] - rha[0] * sb[2]) % _P == 0 and (sb[1] * rha[2] - rha[1] * sb[2]) % _P == 0


_NOT_AFTER = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
_HEADER = re.compile(r"^([A-Za-z][A-Za-z0-9-]*)\s*:\s*(.*?)\s*$")
REVOKED_NAME = "revoked"


def parse_not_after(text):
    """Seconds since the epoch of a not-after value (UTC, YYYY-MM-DDTHH:MM:SSZ), or None (deploy_tool.keyring)."""
    if not _NOT_AFTER.match(text):
        return None
    try:
        return calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return None


def parse_key_file(text, path):
    """(key id, raw 32-byte key, not-after text or None, its epoch or None) of one key file, the format of
    deploy_tool.keyring: `# comments` and at most one `not-after: ...` line before the PEM block."""
    lines = text.split("\n")
    stripped = [ln.strip() for ln in lines]
    try:
        begin = stripped.index("-----BEGIN PUBLIC KEY-----")
        end = stripped.index("-----END PUBLIC KEY-----", begin + 1)
    except ValueError:
        raise Refused("trusted-key-invalid: trusted key %s is not a PEM public key" % path, EXIT_BUNDLE,
                      hint="remove or replace that file")
    not_after = None
    for n, line in enumerate(stripped[:begin]):
        if not line or line.startswith("#"):
            continue
        m = _HEADER.match(line)
        if not m or m.group(1).lower() != "not-after" or not_after is not None or parse_not_after(m.group(2)) is None:
            raise Refused("key-metadata-invalid: trusted key %s line %d: %r is not one `not-after: "
                          "YYYY-MM-DDTHH:MM:SSZ` or a # comment" % (path, n + 1, line[:60]), EXIT_KEY,
                          hint="fix or remove that line of %s" % path)
        not_after = m.group(2)
    if any(stripped[end + 1:]):
        raise Refused("trusted-key-invalid: trusted key %s has text after its key" % path, EXIT_BUNDLE,
                      hint="keep one key per file; remove what follows the key")
    try:
        body = "".join("".join(lines[begin + 1:end]).split())
        der = base64.b64decode(body.encode("ascii"))
        if base64.b64encode(der).decode("ascii") != body:
            der = b""
    except (ValueError, TypeError, UnicodeError):
        der = b""
    if len(der) != 44 or der[:12] != _SPKI_ED25519:
        raise Refused("trusted-key-invalid: trusted key %s is not an Ed25519 PEM public key" % path, EXIT_BUNDLE,
                      hint="remove or replace that file")
    raw = der[12:]
    return hashlib.sha256(raw).hexdigest()[:16], raw, not_after, parse_not_after(not_after) if not_after else None


def parse_revocations(text, path):
    """{key id: (line number, reason)} of a revocation list (deploy_tool.keyring's format)."""
    out = {}
    for n, line in enumerate(text.split("\n")):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        kid, _, reason = line.partition(" ")
        if not re.match(r"^[0-9a-f]{16}$", kid) or re.search(r"[\x00-\x08\x0a-\x1f\x7f]", reason):
            raise Refused("revocation-list-invalid: revocation list %s line %d: %r does not start with a key id "
                          "(16 lowercase hex digits)" % (path, n + 1, line[:60]), EXIT_KEY,
                          hint="write one `KEYID reason` per line in %s" % path)
        if kid not in out:
            out[kid] = (n + 1, reason.strip())
    return out


def _read_ascii(path, limit, reason, code):
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError("larger than %d bytes" % limit)
        return data.decode("ascii")
    except (OSError, ValueError, UnicodeError) as exc:
        raise Refused("%s: %s cannot be read as a key file: %s" % (reason, path, exc), code,
                      hint="remove or replace that file")


def load_public_keys(keys_dir):
    """({key_id: (raw 32-byte key, not-after text, not-after epoch, path)}, {key_id: (line, reason)}) of the
    Ed25519 key files (*.pub) and the revocation list in keys_dir."""
    try:
        names = sorted(n for n in os.listdir(keys_dir) if n.endswith(".pub"))
    except OSError as exc:
        raise Refused("no-trusted-keys: trusted keys directory %s: %s" % (keys_dir, exc.strerror), EXIT_BUNDLE,
                      hint="copy the signer's .pub file there, or pass --keys DIR")
    keys = {}
    for n in names:
        p = os.path.join(keys_dir, n)
        kid, raw, not_after, epoch = parse_key_file(_read_ascii(p, 8192, "trusted-key-invalid", EXIT_BUNDLE), p)
        if kid not in keys:
            keys[kid] = (raw, not_after, epoch, p)
    revoked = {}
    rl = os.path.join(keys_dir, REVOKED_NAME)
    if os.path.lexists(rl):
        revoked = parse_revocations(_read_ascii(rl, 1 << 20, "revocation-list-invalid", EXIT_KEY), rl)
    if not keys:
        raise Refused("no-trusted-keys: no trusted public keys (*.pub) in %s" % keys_dir, EXIT_BUNDLE,
                      hint="copy the signer's .pub file there, or pass --keys DIR")
    return keys, revoked


def check_signature(manifest, sig, keys_dir, now=None):
    """Check MANIFEST.sig over exactly these MANIFEST bytes against the trusted keys; return the key id. A key
    revoked in keys_dir/revoked or past its not-after is refused (exit 25), as deploytool refuses it."""
    try:
        obj = json.loads(sig.decode("ascii"))
        kid = obj["key_id"]
        raw = base64.b64decode(obj["signature"])
        if obj["algorithm"] != "ed25519" or len(raw) != 64 or not re.match(r"^[0-9a-f]{16}$", kid):
            raise ValueError("not an ed25519 signature")
    except (ValueError, KeyError, TypeError) as exc:
        raise Refused("signature-malformed: MANIFEST.sig is not a deploytool signature (%s)" % exc, EXIT_BUNDLE)
    keys, revoked = load_public_keys(keys_dir)
    if kid in revoked:
        line, reason = revoked[kid]
        raise Refused("key-revoked: the bundle is signed by key %s, which is revoked in %s line %d%s"
                      % (kid, os.path.join(keys_dir, REVOKED_NAME), line, " (%s)" % reason if reason else ""),
                      EXIT_KEY, hint="install a bundle signed by a key this box trusts (docs/trust.md)")
    if kid not in keys:
        raise Refused("untrusted-key: the bundle is signed by key %s, which is not among the trusted keys in %s (%s)"
                      % (kid, keys_dir, ", ".join(sorted(keys))), EXIT_BUNDLE,
                      hint="if you trust the signer, copy their .pub file into the keys directory")
    public, not_after, epoch, path = keys[kid]
    if epoch is not None and (time.time() if now is None else now) > epoch:
        raise Refused("key-expired: the bundle is signed by key %s (%s), which expired at %s (not-after)"
                      % (kid, path, not_after), EXIT_KEY,
                      hint="install a bundle signed by a current key; if this key is still safe, move its "
                           "not-after line in %s later" % path)
    if not ed25519_verify(public, manifest, raw):
        raise Refused("signature-invalid: the MANIFEST signature does not verify with trusted key %s: the "
                      "MANIFEST or its signature was altered" % kid, EXIT_BUNDLE,
                      hint="copy the bundle again from where it was packed")
    return kid


# ------------------------------------------------------------------------------------------------ StrictModes
# The rule of deploy_tool/strictmodes.py (judge), for the two things this script trusts before deploytool runs:
# the config (it names the keys directory) and the keys directory with its keys. A key planted in a writable keys
# directory would make this script run the planter's bundle as root. tests/test_strictmodes.py holds the copies
# to the same verdicts.

def judge(uid, mode, above=False, child_uid=None):
    """What is wrong with one path by its lstat owner and mode (deploy_tool.strictmodes.judge), as a list."""
    problems = []
    if uid != 0:
        problems.append("owned by uid %d, not root" % uid)
    if stat.S_ISLNK(mode):
        return problems
    w = mode & 0o022
    sticky_ok = above and stat.S_ISDIR(mode) and bool(mode & stat.S_ISVTX) and uid == 0 and child_uid is not None
    if w and not sticky_ok:
        problems.append("writable by %s" % ("group and others" if w == 0o022 else "group" if w & 0o020 else "others"))
    return problems


def _chain(path):
    parts = [x for x in os.path.abspath(path).split("/") if x]
    return ["/"] + ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def unsafe_paths(paths):
    """[(path, uid, gid, mode, problems)] of `paths` and every directory above each, along the path as written and
    along its real path; missing components end a chain."""
    found = []
    seen = set()
    for path in paths:
        chains = [_chain(path)]
        if os.path.realpath(path) != os.path.abspath(path):
            chains.append(_chain(os.path.realpath(path)))
        for chain in chains:
            for i, p in enumerate(chain):
                try:
                    st = os.lstat(p)
                except OSError:
                    break
                last = i == len(chain) - 1
                child = None
                if not last:
                    try:
                        child = os.lstat(chain[i + 1]).st_uid
                    except OSError:
                        child = None
                problems = judge(st.st_uid, st.st_mode, above=not last, child_uid=child)
                if problems and p not in seen:
                    seen.add(p)
                    found.append((p, st.st_uid, st.st_gid, st.st_mode, problems))
                if stat.S_ISLNK(st.st_mode) and not last:
                    break
    return found


def check_trust_paths(config, keys_dir):
    """Refuse (exit 23) a config or keys directory (or a key in it, or a directory above them) that is not root's
    alone, naming the path, its owner and mode, and the fix."""
    paths = [config, keys_dir]
    try:
        paths += [os.path.join(keys_dir, n) for n in sorted(os.listdir(keys_dir))]
    except OSError:
        pass
    bad = unsafe_paths(paths)
    if bad:
        p, uid, gid, mode, problems = bad[0]
        fix = " && ".join((["chown root %s" % p] if any(x.startswith("owned") for x in problems) else [])
                          + (["chmod go-w %s" % p] if any(x.startswith("writable") for x in problems) else []))
        raise Refused("unsafe-path: %s: owner %d:%d, mode %04o, %s; a key or config that another user can change "
                      "could make this bootstrap run their bundle as root%s" % (
                          p, uid, gid, stat.S_IMODE(mode), " and ".join(problems),
                          " (and %d more)" % (len(bad) - 1) if len(bad) > 1 else ""),
                      EXIT_UNSAFE, hint="%s; the config, the keys directory and the directories above them must be "
                                        "owned by root and not writable by group or other" % fix)


def keys_dir_from_config(config):
    """paths.keys_dir of a deploytool.yaml (block style, as `deploytool init` writes it), else the default.

    A config this scan misreads points at a directory without the signer's key, which is refused, never
    trusted: deploytool's own `bundle verify` reads the config properly right after.
    """
    value = None
    try:
        with open(config) as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        lines = []
    in_paths = False
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            in_paths = line.split("#")[0].strip() == "paths:"
            continue
        m = re.match(r"^\s+keys_dir:\s*(.*?)\s*(#.*)?$", line)
        if in_paths and m and m.group(1):
            value = m.group(1).strip("'\"")
    if not value:
        return DEFAULT_KEYS_DIR
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(config)), value))


def tool_wheels(bundle_dir, files):
    """The MANIFEST's tool wheels, refusing a bundle without them or with unlisted extra wheels."""
    wheels = sorted(p for p in files if p.startswith(TOOL_WHEELS) and p.endswith(".whl"))
    if not any(os.path.basename(p).startswith("deploytool-") for p in wheels):
        raise Refused("bundle %s carries no deploytool wheels (%s in its MANIFEST)"
                      % (bundle_dir, TOOL_WHEELS + "deploytool-*.whl"), EXIT_BUNDLE,
                      hint="pack the bundle with bundle.tool_wheels_dir set (`deploytool lock` fills it); "
                           "on a box that already has deploytool, run `deploytool install BUNDLE` instead")
    d = os.path.join(bundle_dir, TOOL_WHEELS)
    try:
        present = sorted(TOOL_WHEELS + n for n in os.listdir(d))
    except OSError as exc:
        raise Refused("cannot list %s: %s" % (d, exc.strerror), EXIT_BUNDLE)
    extra = [p for p in present if p not in files]
    if extra:
        raise Refused("%s holds files its MANIFEST does not list: %s" % (d, ", ".join(extra)), EXIT_BUNDLE,
                      hint="the bundle was changed after packing; copy it again from where it was packed")
    return wheels


def copy_checked(src, dst, size, sha256):
    """Copy src to a new file dst, hashing what was written; refuse a size or hash other than the MANIFEST's."""
    h = hashlib.sha256()
    n = 0
    try:
        fin = open(src, "rb")
    except OSError as exc:
        raise Refused("cannot read %s: %s" % (src, exc.strerror), EXIT_BUNDLE)
    with fin, open(dst, "xb") as fout:
        while True:
            chunk = fin.read(CHUNK)
            if not chunk:
                break
            h.update(chunk)
            fout.write(chunk)
            n += len(chunk)
    if n != size or h.hexdigest() != sha256:
        raise Refused("%s does not match the MANIFEST (size %d, sha256 %s; the MANIFEST says size %d, sha256 %s)"
                      % (src, n, h.hexdigest()[:12], size, sha256[:12]), EXIT_BUNDLE,
                      hint="the bundle is damaged or was changed; copy it again from where it was packed")


# ------------------------------------------------------------------------------------------------ wheels

def _b64(digest):
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def wheel_supported(filename, version_info=None, machine=None):
    """None if a wheel's tags fit this interpreter and machine, else why not."""
    m = WHEEL_NAME.match(filename)
    if not m:
        return "not a wheel file name"
    vi = tuple(version_info or sys.version_info)
    machine = machine or platform.machine()
    cp = "cp%d%d" % (vi[0], vi[1])
    abis = m.group("abi").split(".")
    ok_py = False
    for t in m.group("py").split("."):
        mt = re.match(r"^(py|cp)(\d)(\d*)$", t)
        if not mt or int(mt.group(2)) != vi[0]:
            continue
        minor = int(mt.group(3)) if mt.group(3) else None
        if mt.group(1) == "py" and (minor is None or minor <= vi[1]):
            ok_py = True
        elif mt.group(1) == "cp" and (t == cp or ("abi3" in abis and minor is not None and minor <= vi[1])):
            ok_py = True
    if not ok_py:
        return "built for %s, this is CPython %d.%d" % (m.group("py"), vi[0], vi[1])
    if not any(a in ("none", "abi3", cp) for a in abis):
        return "built for the ABI %s, this is %s" % (m.group("abi"), cp)
    plats = m.group("plat").split(".")
    if "any" not in plats and not any(p.startswith(("linux", "manylinux", "musllinux")) and p.endswith(machine)
                                      for p in plats):
        return "built for %s, this machine is linux %s" % (m.group("plat"), machine)
    return None


def venv_version(venv):
    """(major, minor) of the interpreter a venv was made with, from its pyvenv.cfg."""
    try:
        with open(os.path.join(venv, "pyvenv.cfg")) as f:
            for line in f:
                k, _, v = line.partition("=")
                if k.strip() in ("version", "version_info"):
                    parts = v.strip().split(".")
                    return int(parts[0]), int(parts[1])
    except (OSError, ValueError, IndexError):
        pass
    raise Refused("%s has no readable pyvenv.cfg with the Python version" % venv, EXIT_OS)


def _safe_rel(name, what):
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise Refused("%s: unsafe path %r" % (what, name), EXIT_BUNDLE)
    return name


def _shebang(python):
    """The first line(s) of a console script, which runs the interpreter isolated (-I: no PYTHON* variables, no
    user site, not the script's directory on sys.path): the units run deploytool as root before every start, and
    nothing in the environment may steer what Python imports then. The kernel ends `#!` at the first blank (one
    argument may follow) and reads at most 127 bytes, so under a path with a space (a checkout in "/tmp/x y") a
    plain shebang runs "/tmp/x", or nothing: there, as pip does, /bin/sh execs the interpreter and Python reads
    that exec line as a string literal."""
    if " " not in python and "\t" not in python and len(python) <= 122:
        return "#!%s -I\n" % python
    if any(c in python for c in "\"$`\\'\n"):
        raise Refused("cannot write a console script for the interpreter path %r (a quote, $, ` or \\ in it)"
                      % python, EXIT_OS)
    return "#!/bin/sh\n'''exec' \"%s\" -I \"$0\" \"$@\"\n' '''\n" % python


def _script(python, module, attr):
    top = attr.split(".")[0]
    return (_shebang(python) + "# -*- coding: utf-8 -*-\n# generated by the deploytool wheel installer\n"
            "import re\nimport sys\nfrom %s import %s\nif __name__ == \"__main__\":\n"
            "    sys.argv[0] = re.sub(r\"(-script\\.pyw|\\.exe)?$\", \"\", sys.argv[0])\n"
            "    sys.exit(%s())\n" % (module, top, attr)).encode("utf-8")


def install_wheel(whl, venv, python_path=None, compile_pyc=True):
    """Unpack one wheel into the venv (purelib/platlib -> site-packages, scripts -> bin); return the files.

    Every member is checked against the wheel's own RECORD (sha256 and size) before it is written; files are
    created exclusively (two wheels never overwrite each other). python_path is the interpreter written into
    script shebangs (default: the venv's bin/python, where it is now; install passes the release's final path).
    The modules are byte-compiled by the venv's own interpreter as checked-hash .pyc files (Python checks them
    against their source's hash at import, never by timestamp) and listed in the new RECORD with their hashes,
    so a .pyc planted or swapped in __pycache__ is drift like any other file.
    """
    name = os.path.basename(whl)
    vi = venv_version(venv)
    why = wheel_supported(name, vi)
    if why:
        raise Refused("tool wheel %s cannot be installed here: %s" % (name, why), EXIT_BUNDLE,
                      hint="pack the bundle with the box's Python (bundle.python) on the box's kind of machine")
    sp = os.path.join(venv, "lib", "python%d.%d" % (vi[0], vi[1]), "site-packages")
    bindir = os.path.join(venv, "bin")
    python_path = python_path or os.path.join(os.path.abspath(venv), "bin", "python")
    try:
        z = zipfile.ZipFile(whl)
    except (OSError, zipfile.BadZipfile) as exc:
        raise Refused("tool wheel %s is not a valid zip file: %s" % (name, exc), EXIT_BUNDLE)
    with z:
        infos = [i for i in z.infolist() if not i.filename.endswith("/")]
        for i in infos:
            _safe_rel(i.filename, name)
        records = [i.filename for i in infos if re.match(r"^[^/]+\.dist-info/RECORD$", i.filename)]
        if len(records) != 1:
            raise Refused("tool wheel %s has %d .dist-info/RECORD files (one expected)" % (name, len(records)),
                          EXIT_BUNDLE)
        dist_info = records[0].split("/")[0]
        data_dir = dist_info[: -len(".dist-info")] + ".data"
        expected = {}
        for row in csv.reader(io.StringIO(z.read(records[0]).decode("utf-8"))):
            if row and len(row) >= 2 and row[1]:
                algo, _, digest = row[1].partition("=")
                expected[row[0]] = (algo, digest, row[2] if len(row) > 2 else "")
        installed = []
        for i in infos:
            rel = i.filename
            if rel in (records[0], dist_info + "/RECORD.jws", dist_info + "/RECORD.p7s"):
                continue
            data = z.read(i)
            want = expected.get(rel)
            if want is None or want[0] != "sha256":
                raise Refused("tool wheel %s: %s is not listed with a sha256 in its RECORD" % (name, rel),
                              EXIT_BUNDLE)
            if _b64(hashlib.sha256(data).digest()) != want[1] or (want[2] and int(want[2]) != len(data)):
                raise Refused("tool wheel %s: %s does not match its RECORD" % (name, rel), EXIT_BUNDLE,
                              hint="the wheel is damaged; run `deploytool lock` and pack again")
            executable = bool((i.external_attr >> 16) & 0o111)
            if rel.startswith(data_dir + "/"):
                scheme, _, rest = rel[len(data_dir) + 1:].partition("/")
                if scheme in ("purelib", "platlib"):
                    dest = os.path.join(sp, rest)
                elif scheme == "scripts":
                    dest = os.path.join(bindir, rest)
                    if data.startswith(b"#!python"):
                        data = b"#!" + python_path.encode() + data[len(b"#!python"):].lstrip(b"w")
                    executable = True
                elif scheme == "headers":
                    dest = os.path.join(venv, "include", "site", "python%d.%d" % (vi[0], vi[1]),
                                        dist_info.split("-")[0], rest)
                elif scheme == "data":
                    dest = os.path.join(venv, rest)
                else:
                    raise Refused("tool wheel %s: unknown .data scheme %r" % (name, scheme), EXIT_BUNDLE)
            else:
                dest = os.path.join(sp, rel)
            installed.append(_write_new(dest, data, 0o755 if executable else 0o644))
        eps = os.path.join(dist_info, "entry_points.txt").replace(os.sep, "/")
        if eps in z.namelist():
            for script, target in _console_scripts(z.read(eps).decode("utf-8")):
                module, _, attr = target.partition(":")
                installed.append(_write_new(os.path.join(bindir, script), _script(python_path, module, attr),
                                            0o755))
    di = os.path.join(sp, dist_info)
    installed.append(_write_new(os.path.join(di, "INSTALLER"), b"deploytool-bootstrap\n", 0o644))
    if compile_pyc:
        final_sp = sp if python_path is None else os.path.join(
            os.path.dirname(os.path.dirname(python_path)), "lib", "python%d.%d" % (vi[0], vi[1]), "site-packages")
        pycs = _compile(venv, sp, final_sp, [p for p, _, _ in installed if p.endswith(".py")], vi)
        # a .pyc the wheel shipped itself was just rewritten: RECORD lists what is on disk now, once
        rewritten = set(p for p, _, _ in pycs)
        installed = [e for e in installed if e[0] not in rewritten] + pycs
    rows = []
    for p, sha, size in installed:
        rows.append("%s,sha256=%s,%d" % (_csv_path(os.path.relpath(p, sp)), sha, size))
    rows.append("%s,," % (dist_info + "/RECORD"))
    _write_new(os.path.join(di, "RECORD"), ("\n".join(sorted(rows)) + "\n").encode("utf-8"), 0o644)
    return [p for p, _, _ in installed]


def _compile(venv, sp, final_sp, py_files, vi):
    """Byte-compile py_files with the venv's interpreter (checked-hash); return the .pyc files as installed."""
    if not py_files:
        return []
    argv = [os.path.join(venv, "bin", "python"), "-I", "-m", "compileall", "-qq", "--invalidation-mode",
            "checked-hash", "-s", os.path.abspath(sp), "-p", final_sp, "-i", "-"]
    try:
        subprocess.run(argv, input="\n".join(os.path.abspath(p) for p in py_files).encode(), env=child_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    except OSError as exc:
        raise Refused("byte-compiling the tool venv: cannot run %s: %s" % (argv[0], exc.strerror), EXIT_OS)
    out = []
    tag = "cpython-%d%d" % (vi[0], vi[1])
    for p in py_files:  # a module that does not compile gets no .pyc (and could not be imported either)
        d, base = os.path.split(p)
        pyc = os.path.join(d, "__pycache__", "%s.%s.pyc" % (base[:-3], tag))
        if os.path.isfile(pyc):
            with open(pyc, "rb") as f:
                data = f.read()
            out.append((pyc, _b64(hashlib.sha256(data).digest()), len(data)))
    return out


def _csv_path(p):
    return '"%s"' % p.replace('"', '""') if ("," in p or '"' in p) else p


def _console_scripts(text):
    """(name, "module:attr") of [console_scripts] and [gui_scripts] in an entry_points.txt."""
    out = []
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]").strip()
            continue
        if section in ("console_scripts", "gui_scripts") and "=" in line:
            k, _, v = line.partition("=")
            v = v.split("[")[0].strip()
            if not re.match(r"^[A-Za-z0-9_.\-]+$", k.strip()) or not re.match(r"^[\w.]+:[\w.]+$", v):
                raise Refused("entry point %r is not `name = module:attr`" % line, EXIT_BUNDLE)
            out.append((k.strip(), v))
    return out


def _write_new(path, data, mode):
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        os.makedirs(d, 0o755)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path, _b64(hashlib.sha256(data).digest()), len(data)


def install_wheels(wheels, venv, python_path=None, compile_pyc=True):
    """Install every wheel into an existing venv (no dependency resolution: the wheel set is the closure)."""
    out = []
    for w in sorted(wheels):
        out.extend(install_wheel(w, venv, python_path, compile_pyc))
    return out


def create_venv(python, venv):
    """`python -m venv --without-pip venv` with an environment that cannot point it elsewhere."""
    _run([python, "-m", "venv", "--without-pip", venv], "creating the tool venv")


def child_env():
    env = dict((k, v) for k, v in os.environ.items() if k not in DROP_ENV and not k.startswith("PIP_"))
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(argv, what):
    try:
        r = subprocess.run(argv, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    except OSError as exc:
        raise Refused("%s: cannot run %s: %s" % (what, argv[0], exc.strerror), EXIT_OS)
    if r.returncode != 0:
        tail = r.stdout.decode("utf-8", "replace").strip().splitlines()[-5:]
        raise Refused("%s failed (exit %d): %s%s" % (what, r.returncode, " ".join(argv),
                                                    "".join("\n  " + t for t in tail)), EXIT_OS)


# ------------------------------------------------------------------------------------------------ main

USAGE = """usage: python3 BUNDLE_DIR/bootstrap [--config PATH] [--keys DIR] [--staging-dir DIR] [INSTALL OPTIONS...]

Installs the bundle this file is in, with no network: deploytool's own venv from the bundle's wheels (checked
against the MANIFEST), the bundle's signature and files checked by that deploytool, then `deploytool install`.

  --config PATH      the box's deploytool.yaml (default: $DEPLOYTOOL_CONFIG, else /etc/deploytool/deploytool.yaml)
  --keys DIR         trusted public keys (*.pub) to check the bundle with (default: paths.keys_dir of the config)
  --staging-dir DIR  where the temporary tool venv goes (default: $TMPDIR or /tmp); removed afterwards
  INSTALL OPTIONS    passed on to `deploytool install` (e.g. --no-start, --rebuild)
"""


def parse_args(argv):
    opts = {"config": os.environ.get("DEPLOYTOOL_CONFIG") or "/etc/deploytool/deploytool.yaml", "keys": None,
            "staging": None, "rest": []}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            sys.stdout.write(USAGE)
            sys.exit(0)
        key = {"--config": "config", "-c": "config", "--keys": "keys", "--staging-dir": "staging"}.get(
            a.split("=", 1)[0])
        if key is not None:
            if "=" in a:
                opts[key] = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                i += 1
                opts[key] = argv[i]
            else:
                raise Refused("%s needs a value" % a, EXIT_USAGE, hint="python3 BUNDLE/bootstrap --help")
        else:
            opts["rest"].append(a)
        i += 1
    return opts


def bootstrap(bundle_dir, config, keys=None, staging_parent=None, install_args=(), log=None):
    """Steps 2-5 of the module doc; returns the exit code of `deploytool install`."""
    log = log or (lambda s: sys.stderr.write("bootstrap: " + s + "\n"))
    t0 = time.monotonic()
    bundle_dir = os.path.abspath(bundle_dir)
    config = os.path.abspath(config)
    if not os.path.isfile(config):
        raise Refused("config %s not found" % config, EXIT_USAGE,
                      hint="put the box's deploytool.yaml there, or pass --config PATH")
    manifest, sig = read_manifest(bundle_dir)
    keys_dir = os.path.abspath(keys) if keys else keys_dir_from_config(config)
    check_trust_paths(config, keys_dir)
    kid = check_signature(manifest, sig, keys_dir)
    files, bundle_id = parse_manifest(manifest, os.path.join(bundle_dir, "MANIFEST"))
    log("bundle %s: MANIFEST signed by trusted key %s (%s) [%.2f s]" % (bundle_id, kid, keys_dir,
                                                                      time.monotonic() - t0))
    wheels = tool_wheels(bundle_dir, files)
    try:
        staging = tempfile.mkdtemp(prefix="deploytool-bootstrap-", dir=staging_parent)
    except OSError as exc:
        raise Refused("cannot create a staging directory in %s: %s"
                      % (staging_parent or tempfile.gettempdir(), exc.strerror), EXIT_OS,
                      hint="pass --staging-dir DIR on a writable file system")
    try:
        log("bundle %s: checking %d tool wheels against the MANIFEST" % (bundle_id, len(wheels)))
        wdir = os.path.join(staging, "wheels")
        os.mkdir(wdir, 0o700)
        copies = []
        for p in wheels:
            size, _, sha = files[p]
            dst = os.path.join(wdir, os.path.basename(p))
            copy_checked(os.path.join(bundle_dir, p), dst, size, sha)
            copies.append(dst)
        venv = os.path.join(staging, "venv")
        log("creating deploytool's venv in %s (no network)" % staging)
        create_venv(sys.executable, venv)
        install_wheels(copies, venv, compile_pyc=False)  # used once, then removed: no .pyc needed
        log("deploytool's venv ready [%.2f s]" % (time.monotonic() - t0))
        tool = os.path.join(venv, "bin", "deploytool")
        vpy = os.path.join(venv, "bin", "python")
        base = [tool, "--config", config]
        log("checking the bundle's signature and files")
        keys_args = ["--keys", os.path.abspath(keys)] if keys else []
        verify = base + ["bundle", "verify", bundle_dir] + keys_args
        # the checks report on stderr: stdout is left to install
        code = subprocess.call(verify, env=child_env(), stdout=sys.stderr)
        if code != 0:
            return code
        code = subprocess.call([vpy, "-I", "-m", "deploy_tool.box.selfcheck", "preflight", "--config", config],
                               env=child_env(), stdout=sys.stderr)
        if code != 0:
            return code
        log("installing [%.2f s]" % (time.monotonic() - t0))
        code = subprocess.call(base + ["install", bundle_dir] + keys_args + list(install_args), env=child_env())
        log("install exited %d [%.2f s in all]" % (code, time.monotonic() - t0))
        return code
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_python()
        opts = parse_args(argv)
        here = os.path.dirname(os.path.abspath(__file__))
        code = bootstrap(here, opts["config"], keys=opts["keys"], staging_parent=opts["staging"],
                         install_args=opts["rest"])
    except Refused as exc:
        sys.stderr.write("error: %s\n" % exc.message + ("hint: %s\n" % exc.hint if exc.hint else ""))
        code = exc.code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
