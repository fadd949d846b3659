"""Controller side of deploytool.fleet.ship: read the bundle's MANIFEST, ask the host what it lacks, send only that
with rsync over the play's own ssh connection, and have the host verify and rename (see the module's doc)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import time

from ansible.errors import AnsibleActionFail
from ansible.module_utils.common.text.converters import to_text
from ansible.module_utils.parsing.convert_bool import boolean
from ansible_collections.deploytool.fleet.plugins.module_utils.ship_core import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    Entry,
    Manifest,
    ShipError,
    parse_manifest,
    parse_stats,
)

from ansible.plugins.action import ActionBase

try:  # deploytool's own MANIFEST reader, where deploytool is installed on the controller (it wrote the MANIFEST)
    from deploy_tool.errors import DeployError
    from deploy_tool.manifest import Manifest as PackageManifest
except ImportError:  # the collection's own (ship_core's, which the host runs too)
    PackageManifest = None

MODULE = "deploytool.fleet.ship"
DEFAULT_DEST = "/var/lib/deploytool/bundles"
MAX_BASIS = 20  # rsync takes at most 20 --copy-dest directories
# The bundle's smallest files go along with the first module call, whether or not the host has them: a release a
# few small files apart (a rebuilt pure-Python wheel and its venv part, the lock, config.json, the units) then
# lands in that one call, with no rsync and no second round trip (on the fleet bed such a ship took 1.87 s in three
# calls and an rsync, 1.28-1.43 s in one call on a quiet machine). The budget is not free: on the bed, 2 MiB a host
# made that ship 0.13-0.21 s slower than 512 KiB (bench/RESULTS.md, 2026-12-06 23:36), which still holds every
# pure-Python wheel of the cpu-demo bundle up to 64 KiB and its venv part.
INLINE_FILE_MAX = 64 << 10
INLINE_TOTAL_MAX = 512 << 10


def read_manifest_bytes(raw):
    """The MANIFEST's bytes as ship_core's Manifest (raw, bundle_id, files), read by deploytool's own reader where
    deploytool is importable here (it refuses all that ship_core's does, and a MANIFEST not in canonical form too),
    else by ship_core's; ShipError naming what is wrong."""
    if PackageManifest is None:
        return parse_manifest(raw)
    try:
        m = PackageManifest.from_bytes(raw)
    except DeployError as exc:
        raise ShipError("%s" % exc, getattr(exc, "reason", "manifest-malformed")) from None
    return Manifest(raw, m.bundle_id, [Entry(f.path, f.size, f.mode, f.sha256) for f in m.files], m.format_version)


def _flag(args, name, default=False):
    """A boolean task argument (`default` when absent or null); anything but a boolean's spelling fails the task."""
    if args.get(name) is None:
        return default
    try:
        return boolean(args[name], strict=True)
    except TypeError:
        raise AnsibleActionFail("%s must be true or false, got %r" % (name, args.get(name))) from None


class ActionModule(ActionBase):

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("src", "dest", "keep", "rehash", "link", "rsync_opts"))

    def run(self, tmp=None, task_vars=None):
        t0 = time.monotonic()
        result = super().run(tmp, task_vars)
        del tmp
        args = self._task.args
        src = args.get("src")
        dest = args.get("dest") or DEFAULT_DEST
        keep = args.get("keep", 3)
        rehash, link = _flag(args, "rehash"), _flag(args, "link", None)  # link None: the host decides per file
        rsync_opts = args.get("rsync_opts") or []
        if isinstance(rsync_opts, str):
            rsync_opts = shlex.split(rsync_opts)
        check = bool(self._task.check_mode)
        diff = bool(self._task.diff)
        try:
            keep = int(keep)
        except (TypeError, ValueError):
            raise AnsibleActionFail("keep must be an integer of at least 1, got %r" % (keep,)) from None
        if keep < 1:
            raise AnsibleActionFail("keep must be an integer of at least 1, got %r" % (keep,))
        if not isinstance(rsync_opts, list) or not all(isinstance(o, str) for o in rsync_opts):
            raise AnsibleActionFail("rsync_opts must be a list of strings")
        if not src:
            raise AnsibleActionFail("src is required: the unpacked bundle directory on the controller")
        if not isinstance(dest, str) or not dest.startswith("/"):
            raise AnsibleActionFail("dest must be an absolute path on the host, got %r" % (dest,))
        src = os.path.expanduser(str(src))
        if not os.path.isabs(src):
            src = self._loader.path_dwim(src)  # relative to the playbook's directory, as copy's src is
        src = os.path.realpath(src)
        manifest, signature = self._read_bundle(src)
        # src (the controller's path) goes along only because the module declares it required, as the task does
        common = {"src": src, "dest": dest, "keep": keep, "rehash": rehash, "link": link,
                  "manifest": to_text(manifest.raw),
                  "signature": to_text(signature) if signature is not None else None}

        timings = {}
        first = dict(common, phase="prepare")
        inline_bytes = 0
        if not check:
            inline, inline_bytes = self._inline(src, manifest)
            first = dict(common, phase="ship", inline=json.dumps(inline) if inline else None)
        t1 = time.monotonic()
        prep = self._execute_module(module_name=MODULE, module_args=first, task_vars=task_vars)
        timings["prepare"] = round(time.monotonic() - t1, 3)  # with the commit, when it came in the same call
        if prep.get("unreachable") or prep.get("failed"):
            prep.pop("invocation", None)  # it holds the whole MANIFEST
            prep.setdefault("msg", "ship: the host could not say what it has")
            if prep.get("failed") and not prep.get("unreachable"):
                prep["msg"] = "ship of %s to %s failed on the host: %s" % (
                    manifest.bundle_id, os.path.join(dest, manifest.bundle_id), prep["msg"])
            return dict(result, **prep)
        out = {"path": prep["path"], "release": manifest.bundle_id, "reused_files": prep["reused_files"],
               "linked_files": prep.get("linked_files", 0),
               "refused": prep.get("refused", []), "removed": [], "literal_bytes": 0, "timings": timings,
               "host_hashed_bytes": prep.get("hashed_bytes", 0)}
        sizes = dict((e.path, e.size) for e in manifest.files)
        missing = prep["missing"]
        inlined = prep.get("inlined", [])
        if diff:
            sent = set(missing) | set(inlined)
            lines = ["%s %s (%d bytes)" % ("+" if p in sent else "=", p, sizes[p]) for p in sorted(sizes)]
            result["diff"] = {"before_header": "%s (host has)" % prep["path"], "after_header": "%s (+ sent, = reused)"
                              % prep["path"], "before": "",
                              "after": "" if prep["present"] else "\n".join(lines) + "\n"}
        if prep["present"]:
            # the small files went along all the same (the controller cannot know before it asks)
            out.update(changed=False, sent_files=0, sent_bytes=inline_bytes, inline_bytes=inline_bytes,
                       seconds=round(time.monotonic() - t0, 3))
            return dict(result, **out)
        if check:
            out.update(changed=True, sent_files=len(missing), sent_bytes=prep["missing_bytes"],
                       seconds=round(time.monotonic() - t0, 3))
            return dict(result, **out)

        if prep.get("committed"):
            out.update(changed=True, sent_files=len(inlined), sent_bytes=inline_bytes, inline_bytes=inline_bytes,
                       removed=prep.get("removed", []), seconds=round(time.monotonic() - t0, 3))
            return dict(result, **out)

        staging = prep["staging"]
        stats = {}
        t1 = time.monotonic()
        if missing:
            try:
                stats = self._rsync(src, staging, missing, prep.get("basis") or [], rsync_opts, task_vars)
            except AnsibleActionFail as exc:
                self._execute_module(module_name=MODULE, module_args=dict(common, phase="abort", staging=staging),
                                     task_vars=task_vars)
                raise exc
        timings["transfer"] = round(time.monotonic() - t1, 3)
        t1 = time.monotonic()
        done = self._execute_module(module_name=MODULE, module_args=dict(
            common, phase="commit", staging=staging),
            task_vars=task_vars)
        timings["commit"] = round(time.monotonic() - t1, 3)
        if done.get("unreachable") or done.get("failed"):
            done.pop("invocation", None)
            done["msg"] = "ship of %s to %s failed on the host: %s" % (
                manifest.bundle_id, prep["path"], done.get("msg", "?"))
            return dict(result, **done)
        out.update(changed=True, sent_files=len(missing) + len(inlined),
                   sent_bytes=stats.get("sent_bytes", 0) + inline_bytes, inline_bytes=inline_bytes,
                   literal_bytes=stats.get("literal_bytes", 0), matched_bytes=stats.get("matched_bytes", 0),
                   removed=done.get("removed", []),
                   host_hashed_bytes=out["host_hashed_bytes"] + done.get("hashed_bytes", 0),
                   seconds=round(time.monotonic() - t0, 3))
        return dict(result, **out)

    # ------------------------------------------------------------------ controller side

    @staticmethod
    def _inline(src, manifest):
        """({path: base64}, their bytes) of the bundle's smallest files, each at most INLINE_FILE_MAX, together at
        most INLINE_TOTAL_MAX (smallest first). Each is read without following a symlink and must be the MANIFEST's
        bytes (SHA-256, here: what goes along reaches every host, also those that have the file, so nothing else
        may); the host checks them again before its commit, as it does what rsync sends."""
        out, total = {}, 0
        for e in sorted(manifest.files, key=lambda e: (e.size, e.path)):
            if e.size > INLINE_FILE_MAX or total + e.size > INLINE_TOTAL_MAX:
                break
            path = os.path.join(src, e.path)
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise AnsibleActionFail("bundle %s: cannot read %s (%s)" % (src, e.path, exc.strerror)) from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise AnsibleActionFail("bundle %s: %s is not a regular file" % (src, e.path))
                with os.fdopen(fd, "rb", closefd=False) as f:
                    data = f.read(e.size + 1)
            finally:
                os.close(fd)
            if len(data) != e.size or hashlib.sha256(data).hexdigest() != e.sha256:
                raise AnsibleActionFail("bundle %s: %s does not match the MANIFEST (%s): the bundle directory was "
                                        "changed after it was packed" % (
                                            src, e.path, "%d bytes, the MANIFEST says %d" % (len(data), e.size)
                                            if len(data) != e.size else "SHA-256 differs"))
            out[e.path] = to_text(base64.b64encode(data))
            total += e.size
        return out, total

    @staticmethod
    def _read_bundle(src):
        """The MANIFEST (parsed, checked) and MANIFEST.sig bytes of the bundle directory `src`; every listed file
        must be there as a regular file of the listed size (hashes are checked on the host)."""
        if not os.path.isdir(src):
            raise AnsibleActionFail("src %s is not a directory: give the unpacked bundle directory (what "
                                    "`deploytool pack` writes beside the .tar.zst)" % src)
        try:
            with open(os.path.join(src, MANIFEST_NAME), "rb") as f:
                raw = f.read(64 << 20)
        except OSError as exc:
            raise AnsibleActionFail("%s has no readable MANIFEST (%s): is it a deploytool bundle directory?"
                                    % (src, exc.strerror)) from None
        try:
            manifest = read_manifest_bytes(raw)
        except ShipError as exc:
            raise AnsibleActionFail("bundle %s: %s" % (src, exc)) from None
        sig = None
        if os.path.isfile(os.path.join(src, SIGNATURE_NAME)):
            with open(os.path.join(src, SIGNATURE_NAME), "rb") as f:
                sig = f.read(4096)
        for e in manifest.files:
            p = os.path.join(src, e.path)
            try:
                st = os.lstat(p)
            except OSError:
                raise AnsibleActionFail("bundle %s: %s is listed in the MANIFEST but missing" % (src, e.path)) from None
            if not stat.S_ISREG(st.st_mode):
                raise AnsibleActionFail("bundle %s: %s is not a regular file" % (src, e.path))
            if st.st_size != e.size:
                raise AnsibleActionFail("bundle %s: %s is %d bytes, the MANIFEST says %d: the bundle directory was "
                                        "changed after it was packed" % (src, e.path, st.st_size, e.size))
        return manifest, sig

    def _remote_shell(self):
        """(rsync -e command, remote prefix 'host:', rsync-path) for the task's connection: the very ssh command
        line ansible's ssh connection uses (user, port, key, ssh_args incl. -F config, common/extra args and its
        ControlPath, so rsync rides the connection's master when there is one)."""
        conn = self._connection
        transport = getattr(conn, "transport", None) or getattr(conn, "_load_name", "")
        name = str(transport).rsplit(".", 1)[-1]
        rsync_path = None
        if self._play_context.become and (self._play_context.become_user or "root") == "root":
            method = self._play_context.become_method or "sudo"
            if method != "sudo":
                raise AnsibleActionFail("ship with become_method %s is not supported: use sudo or connect as root"
                                        % method)
            rsync_path = "sudo -n rsync"
        if name == "local":
            return None, "", rsync_path
        if name != "ssh":
            raise AnsibleActionFail("ship needs the ssh (or local) connection, this host uses %s" % transport)
        if conn.get_option("password") or self._play_context.password:
            raise AnsibleActionFail("ship does not support ssh password login (rsync runs its own ssh): use a key")
        ssh = conn.get_option("ssh_executable") or "ssh"
        argv = [to_text(a) for a in conn._build_command(ssh, "ssh")]
        host = conn.get_option("host") or self._play_context.remote_addr
        if ":" in host and not host.startswith("["):
            host = "[%s]" % host
        return " ".join(shlex.quote(a) for a in argv), "%s:" % host, rsync_path

    def _rsync(self, src, staging, missing, basis, extra, task_vars):
        rsync = shutil.which("rsync")
        if not rsync:
            raise AnsibleActionFail("rsync is not installed on the controller (install the rsync package)")
        rsh, prefix, rsync_path = self._remote_shell()
        fd, listing = tempfile.mkstemp(prefix="deploytool-ship-", suffix=".list")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0".join(p.encode("utf-8") for p in missing) + b"\0")
            # --omit-dir-times: the staging directory keeps the time of its creation on the host (a bundle's
            # directories carry SOURCE_DATE_EPOCH, which would make a ship in flight look abandoned)
            cmd = [rsync, "--files-from=%s" % listing, "--from0", "--times", "--omit-dir-times", "--perms",
                   "--ignore-times",
                   "--stats", "-s"]  # -s: paths reach the remote rsync verbatim
            if prefix:
                cmd += ["--no-whole-file", "-e", rsh]
            if rsync_path:
                cmd += ["--rsync-path", rsync_path]
            for b in basis[:MAX_BASIS]:
                cmd.append("--copy-dest=%s" % b)
            cmd += list(extra)
            cmd += [src.rstrip("/") + "/", "%s%s/" % (prefix, staging)]
            self._display.vvv("ship: %s" % " ".join(shlex.quote(c) for c in cmd), host=self._play_context.remote_addr)
            r = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, check=False)
        finally:
            os.unlink(listing)
        out, err = to_text(r.stdout, errors="replace"), to_text(r.stderr, errors="replace")
        if r.returncode != 0:
            raise AnsibleActionFail("rsync of %d file(s) to %s%s failed (exit %d): %s"
                                    % (len(missing), prefix, staging, r.returncode,
                                       err.strip()[-2000:] or out.strip()[-2000:]))
        return parse_stats(out)
