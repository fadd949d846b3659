# -*- coding: utf-8 -*-
# Copyright: deploytool maintainers; MIT License (see LICENSE)
# The host side of deploytool.fleet.ship (the action plugin of the same name drives it from the controller).

from __future__ import annotations

DOCUMENTATION = r"""
---
module: ship
short_description: Ship a deploytool bundle to a host, sending only the files the host lacks
description:
  - Copies an unpacked deploytool bundle directory (what C(deploytool pack) writes) from the controller to
    O(dest)/<release> on the host, where <release> is the bundle id of its MANIFEST.
  - Files the host already has in earlier shipped bundles under O(dest), by SHA-256, are not sent again; they are
    laid down locally in a staging directory after a check (see O(rehash)), as hard links between bundles of
    MANIFEST format 2 (packed by deploytool 0.2.0 or later) and as copies otherwise (see O(link)). Only the missing files cross the network,
    with rsync over the play's own ssh connection, and the previous bundles serve as rsync's basis, so a changed
    file at the same path (the venv's archive of a distribution whose wheel changed) travels as a delta.
  - The bundle's smallest files (each at most 64 KiB, together at most 512 KiB) go along with the first module
    call, whether or not the host has them; those the host lacks are written from there. When that covers all it
    lacks (a release a few small files apart, such as a rebuilt pure-Python wheel and its part of the venv, the
    lock and the units), the host verifies and renames in that same call, so such a release takes one module call
    per host and no rsync.
  - Every file of the staging directory is then checked against the MANIFEST (no extra or missing file; size, mode
    and SHA-256 of each) and only then is the directory renamed to O(dest)/<release> in one rename. A failed ship
    leaves neither O(dest)/<release> nor the staging directory. A release the host already has (checked) is
    C(changed=false); nothing is sent but the small files that went along with the first call.
  - The MANIFEST signature is not checked here; the host may have no deploytool yet. C(deploytool install) and
    bootstrap check it against the box's trusted keys before anything of the bundle is used.
  - The task runs as an action plugin on the controller (reading the bundle's MANIFEST, running rsync) and this
    module on the host (what it has, seeding, verifying, renaming). Needs rsync on the controller and the host.
version_added: 0.1.0
author: deploytool maintainers (@deploytool)
options:
  src:
    description: The unpacked bundle directory on the controller (holding MANIFEST and MANIFEST.sig).
    type: path
    required: true
  dest:
    description: Where the host keeps shipped bundles; the bundle lands at O(dest)/<release>.
    type: path
    default: /var/lib/deploytool/bundles
  keep:
    description: How many shipped bundles the host keeps (the oldest beyond it are removed after a success).
    type: int
    default: 3
  rehash:
    description:
      - Re-read every earlier file before reusing it, instead of trusting a (device, inode, size, mtime, ctime)
        record taken when this module last hashed it. The record is safe against any change through the file
        system (a write, truncate, chmod or replacement moves ctime, which no system call can set back); use
        O(rehash) against corruption below the file system.
    type: bool
    default: false
  link:
    description:
      - Lay down the files the host already has as hard links to the earlier bundle's, not copies, so the kept
        bundles share what did not change and a release one file apart writes only that file. Only for files
        owned by the user the module runs as (root under become) with the wanted mode; a copy otherwise (or where
        the file system refuses a link).
      - Omitted, files are linked between bundles of MANIFEST format 2 (packed by deploytool 0.2.0 or later)
        and copied where either bundle is of format 1. Only deploytool 0.2.0 or later reads format 2, and every
        such one installs a linked file; deploytool 0.1.0 may refuse a bundle file with other links, so a format-1
        bundle it may still install gains none. V(true) links between any bundles (only where every host runs
        deploytool 0.2.0 or later; else a revert to a linked format-1 bundle may fail; to undo it, remove the
        linked O(dest)/<release> directories and ship again with V(false)). V(false) always copies.
      - Before deploytool 0.2.0 the default was V(false).
      - The bundles under O(dest) are then to be treated as read-only as a whole (a chmod, touch or edit of one
        file changes it in every bundle that shares it); a damaged shared file is refused by its hash in each
        bundle at that bundle's next ship, and sent again.
    type: bool
  rsync_opts:
    description: Extra rsync options (e.g. C(--bwlimit=50M)).
    type: list
    elements: str
    default: []
  phase:
    description: Internal (set by the action plugin); ship (prepare with O(inline), and commit when nothing is
      left to send), prepare, commit or abort.
    type: str
    choices: [ship, prepare, commit, abort]
  inline:
    description: Internal; the bundle's small files sent along with the first call, as a JSON object of path to
      base64 content (one string, so that hiding it from the task's logged invocation cannot touch any other
      value), so a release a few small files apart needs no rsync and one module call.
    type: str
  manifest:
    description: Internal; the MANIFEST's text.
    type: str
  signature:
    description: Internal; the MANIFEST.sig text.
    type: str
  staging:
    description: Internal; the staging directory of a commit or abort.
    type: str
attributes:
  action:
    support: full
    description: Runs on the controller as an action plugin (the MANIFEST, rsync) and on the host as this module.
  check_mode:
    support: full
    description: Can run in check mode.
    details: Reports what would be sent (files, bytes) and changes nothing on the host.
  diff_mode:
    support: full
    description: Shows what it changes.
    details: The list of files, each marked as sent (+) or reused (=).
  platform:
    support: full
    platforms: posix
    description: A Linux host reached over ssh, with rsync.
notes:
  - Connections other than ssh and local are refused (rsync needs a shell on the host over ssh).
"""

EXAMPLES = r"""
- name: Ship the release
  deploytool.fleet.ship:
    src: "{{ bundle_dir }}"
    dest: /var/lib/deploytool/bundles
    keep: 3
  register: shipped

- name: Install what was shipped
  ansible.builtin.command: deploytool install {{ shipped.path }}
"""

RETURN = r"""
path:
  description: The bundle directory on the host.
  type: str
  returned: always
  sample: /var/lib/deploytool/bundles/1be71fe02a5d08cc
release:
  description: The bundle id (the release).
  type: str
  returned: always
sent_files:
  description: Files the host lacked and received, by rsync or along with the first call (in check mode, that it
    lacks).
  type: int
  returned: always
sent_bytes:
  description: Bytes from the controller to the host, as rsync counts them, plus RV(inline_bytes) (in check mode,
    the size of the files that would be sent).
  type: int
  returned: always
inline_bytes:
  description: File bytes sent along with the first module call (the bundle's smallest files, needed or not; as
    base64, about 4/3 of it crosses); counted in RV(sent_bytes).
  type: int
  returned: when not in check mode
literal_bytes:
  description: File data rsync had to send literally (the rest was matched in the basis files).
  type: int
  returned: when files were sent
reused_files:
  description: Files of the release the host already had (copied or linked from earlier bundles).
  type: int
  returned: always
linked_files:
  description: How many of RV(reused_files) are hard links to an earlier bundle's file (see O(link)).
  type: int
  returned: always
refused:
  description: Files of earlier bundles that matched the MANIFEST by path list but failed their check (changed on
    the host), so they were not reused.
  type: list
  returned: always
seconds:
  description: Wall time of the ship.
  type: float
  returned: always
removed:
  description: Older bundles removed to honour O(keep).
  type: list
  returned: on a change
"""

import base64
import binascii
import json
import os
import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.deploytool.fleet.plugins.module_utils.ship_core import (
    ShipError,
    abort,
    commit,
    parse_manifest,
    prepare,
    ship,
)


def _decode(inline):
    """The JSON text {path: base64 text} as {path: bytes}; None stays None."""
    if inline is None:
        return None
    try:
        files = json.loads(inline)
    except ValueError:
        raise ShipError("inline is not a JSON object", "bad-inline") from None
    if not isinstance(files, dict):
        raise ShipError("inline is not a JSON object", "bad-inline")
    out = {}
    for path, text in files.items():
        try:
            out[path] = base64.b64decode(text, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise ShipError("inline file %r is not base64" % (path,), "bad-inline", path) from None
    return out


def main():
    module = AnsibleModule(
        argument_spec=dict(
            src=dict(type="path", required=True),
            dest=dict(type="path", default="/var/lib/deploytool/bundles"),
            keep=dict(type="int", default=3),
            rehash=dict(type="bool", default=False),
            link=dict(type="bool"),
            rsync_opts=dict(type="list", elements="str", default=[]),
            phase=dict(type="str", choices=["ship", "prepare", "commit", "abort"]),
            inline=dict(type="str", no_log=True),
            manifest=dict(type="str"),
            signature=dict(type="str", no_log=False),
            staging=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if not p["phase"]:
        module.fail_json(msg="deploytool.fleet.ship runs through its action plugin (the task name "
                             "deploytool.fleet.ship with src=); the module alone cannot reach the controller's files")
    dest = p["dest"]
    try:
        if p["phase"] == "abort":
            if not p["manifest"]:
                module.fail_json(msg="abort needs the manifest")
            m = parse_manifest(p["manifest"])
            module.exit_json(changed=False, **abort(dest, p["staging"], m.bundle_id))
        if not p["manifest"]:
            module.fail_json(msg="manifest is required")
        m = parse_manifest(p["manifest"])
        if p["phase"] == "ship" and not module.check_mode:
            out = ship(dest, m, _decode(p["inline"]), signature=p["signature"], keep=p["keep"], rehash=p["rehash"],
                       link=p["link"])
            module.exit_json(changed=not out["present"], **out)
        if p["phase"] in ("ship", "prepare"):
            out = prepare(dest, m, check_mode=module.check_mode, rehash=p["rehash"], signature=p["signature"],
                          link=p["link"])
            module.exit_json(changed=not out["present"], **out)
        if module.check_mode:
            module.exit_json(changed=True, path=os.path.join(dest, m.bundle_id))
        out = commit(dest, p["staging"], m, signature=p["signature"], keep=p["keep"], rehash=p["rehash"])
        module.exit_json(changed=True, **out)
    except ShipError as exc:
        module.fail_json(msg=str(exc), reason=exc.reason, file=exc.path)
    except OSError as exc:
        module.fail_json(msg="%s: %s" % (getattr(exc, "filename", None) or dest, exc.strerror or exc),
                         reason="os-error", exception=traceback.format_exc())


if __name__ == "__main__":
    main()
