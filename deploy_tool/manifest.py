"""Hashing, the bundle MANIFEST and its detached Ed25519 signature.

MANIFEST is canonical JSON (sorted keys, fixed indentation, ASCII only, one trailing newline): the same content
always gives the same bytes, and the parser accepts only those bytes. It holds a format version, a
content-derived bundle id, the creation time (SOURCE_DATE_EPOCH), free-form `inputs` (config hash, lock hash,
template origin, NCCL architectures, forced flags...), every file's path/size/mode/SHA-256 sorted by path, and
the SHA-256 of every native library inside the venv.

MANIFEST.sig is one canonical JSON line: {"algorithm": "ed25519", "key_id": ..., "signature": base64}. The
key id is the first 16 hex digits of the SHA-256 of the raw 32-byte public key. Trusted public keys are PEM
files `*.pub` in a keys directory (default /etc/deploytool/keys), each optionally with a `not-after`, beside a
revocation list `revoked` (deploy_tool.keyring): a revoked or expired key signs nothing (KeyRefused, exit 25).

Every rejection is a BundleError whose `reason` attribute is a stable slug (see REASONS), so tests and callers
can tell a flipped byte from an untrusted key without parsing messages.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from deploy_tool import keyring
from deploy_tool.clock import iso_utc
from deploy_tool.errors import BundleError, InputError, OSFailure
from deploy_tool.hashing import NotAFile, parallel, sha256_bytes, sha256_file
from deploy_tool.progress import ByteCounter, ProgressFn
from deploy_tool.textsafe import q

# 2 (deploytool 0.2.0, 2026-12-06): the venv may travel as one archive per distribution (deploy_tool.venv.VENV_PARTS), which a
# deploytool that reads only 1 would not install; a reader of 2 reads 1 alike (the venv as one venv.tar.zst).
FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2})
MANIFEST_NAME = "MANIFEST"
SIGNATURE_NAME = "MANIFEST.sig"
RESERVED_NAMES = frozenset({MANIFEST_NAME, SIGNATURE_NAME})
DEFAULT_KEYS_DIR = Path("/etc/deploytool/keys")
BUNDLE_ID_LEN = 16
KEY_ID_LEN = 16
MAX_MANIFEST_BYTES = 64 << 20
MAX_SIGNATURE_BYTES = 4096
FILE_MODES = frozenset({0o644, 0o755})

# Stable rejection reasons (BundleError.reason). Callers and tests match on these, never on messages.
REASONS = frozenset({
    "manifest-missing", "manifest-malformed", "manifest-not-canonical", "manifest-too-large",
    "unknown-key", "missing-key", "wrong-type", "format-version-unsupported", "bundle-id-mismatch",
    "absolute-path", "dotdot-path", "bad-path", "reserved-path", "duplicate-path", "path-conflict",
    "bad-mode", "bad-hash",
    "signature-missing", "signature-malformed", "signature-invalid", "untrusted-key", "no-trusted-keys",
    "trusted-key-invalid",
    "hash-mismatch", "size-mismatch", "mode-mismatch", "extra-file", "missing-file",
    "symlink", "symlink-escape", "path-through-symlink", "hardlink", "device-node", "fifo", "special-file",
    "duplicate-entry", "entry-too-large", "archive-truncated", "archive-malformed", "archive-too-large",
    "trailing-data", "unsupported-entry", "unsupported-compression", "manifest-not-first", "sequence-invalid",
}) | keyring.REASONS

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HEXID = re.compile(rf"[0-9a-f]{{{BUNDLE_ID_LEN}}}\Z")
_MODE = re.compile(r"0[0-7]{3}\Z")
_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")  # control characters and backslashes
_CREATED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\Z")


def reject(reason: str, message: str, *, hint: str | None = None, path: str | None = None) -> BundleError:
    """A BundleError carrying a stable `reason` slug (in the message's tail, and in details for --json)."""
    assert reason in REASONS, reason
    details: dict[str, str] = {"reason": reason}
    if path is not None:
        details["path"] = path
    err = BundleError(f"{message} [{reason}]", hint=hint, details=details)
    err.reason = reason  # type: ignore[attr-defined]
    err.path = path  # type: ignore[attr-defined]
    return err


# ---------------------------------------------------------------------------------------------- hashing

def hash_file(path: str | os.PathLike[str], *, follow_symlinks: bool = True,
              on_bytes: Callable[[int], None] | None = None) -> str:
    """SHA-256 hex digest of a regular file (hashing.sha256_file); InputError naming the path otherwise."""
    try:
        return sha256_file(path, follow_symlinks=follow_symlinks, on_bytes=on_bytes)
    except NotAFile:
        raise InputError(f"not a regular file: {q(path)}") from None
    except OSError as exc:
        raise InputError(f"cannot read {q(path)}: {exc.strerror}",
                         hint="check that the file exists and is readable") from exc


K = TypeVar("K")


def hash_files(paths: Iterable[K], workers: int | None = None, progress: ProgressFn | None = None,
               *, follow_symlinks: bool = True, phase: str = "hashing") -> dict[K, str]:
    """SHA-256 of many files in parallel (hashing.parallel); keys as given; InputError on the first failure."""
    items = list(paths)
    if not items:
        return {}
    counter = None
    if progress is not None:
        total = 0
        for p in items:
            with contextlib.suppress(OSError):
                total += os.stat(p, follow_symlinks=follow_symlinks).st_size  # type: ignore[arg-type]
        counter = ByteCounter(progress, phase, total)

    def one(p: K) -> str:
        return hash_file(p, follow_symlinks=follow_symlinks,  # type: ignore[arg-type]
                         on_bytes=counter.add if counter is not None else None)

    def size(p: K) -> int:
        try:
            return os.stat(p, follow_symlinks=follow_symlinks).st_size  # type: ignore[arg-type]
        except OSError:
            return 0

    return dict(zip(items, parallel(one, items, workers=workers, cost=size), strict=True))


def is_native_lib(name: str) -> bool:
    """True for shared objects: `x.so`, `x.so.1`, `x.cpython-311-x86_64-linux-gnu.so`."""
    return name.endswith(".so") or ".so." in name


def hash_native_libs(venv_dir: str | os.PathLike[str], *, workers: int | None = None,
                     progress: ProgressFn | None = None,
                     known: Callable[[os.stat_result], str | None] | None = None) -> dict[str, str]:
    """{venv-relative path: sha256} of every regular *.so* file under a venv (symlinks to them are skipped).
    `known(stat)`: the SHA-256 of a file with exactly this stat if it was hashed as it was written (a
    hashing.HashCache's get_same_file: stat-keyed, racy values refused), so it is not read again; else None."""
    root = Path(venv_dir)
    found: dict[str, Path] = {}
    have: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in filenames:
            if not is_native_lib(fn):
                continue
            p = Path(dirpath, fn)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            rel = p.relative_to(root).as_posix()
            hit = known(st) if known is not None else None
            if hit is not None:
                have[rel] = hit
            else:
                found[rel] = p
    hashes = hash_files(list(found.values()), workers=workers, progress=progress, phase="native libs")
    have.update((rel, hashes[p]) for rel, p in found.items())
    return dict(sorted(have.items()))


# ---------------------------------------------------------------------------------------------- paths

def check_relpath(path: object, *, what: str = "path") -> str:
    """Validate a bundle-relative POSIX path (no absolute, no `..`, no empty or `.` parts); return it."""
    if not isinstance(path, str):
        raise reject("wrong-type", f"{what} must be a string, got {type(path).__name__}")
    if path.startswith("/"):
        raise reject("absolute-path", f"{what} is absolute: {path!r}", path=path)
    parts = path.split("/")
    if ".." in parts:
        raise reject("dotdot-path", f"{what} contains '..': {path!r}", path=path)
    if not path or "" in parts or "." in parts or _BAD_CHARS.search(path):
        raise reject("bad-path", f"{what} is not a clean relative path: {path!r}", path=path)
    if len(path.encode("utf-8", "surrogateescape")) > 4096:
        raise reject("bad-path", f"{what} is too long: {path[:80]!r}...", path=path)
    return path


# ---------------------------------------------------------------------------------------------- manifest

@dataclass(frozen=True, order=True)
class FileEntry:
    path: str
    size: int
    mode: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "mode": f"{self.mode:04o}", "sha256": self.sha256}


def created_from_env(env: Mapping[str, str] | None = None) -> str:
    """ISO UTC time from SOURCE_DATE_EPOCH (default 0: 1970-01-01T00:00:00Z)."""
    return iso_utc(source_date_epoch(env))


def source_date_epoch(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    raw = env.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise InputError(f"SOURCE_DATE_EPOCH must be a non-negative integer of seconds, got {raw!r}",
                         hint="unset it or set e.g. SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)")
    value = int(raw)
    if value > 253402300799:  # 9999-12-31T23:59:59Z
        raise InputError(f"SOURCE_DATE_EPOCH is out of range: {q(raw)}")
    return value


def _canonical(obj: Any, *, indent: int | None = 1) -> bytes:
    text = json.dumps(obj, sort_keys=True, ensure_ascii=True, allow_nan=False, indent=indent,
                      separators=(",", ": ") if indent is not None else (",", ":"))
    return (text + "\n").encode("ascii")


def compute_bundle_id(files: Sequence[FileEntry], inputs: Mapping[str, Any], native_libs: Mapping[str, str],
                      format_version: int = FORMAT_VERSION) -> str:
    """First 16 hex digits of SHA-256 over the canonical JSON of everything but the creation time."""
    body = {"format_version": format_version, "files": [f.to_json() for f in sorted(files)],
            "inputs": inputs, "native_libs": dict(native_libs)}
    return sha256_bytes(_canonical(body, indent=None))[:BUNDLE_ID_LEN]


_TOP_KEYS = frozenset({"format_version", "bundle_id", "created", "inputs", "files", "native_libs"})
_FILE_KEYS = frozenset({"path", "size", "mode", "sha256"})


@dataclass(frozen=True)
class Manifest:
    format_version: int
    bundle_id: str
    created: str
    inputs: Mapping[str, Any]
    files: tuple[FileEntry, ...]
    native_libs: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def build(cls, files: Iterable[FileEntry], *, inputs: Mapping[str, Any] | None = None,
              native_libs: Mapping[str, str] | None = None, created: str | None = None) -> Manifest:
        """A manifest for these files: sorted, validated, id derived from content, time from SOURCE_DATE_EPOCH."""
        entries = tuple(sorted(files))
        try:
            inputs = json.loads(_canonical(dict(inputs or {})))  # deep copy; fails early on non-JSON values
        except (TypeError, ValueError) as exc:
            raise InputError(f"manifest inputs must be plain JSON values (str, int, bool, null, lists, "
                             f"objects): {exc}") from exc
        libs = dict(sorted((native_libs or {}).items()))
        _check_entries(entries)
        _check_native_libs(libs)
        m = cls(FORMAT_VERSION, compute_bundle_id(entries, inputs, libs), created or created_from_env(),
                inputs, entries, libs)
        return m

    def to_json(self) -> dict[str, Any]:
        return {"format_version": self.format_version, "bundle_id": self.bundle_id, "created": self.created,
                "inputs": self.inputs, "files": [f.to_json() for f in self.files],
                "native_libs": dict(self.native_libs)}

    def to_bytes(self) -> bytes:
        return _canonical(self.to_json())

    def file(self, path: str) -> FileEntry | None:
        return self.by_path().get(path)

    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Strict parse: canonical bytes only; unknown keys, wrong types, bad paths, bad ids are rejected."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise reject("manifest-too-large", f"MANIFEST is {len(data)} bytes (limit {MAX_MANIFEST_BYTES})")
        try:
            text = data.decode("ascii")
            obj = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
        except (UnicodeDecodeError, ValueError) as exc:
            raise reject("manifest-malformed", f"MANIFEST is not valid canonical JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise reject("manifest-malformed", "MANIFEST is not a JSON object")
        # The version decides how to read the rest, so it is checked before anything else.
        if "format_version" not in obj:
            raise reject("missing-key", "MANIFEST has no format_version")
        version = obj["format_version"]
        if type(version) is not int:
            raise reject("wrong-type", f"MANIFEST format_version must be an integer, got {version!r}")
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise reject("format-version-unsupported",
                         f"MANIFEST format_version {version} is not supported (this deploytool reads "
                         f"{', '.join(map(str, sorted(SUPPORTED_FORMAT_VERSIONS)))})",
                         hint="use a deploytool release that reads this bundle format")
        _keys(obj, _TOP_KEYS, "MANIFEST")
        bundle_id = _typed(obj, "bundle_id", str, "MANIFEST")
        if not _HEXID.match(bundle_id):
            raise reject("wrong-type", f"MANIFEST bundle_id must be {BUNDLE_ID_LEN} hex digits: {bundle_id!r}")
        created = _typed(obj, "created", str, "MANIFEST")
        if not _CREATED.match(created):
            raise reject("wrong-type", f"MANIFEST created must be YYYY-MM-DDTHH:MM:SSZ, got {created!r}")
        inputs = _typed(obj, "inputs", dict, "MANIFEST")
        raw_files = _typed(obj, "files", list, "MANIFEST")
        raw_libs = _typed(obj, "native_libs", dict, "MANIFEST")
        files = []
        for i, rf in enumerate(raw_files):
            where = f"MANIFEST files[{i}]"
            if not isinstance(rf, dict):
                raise reject("wrong-type", f"{where} must be an object")
            _keys(rf, _FILE_KEYS, where)
            path = check_relpath(_typed(rf, "path", str, where), what=f"{where}.path")
            size = _typed(rf, "size", int, where)
            if size < 0:
                raise reject("wrong-type", f"{where}.size is negative: {size}", path=path)
            mode_s = _typed(rf, "mode", str, where)
            if not _MODE.match(mode_s):
                raise reject("bad-mode", f"{where}.mode must be an octal string like '0644': {mode_s!r}",
                             path=path)
            sha = _typed(rf, "sha256", str, where)
            if not _HEX64.match(sha):
                raise reject("bad-hash", f"{where}.sha256 is not 64 lowercase hex digits", path=path)
            files.append(FileEntry(path, size, int(mode_s, 8), sha))
        entries = tuple(files)
        _check_entries(entries, sorted_required=True)
        libs = dict(raw_libs)
        _check_native_libs(libs)
        m = cls(version, bundle_id, created, inputs, entries, libs)
        expected_id = compute_bundle_id(entries, inputs, libs, version)
        if expected_id != bundle_id:
            raise reject("bundle-id-mismatch",
                         f"MANIFEST bundle_id {q(bundle_id)} does not match its content ({expected_id})")
        if m.to_bytes() != data:
            raise reject("manifest-not-canonical",
                         "MANIFEST is not in canonical form (key order, spacing or escaping differs)")
        return m


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{q(name)} is not allowed")


def _keys(obj: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise reject("unknown-key", f"{where} has unknown key(s): {', '.join(unknown)}")
    missing = sorted(allowed - set(obj))
    if missing:
        raise reject("missing-key", f"{where} lacks key(s): {', '.join(missing)}")


T = TypeVar("T")


def _typed(obj: Mapping[str, Any], key: str, typ: type[T], where: str) -> T:
    value = obj[key]
    ok = type(value) is int if typ is int else isinstance(value, typ)  # bool is not an int here
    if not ok:
        raise reject("wrong-type", f"{where}.{key} must be {typ.__name__}, got {type(value).__name__}")
    return value


def _check_entries(entries: Sequence[FileEntry], *, sorted_required: bool = False) -> None:
    seen: set[str] = set()
    prev: str | None = None
    for e in entries:
        check_relpath(e.path)
        if e.path in RESERVED_NAMES:
            raise reject("reserved-path", f"{q(e.path)} is reserved for the bundle's own manifest", path=e.path)
        if e.path in seen:
            raise reject("duplicate-path", f"MANIFEST lists {q(e.path)} twice", path=e.path)
        if sorted_required and prev is not None and e.path < prev:
            raise reject("manifest-not-canonical", f"MANIFEST files are not sorted at {q(e.path)}", path=e.path)
        if e.mode not in FILE_MODES:
            raise reject("bad-mode", f"{q(e.path)}: mode {e.mode:04o} is not 0644 or 0755", path=e.path)
        if type(e.size) is not int or e.size < 0:
            raise reject("wrong-type", f"{q(e.path)}: size must be a non-negative integer", path=e.path)
        if not isinstance(e.sha256, str) or not _HEX64.match(e.sha256):
            raise reject("bad-hash", f"{q(e.path)}: sha256 is not 64 lowercase hex digits", path=e.path)
        seen.add(e.path)
        prev = e.path
    # A path cannot be both a file and the directory of another file.
    for e in entries:
        for parent in PurePosixPath(e.path).parents:
            if str(parent) in seen:
                raise reject("path-conflict", f"{q(parent)} is a file and also the directory of {q(e.path)}",
                             path=e.path)


def _check_native_libs(libs: Mapping[str, Any]) -> None:
    for k, v in libs.items():
        check_relpath(k, what="native_libs path")
        if not isinstance(v, str) or not _HEX64.match(v):
            raise reject("bad-hash", f"native_libs[{k!r}] is not a 64-hex SHA-256", path=k)


# ---------------------------------------------------------------------------------------------- signatures

def key_id_of(public_key: Any) -> str:
    """First 16 hex digits of SHA-256 over the raw 32-byte Ed25519 public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return sha256_bytes(raw)[:KEY_ID_LEN]


def _write_atomic(path: Path, data: bytes, mode: int, *, force: bool) -> None:
    """Write to a temp file beside `path`, fsync, then link (no overwrite) or rename (force) into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.close(fd)
        fd = -1
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError as exc:
                raise InputError(f"{q(path)} already exists", hint="pass --force to overwrite it") from exc
            os.unlink(tmp)
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def refuse_existing(*paths: Path, force: bool) -> None:
    """InputError naming the first of `paths` that exists (a key pair is not overwritten without --force)."""
    if not force:
        for p in paths:
            if p.exists() or p.is_symlink():
                raise InputError(f"{q(p)} already exists", hint="pass --force to overwrite it")


def generate_keypair(private_path: str | os.PathLike[str], public_path: str | os.PathLike[str], *,
                     force: bool = False, not_after: str | None = None) -> str:
    """Write a new Ed25519 key pair (private PEM 0600, public PEM 0644), atomically; return the key id.
    `not_after` (YYYY-MM-DDTHH:MM:SSZ): the public key file says when boxes stop trusting it (deploy_tool.keyring)."""
    priv_p, pub_p = Path(private_path), Path(public_path)
    if not_after is not None and keyring.parse_not_after(not_after) is None:
        raise InputError(f"not-after {not_after!r} is not a UTC time YYYY-MM-DDTHH:MM:SSZ",
                         hint="e.g. --not-after 2027-01-31T00:00:00Z")
    refuse_existing(priv_p, pub_p, force=force)
    key = ed25519.Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    if not_after is not None:
        pub = keyring.key_file_text(pub.decode("ascii"), not_after).encode("ascii")
    try:
        _write_atomic(priv_p, priv, 0o600, force=force)
        _write_atomic(pub_p, pub, 0o644, force=force)
    except OSError as exc:
        raise OSFailure(f"cannot write key pair: {exc}") from exc
    return key_id_of(key.public_key())


def _load_private(path: Path) -> Any:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read signing key {q(path)}: {exc.strerror}",
                         hint="create one with `deploytool keygen --out DIR`") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{q(path)} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise InputError(f"{q(path)} is not an Ed25519 private key", hint="create one with `deploytool keygen`")
    return key


def sign(manifest_bytes: bytes, private_key_path: str | os.PathLike[str]) -> bytes:
    """The detached MANIFEST.sig content: canonical JSON with algorithm, key id and base64 signature."""
    key = _load_private(Path(private_key_path))
    sig = key.sign(manifest_bytes)
    body = {"algorithm": "ed25519", "key_id": key_id_of(key.public_key()),
            "signature": base64.b64encode(sig).decode("ascii")}
    return _canonical(body, indent=None)


def public_key_id(private_key_path: str | os.PathLike[str]) -> str:
    return key_id_of(_load_private(Path(private_key_path)).public_key())


def parse_signature(sig_bytes: bytes) -> tuple[str, bytes]:
    """(key_id, raw 64-byte signature) from MANIFEST.sig, strictly."""
    if len(sig_bytes) > MAX_SIGNATURE_BYTES:
        raise reject("signature-malformed", f"MANIFEST.sig is {len(sig_bytes)} bytes, too large")
    try:
        obj = json.loads(sig_bytes.decode("ascii"), object_pairs_hook=_no_duplicate_keys,
                         parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError) as exc:
        raise reject("signature-malformed", f"MANIFEST.sig is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict) or set(obj) != {"algorithm", "key_id", "signature"}:
        raise reject("signature-malformed", "MANIFEST.sig must hold exactly algorithm, key_id and signature")
    if obj["algorithm"] != "ed25519":
        raise reject("signature-malformed", f"MANIFEST.sig algorithm {obj['algorithm']!r} is not ed25519")
    kid = obj["key_id"]
    if not isinstance(kid, str) or not re.fullmatch(rf"[0-9a-f]{{{KEY_ID_LEN}}}", kid):
        raise reject("signature-malformed", "MANIFEST.sig key_id is not 16 hex digits")
    try:
        raw = base64.b64decode(obj["signature"], validate=True) if isinstance(obj["signature"], str) else b""
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 64:
        raise reject("signature-malformed", "MANIFEST.sig signature is not a base64 64-byte Ed25519 signature")
    return kid, raw


def load_trusted_keys(keys_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """{key_id: public key} for every *.pub key file in keys_dir (deploy_tool.keyring: PEM, optional not-after)."""
    ring = keyring.load(keys_dir)
    return {kid: ed25519.Ed25519PublicKey.from_public_bytes(k.raw) for kid, k in ring.keys.items()}


def verify_signature(manifest_bytes: bytes, sig_bytes: bytes, keys_dir: str | os.PathLike[str], *,
                     now: float | None = None) -> str:
    """Check MANIFEST.sig over exactly these MANIFEST bytes against the trusted keys; return the key id.

    A key revoked in the keys directory's revocation list, or past its not-after (`now`: the box's clock), is
    refused (KeyRefused, exit 25) naming the key id, whether or not the signature itself is good."""
    kid, raw = parse_signature(sig_bytes)
    ring = keyring.load(keys_dir)
    refusal = ring.refusal(kid, now)
    if refusal is not None:
        raise refusal
    tk = ring.keys.get(kid)
    if tk is None:
        usable = sorted(k for k in ring.keys if ring.refusal(k, now) is None)  # not a revoked or expired one
        raise reject("untrusted-key", f"bundle is signed by key {q(kid)}, which is not among the trusted keys "
                     f"in {q(keys_dir)} ({', '.join(usable) or 'none usable'})",
                     hint="if you trust the signer, copy their .pub file into the keys directory")
    key = ed25519.Ed25519PublicKey.from_public_bytes(tk.raw)
    try:
        key.verify(raw, manifest_bytes)
    except InvalidSignature as exc:
        raise reject("signature-invalid", f"MANIFEST signature does not verify with trusted key {q(kid)}: "
                     "the MANIFEST or its signature was altered") from exc
    return kid
