# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""A service's configuration files written in one call (the logic of service_files).

The controller renders every file (the unit, its environment file, its API key file); one module
call compares each with the host's by content, checks a new unit before it replaces the live one,
and replaces what differs atomically (mode and owner set before the new content is visible).
Where ansible.builtin.template costs a task and a round trip per file, a fleet's preview and swap
pay one. A secret file's content is never in a diff or a result: its diff says only that it
would change.
"""
from __future__ import annotations

import grp
import hashlib
import os
import pwd
import shutil
import tempfile

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import atomic_write_bytes

SECRET_NOTE = "%s: the content %s (a secret file: not shown)\n"


class FilesError(Exception):
    """A file cannot be planned or written; the message names it and the fix."""


def sha1_bytes(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def read_current(path: str):
    """The file's bytes, or None when it does not exist."""
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise FilesError("%s is a directory, not a file; remove it or choose another path" % path)
    except OSError as exc:
        raise FilesError("cannot read %s (%s); run with become" % (path, exc))


def ids_of(owner, group) -> tuple:
    """(uid, gid) of the names (None: leave as is); FilesError for an unknown name."""
    try:
        uid = pwd.getpwnam(owner).pw_uid if owner else None
        gid = grp.getgrnam(group).gr_gid if group else None
    except KeyError as exc:
        raise FilesError("unknown owner or group %s; create it first or fix the name" % exc)
    return uid, gid


def plan_file(spec: dict, secret: bool) -> dict:
    """What writing ``spec`` (path, content, mode, owner, group) changes on this host."""
    path = spec["path"]
    if not os.path.isabs(path):
        raise FilesError("path %r is not absolute; give the full path" % path)
    want = spec["content"].encode("utf-8")
    have = read_current(path)
    mode = int(spec["mode"], 8) if spec.get("mode") else None
    uid, gid = ids_of(spec.get("owner"), spec.get("group"))
    attrs = False
    if have is not None:
        st = os.stat(path)
        attrs = ((mode is not None and (st.st_mode & 0o7777) != mode)
                 or (uid is not None and st.st_uid != uid) or (gid is not None and st.st_gid != gid))
    return {"path": path, "secret": secret, "exists": have is not None, "content_changed": have != want,
            "attributes_changed": attrs, "changed": have != want or attrs, "mode": mode, "uid": uid,
            "gid": gid, "before": have, "after": want, "validate": spec.get("validate") or ""}


def plan_directory(spec: dict) -> dict:
    """What ensuring the directory ``spec`` (path, mode, owner, group) changes on this host."""
    path = spec["path"]
    if not os.path.isabs(path):
        raise FilesError("directory %r is not absolute; give the full path" % path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise FilesError("%s exists and is not a directory; remove it or choose another path" % path)
    mode = int(spec["mode"], 8) if spec.get("mode") else None
    uid, gid = ids_of(spec.get("owner"), spec.get("group"))
    exists = os.path.isdir(path)
    attrs = False
    if exists:
        st = os.stat(path)
        attrs = ((mode is not None and (st.st_mode & 0o7777) != mode)
                 or (uid is not None and st.st_uid != uid) or (gid is not None and st.st_gid != gid))
    return {"path": path, "directory": True, "exists": exists, "changed": not exists or attrs,
            "mode": mode, "uid": uid, "gid": gid}


def make_directory(item: dict) -> None:
    """Create a planned directory (and missing parents, 0755) and set its mode and owner."""
    path = item["path"]
    if not item["exists"]:
        os.makedirs(path, mode=0o755, exist_ok=True)
    if item["uid"] is not None or item["gid"] is not None:
        os.chown(path, -1 if item["uid"] is None else item["uid"], -1 if item["gid"] is None else item["gid"])
    if item["mode"] is not None:
        os.chmod(path, item["mode"])


def diff_of(item: dict, check_mode: bool) -> dict:
    """One diff entry for the callback (a secret file's says only that it changes)."""
    if item.get("directory"):
        return {"prepared": "%s: directory %s\n" % (item["path"], ("would be " if check_mode else "") + (
            "created" if not item["exists"] else "given its mode and owner"))}
    if item["secret"]:
        return {"prepared": SECRET_NOTE % (item["path"], "would change" if check_mode else "changed")}
    return {"before_header": item["path"] if item["exists"] else "%s (absent)" % item["path"],
            "after_header": item["path"],
            "before": (item["before"] or b"").decode("utf-8", "replace"), "after": item["after"].decode("utf-8")}


def summary(item: dict) -> dict:
    """What the result says of a file (no content, no checksum of a secret)."""
    if item.get("directory"):
        return {"path": item["path"], "changed": item["changed"], "created": not item["exists"], "directory": True}
    out = {"path": item["path"], "changed": item["changed"], "created": not item["exists"],
           "content_changed": item["content_changed"], "secret": item["secret"]}
    if not item["secret"]:
        out["sha1"] = sha1_bytes(item["after"])
    return out


def check(item: dict, run_validate) -> None:
    """Run a planned file's check on its new content (``run_validate(command, path) -> (rc,
    out)``, a copy under the file's own name in a temporary folder); FilesError when it fails."""
    path = item["path"]
    if item["content_changed"] and item["validate"]:
        folder = tempfile.mkdtemp(prefix="modelswap-check-")
        probe = os.path.join(folder, os.path.basename(path))
        try:
            atomic_write_bytes(probe, item["after"], mode=0o600)
            rc, out = run_validate(item["validate"], probe)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if rc != 0:
            raise FilesError("%s was not replaced: its check (%s) failed: %s" % (path, item["validate"], out.strip()))


def write(item: dict) -> None:
    """Replace one planned (and checked) file: content atomically, then owner and mode."""
    path = item["path"]
    if item["content_changed"]:
        atomic_write_bytes(path, item["after"], mode=item["mode"] if item["mode"] is not None else 0o644)
    if item["uid"] is not None or item["gid"] is not None:
        os.chown(path, -1 if item["uid"] is None else item["uid"], -1 if item["gid"] is None else item["gid"])
    if item["mode"] is not None:
        os.chmod(path, item["mode"])
