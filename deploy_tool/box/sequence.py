"""No replay: a box installs no bundle older than the newest of its name that it installed.

Every bundle carries, in its signed MANIFEST's inputs, its name (`bundle_name`) and a `sequence` (pack's input:
`pack --sequence N`, bundle.sequence, or SOURCE_DATE_EPOCH; deploy_tool.builder.pack.sequence_of). The box keeps
the highest sequence it installed per name in `<state_dir>/sequences.json` (written when an install commits,
atomically, under the lock):

    {"format": 1, "names": {"cpu-demo": {"sequence": 1750000000, "release": "<id>", "time": "..."}}}

`check` refuses (DowngradeError, exit 24, naming both bundles) a bundle whose sequence is lower than that, before
anything changes, unless the operator says why (`install --allow-downgrade --reason TEXT`, recorded in history;
the highest stays where it was, so the bundles between are still refused). A bundle of a release that is laid
down on the box (releases/<id>: what an install of it left, and only root can make one) is not a downgrade:
going back to it (the fleet's revert, an install of the previous bundle) works as before; deleting an old release's
directory retires it. An equal sequence is accepted (a rebuild, or packs that set none: 0). A bundle packed before
sequences existed has none: it counts as sequence 0 under its config's bundle.name.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy_tool.config import SEQUENCE
from deploy_tool.errors import DowngradeError, StateError
from deploy_tool.fsutil import atomic_write, os_error
from deploy_tool.manifest import Manifest, reject
from deploy_tool.textsafe import q

RECORD_NAME = "sequences.json"
RECORD_FORMAT = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


@dataclass(frozen=True)
class BundleSequence:
    name: str
    number: int
    legacy: bool = False  # the MANIFEST carries no sequence (packed before they existed): 0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "sequence": self.number, "legacy": self.legacy}


@dataclass(frozen=True)
class Downgrade:
    """An install below the highest, allowed on purpose: what history records."""

    name: str
    to: int
    highest: int
    highest_release: str | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "from": self.highest, "from_release": self.highest_release, "to": self.to,
                "reason": self.reason}


def of_bundle(manifest: Manifest, config_json: Path | None = None) -> BundleSequence:
    """The bundle's name and sequence from its (verified) MANIFEST; BundleError (exit 6) if they are malformed."""
    inputs = manifest.inputs
    if "sequence" not in inputs and "bundle_name" not in inputs:
        name = "deploytool"
        if config_json is not None:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                name = str(json.loads(config_json.read_bytes())["bundle"]["name"])
        return BundleSequence(name, 0, legacy=True)
    raw_name, number = inputs.get("bundle_name"), inputs.get("sequence")
    if not isinstance(raw_name, str) or not _NAME.match(raw_name):
        raise reject("sequence-invalid", f"bundle {manifest.bundle_id}: its MANIFEST's bundle_name {raw_name!r} is not a "
                     "bundle name", hint="pack the bundle again with `deploytool pack`")
    if type(number) is not int or not SEQUENCE.admits(number):
        raise reject("sequence-invalid", f"bundle {manifest.bundle_id}: its MANIFEST's sequence {number!r} is not "
                     f"{SEQUENCE.text(True)}", hint="pack the bundle again with `deploytool pack --sequence N`")
    return BundleSequence(raw_name, number)


def record_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / RECORD_NAME


def load(state_dir: str | Path) -> dict[str, dict[str, Any]]:
    """{name: {"sequence", "release", "time"}} of the box (empty before the first install that kept one)."""
    p = record_path(state_dir)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise os_error(exc, f"cannot read {p}") from None
    bad = StateError(f"{q(p)} is not a deploytool sequence record of format {RECORD_FORMAT}",
                     hint=f"restore it from a backup; if it is lost, `deploytool install` starts a new one once {p} "
                          "is moved aside (and accepts any sequence until then)")
    try:
        d = json.loads(raw)
    except ValueError:
        raise bad from None
    if not isinstance(d, dict) or d.get("format") != RECORD_FORMAT or not isinstance(d.get("names"), dict):
        raise bad
    out: dict[str, dict[str, Any]] = {}
    for name, rec in d["names"].items():
        if not isinstance(rec, dict) or type(rec.get("sequence")) is not int:
            raise bad
        out[name] = rec
    return out


def check(releases_dir: str | Path, state_dir: str | Path, seq: BundleSequence, release: str, *,
          allow_downgrade: str | None = None) -> Downgrade | None:
    """Refuse (DowngradeError) installing `release` of sequence `seq` below the highest of its name, unless it is
    laid down on the box already or `allow_downgrade` (the reason) is given: then the Downgrade to record."""
    if (Path(releases_dir) / release).is_dir():
        return None  # installed on this box before: going back to it is not a downgrade
    rec = load(state_dir).get(seq.name)
    if rec is None or seq.number >= rec["sequence"]:
        return None
    if allow_downgrade:
        return Downgrade(seq.name, seq.number, rec["sequence"], rec.get("release"), allow_downgrade)
    legacy = " (it carries none: packed before sequences)" if seq.legacy else ""
    raise DowngradeError(
        f"bundle {release} ({seq.name}) has sequence {seq.number}{legacy}, lower than sequence {rec['sequence']} of "
        f"release {rec.get('release')} this box installed: an older bundle is not installed over a newer one",
        hint="install a bundle with a sequence of at least that (pack with `--sequence N`); to go back on purpose: "
             "deploytool install BUNDLE --allow-downgrade --reason TEXT",
        details={"bundle": {"release": release, **seq.to_json()},
                 "highest": {"release": rec.get("release"), "sequence": rec["sequence"]}})


def record(state_dir: str | Path, seq: BundleSequence, release: str, when: str) -> bool:
    """Keep `seq` as its name's highest if it is higher than the one kept (or none is); True if written."""
    names = load(state_dir)
    rec = names.get(seq.name)
    if rec is not None and rec["sequence"] >= seq.number:
        return False
    names[seq.name] = {"sequence": seq.number, "release": release, "time": when}
    body = {"format": RECORD_FORMAT, "names": names}
    atomic_write(record_path(state_dir), (json.dumps(body, indent=1, sort_keys=True) + "\n").encode(), 0o644)
    return True
