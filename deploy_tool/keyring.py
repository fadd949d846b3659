"""The box's trusted keys and their lifecycle: expiry (`not-after`) and revocation, read from the keys directory.

    KEYS_DIR/NAME.pub    one Ed25519 public key, PEM (SubjectPublicKeyInfo), as `deploytool keygen` writes it.
                         Lines before `-----BEGIN PUBLIC KEY-----` may hold `# comments` and at most one
                         `not-after: YYYY-MM-DDTHH:MM:SSZ` (UTC): from that second on the key signs nothing this box
                         installs. A plain PEM file (no header) never expires: key files written before this
                         format stay valid as they are.
    KEYS_DIR/revoked     the revocation list: one key id (16 hex digits, as MANIFEST.sig and `bundle verify` name
                         it) per line, optionally followed by a reason; `#` starts a comment. A revoked key is
                         refused whether or not its .pub file is still there (a rollout that copies the old .pub
                         again does not bring it back).

`load(keys_dir)` reads them all, strictly, and fails closed: a file it cannot read as one of these is refused naming
the file and line (a bundle is never installed past a keys directory that says something this code does not
understand). `Keyring.refusal(key_id)` says why a key may not sign now (revoked, expired), or None.

Stdlib only, and no cryptography import: status and check read the lifecycle without loading the signature code.
deploy_tool/box/bootstrap.py carries its own copy of these rules (it runs before deploytool exists on the box);
tests/test_keyring.py holds the two to the same verdicts.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy_tool.errors import BundleError, DeployError, KeyRefused
from deploy_tool.textsafe import q

KEY_ID_LEN = 16
REVOKED_NAME = "revoked"
MAX_KEY_FILE = 8192
MAX_REVOKED_FILE = 1 << 20
SPKI_ED25519 = bytes([0x30, 0x2A, 0x30, 0x05, 0x06, 0x03, 0x2B, 0x65, 0x70, 0x03, 0x21, 0x00])
PEM_BEGIN, PEM_END = "-----BEGIN PUBLIC KEY-----", "-----END PUBLIC KEY-----"
NOT_AFTER_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
#: the stable reasons (like manifest.REASONS) of the errors raised here
REASONS = frozenset({"no-trusted-keys", "trusted-key-invalid", "key-metadata-invalid", "revocation-list-invalid",
                     "key-revoked", "key-expired"})

_KEY_ID = re.compile(rf"[0-9a-f]{{{KEY_ID_LEN}}}\Z")
_NOT_AFTER = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\Z")
_HEADER = re.compile(r"([A-Za-z][A-Za-z0-9-]*)\s*:\s*(.*?)\s*\Z")
_PRINTABLE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _error(cls: type[DeployError], reason: str, message: str, *, hint: str | None = None,
           path: str | None = None) -> DeployError:
    assert reason in REASONS, reason
    details: dict[str, str] = {"reason": reason}
    if path is not None:
        details["path"] = path
    err = cls(f"{message} [{reason}]", hint=hint, details=details)
    err.reason = reason  # type: ignore[attr-defined]
    err.path = path  # type: ignore[attr-defined]
    return err


def key_id_of_raw(raw: bytes) -> str:
    """First 16 hex digits of SHA-256 over the raw 32-byte Ed25519 public key."""
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_LEN]


def parse_not_after(text: str) -> int | None:
    """Seconds since the epoch of a `not-after` value (UTC, YYYY-MM-DDTHH:MM:SSZ), or None if it is not one."""
    if not _NOT_AFTER.match(text):
        return None
    try:
        return calendar.timegm(time.strptime(text, NOT_AFTER_FORMAT))
    except ValueError:
        return None


@dataclass(frozen=True)
class TrustedKey:
    key_id: str
    raw: bytes  # the 32-byte Ed25519 public key
    path: str
    not_after: str | None = None  # as written, UTC
    not_after_epoch: int | None = None

    def to_json(self) -> dict[str, object]:
        return {"key_id": self.key_id, "path": self.path, "not_after": self.not_after}


@dataclass(frozen=True)
class Revocation:
    key_id: str
    reason: str
    path: str
    line: int


def parse_key_file(text: str, path: str) -> TrustedKey:
    """One key file (see the module doc); KeyRefused for a bad header, BundleError for a bad key body."""
    lines = text.split("\n")
    try:
        begin = next(i for i, ln in enumerate(lines) if ln.strip() == PEM_BEGIN)
        end = next(i for i, ln in enumerate(lines) if ln.strip() == PEM_END and i > begin)
    except StopIteration:
        raise _error(BundleError, "trusted-key-invalid", f"trusted key {q(path)} is not a PEM public key "
                     f"(no {PEM_BEGIN} ... {PEM_END} block)", hint="remove or replace that file", path=path) from None
    not_after: str | None = None
    for n, raw_line in enumerate(lines[:begin], 1):
        line = raw_line.strip()
        if not line or line.startswith("#"):
            continue
        m = _HEADER.match(line)
        if not m or m.group(1).lower() != "not-after":
            raise _error(KeyRefused, "key-metadata-invalid",
                         f"trusted key {q(path)} line {n}: {line[:60]!r} is not `not-after: YYYY-MM-DDTHH:MM:SSZ` "
                         "or a # comment", hint=f"fix or remove that line of {path}", path=path)
        if not_after is not None:
            raise _error(KeyRefused, "key-metadata-invalid", f"trusted key {q(path)} line {n}: a second not-after",
                         hint=f"keep one not-after line in {path}", path=path)
        not_after = m.group(2)
        if parse_not_after(not_after) is None:
            raise _error(KeyRefused, "key-metadata-invalid",
                         f"trusted key {q(path)} line {n}: not-after {not_after[:40]!r} is not a UTC time "
                         "YYYY-MM-DDTHH:MM:SSZ", hint=f"write it as e.g. not-after: 2027-01-31T00:00:00Z in {path}",
                         path=path)
    if any(ln.strip() for ln in lines[end + 1:]):
        raise _error(BundleError, "trusted-key-invalid", f"trusted key {q(path)} has text after {PEM_END}",
                     hint="keep one key per file; remove what follows the key", path=path)
    body = "".join("".join(lines[begin + 1:end]).split())
    try:
        der = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        der = b""
    if base64.b64encode(der).decode("ascii") != body:  # canonical base64 only: one text per key
        der = b""
    if len(der) != len(SPKI_ED25519) + 32 or der[:len(SPKI_ED25519)] != SPKI_ED25519:
        raise _error(BundleError, "trusted-key-invalid", f"trusted key {q(path)} is not an Ed25519 PEM public key",
                     hint="remove or replace that file", path=path)
    raw = der[len(SPKI_ED25519):]
    return TrustedKey(key_id_of_raw(raw), raw, path, not_after, parse_not_after(not_after) if not_after else None)


def parse_revocations(text: str, path: str) -> dict[str, Revocation]:
    """The revocation list (see the module doc): {key id: its first revocation}; KeyRefused on a bad line."""
    out: dict[str, Revocation] = {}
    for n, raw_line in enumerate(text.split("\n"), 1):
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        kid, _, reason = line.partition(" ")
        if not _KEY_ID.match(kid) or _PRINTABLE.search(reason):
            raise _error(KeyRefused, "revocation-list-invalid",
                         f"revocation list {q(path)} line {n}: {line[:60]!r} does not start with a key id "
                         f"({KEY_ID_LEN} lowercase hex digits)", hint=f"write one `KEYID reason` per line in {path}",
                         path=path)
        out.setdefault(kid, Revocation(kid, reason.strip(), path, n))
    return out


def _read_text(p: Path, limit: int, what: str) -> str:
    """A key file or the revocation list as text; a file that is not readable ASCII text is refused by name."""
    cls: type[DeployError] = KeyRefused if what == "revocation list" else BundleError
    reason = "revocation-list-invalid" if what == "revocation list" else "trusted-key-invalid"
    try:
        with open(p, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise _error(cls, reason, f"{what} {q(p)} cannot be read: {exc.strerror}",
                     hint="remove or replace that file", path=str(p)) from None
    if len(data) > limit:
        raise _error(cls, reason, f"{what} {q(p)} is larger than {limit} bytes", hint="remove or replace that file",
                     path=str(p))
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise _error(cls, reason, f"{what} {q(p)} is not ASCII text", hint="remove or replace that file",
                     path=str(p)) from None


@dataclass(frozen=True)
class Keyring:
    dir: str
    keys: dict[str, TrustedKey] = field(default_factory=dict)
    revoked: dict[str, Revocation] = field(default_factory=dict)

    def refusal(self, key_id: str, now: float | None = None) -> DeployError | None:
        """Why `key_id` may not sign what this box installs now (revoked, expired), or None (it also may not when
        it is not in `keys` at all: that is the caller's untrusted-key)."""
        rev = self.revoked.get(key_id)
        if rev is not None:
            why = f" ({rev.reason})" if rev.reason else ""
            return _error(KeyRefused, "key-revoked", f"bundle is signed by key {key_id}, which is revoked in "
                          f"{rev.path} line {rev.line}{why}",
                          hint="install a bundle signed by a key this box trusts (docs/trust.md: rotating the "
                               "signing key)", path=rev.path)
        k = self.keys.get(key_id)
        if k is not None and k.not_after_epoch is not None:
            t = time.time() if now is None else now
            if t > k.not_after_epoch:
                return _error(KeyRefused, "key-expired", f"bundle is signed by key {key_id} ({k.path}), which "
                              f"expired at {k.not_after} (not-after)",
                              hint=f"install a bundle signed by a current key; if this key is still safe, move its "
                                   f"not-after line in {k.path} later", path=k.path)
        return None

    def to_json(self) -> dict[str, object]:
        return {"dir": self.dir, "keys": [k.to_json() for k in self.keys.values()],
                "revoked": sorted(self.revoked)}


def load(keys_dir: str | os.PathLike[str], *, require_keys: bool = True) -> Keyring:
    """Every *.pub key and the revocation list of `keys_dir`; refuses (fail closed) on any file it cannot read."""
    d = Path(keys_dir)
    if not d.is_dir():
        raise _error(BundleError, "no-trusted-keys", f"trusted keys directory {q(d)} does not exist",
                     hint="copy the signer's .pub file there, or pass --keys DIR")
    keys: dict[str, TrustedKey] = {}
    for p in sorted(d.glob("*.pub")):
        k = parse_key_file(_read_text(p, MAX_KEY_FILE, "trusted key"), str(p))
        keys.setdefault(k.key_id, k)
    revoked: dict[str, Revocation] = {}
    rl = d / REVOKED_NAME
    if rl.exists() or rl.is_symlink():
        revoked = parse_revocations(_read_text(rl, MAX_REVOKED_FILE, "revocation list"), str(rl))
    if require_keys and not keys:
        raise _error(BundleError, "no-trusted-keys", f"no trusted public keys (*.pub) in {q(d)}",
                     hint="copy the signer's .pub file there, or pass --keys DIR")
    return Keyring(str(d), keys, revoked)


def key_file_text(pem: str, not_after: str | None = None, comment: str | None = None) -> str:
    """A key file as `deploytool keygen` writes it: the optional header, then the PEM block."""
    head = ""
    if comment:
        head += "".join(f"# {ln}\n" for ln in comment.splitlines())
    if not_after:
        head += f"not-after: {not_after}\n"
    return head + pem
