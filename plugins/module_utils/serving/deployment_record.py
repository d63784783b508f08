# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The host's deployment record: what its vLLM unit serves now, and what it served before.

A small JSON file (default /var/lib/modelswap/deployment.json) that other roles read
(served_model.read_deployment_record, the purge's "never the served model" rule, status). Its
top level is the current deployment; ``previous`` is the one before it (without its own
``previous``); keys this module does not own (``fetched``, written by model_fetch) are kept::

    {"schema": 1,
     "model": "tiny-b", "repo_id": "lab/tiny-b", "commit": "<40 hex>", "path": "/.../snapshots/<commit>",
     "served_model_name": "tiny-b", "unit": "vllm.service", "unit_checksum": "<sha256>",
     "env_checksum": "<sha256>", "vllm_version": "0.32.0+cpu", "args": ["/opt/.../vllm", "serve", ...],
     "host": "0.0.0.0", "port": 8000, "when": "2026-12-02T13:00:00Z",
     "previous": {"model": "tiny-a", ..., "when": "..."},
     "fetched": {"tiny-a": {...}, "tiny-b": {...}}}

Writers take an exclusive ``flock`` on ``<record>.lock`` (as model_fetch does) and replace the
file atomically. No secret is ever written here (``args`` never holds the API key).

The saved configurations (``<saved_dir>/active`` and ``/previous``) change with the record in
three steps, so that a failure at any point leaves the old state or the new one and the next run
completes it: stage the new copies in ``<saved_dir>/.staged`` (its ``for.json`` written last),
write the record (the commit point), publish the staged copies over active/previous. A run that
finds a ``.staged`` publishes it when the record names the deployment it was staged for, and
discards it otherwise (see ``recovery``).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import atomic_copy, atomic_write_text
from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import (
    COMMIT_RE,
    StoreError,
    validate_repo_id,
)

SCHEMA = 1
DEPLOYMENT_KEYS = ("model", "repo_id", "commit", "path", "served_model_name", "unit",
                   "unit_checksum", "env_checksum", "vllm_version", "args", "host", "port")
REQUIRED_KEYS = ("model", "path", "served_model_name", "unit")
OWN_KEYS = DEPLOYMENT_KEYS + ("when", "previous", "schema")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.@\\-]+\Z")   # systemd's unit name characters


class RecordError(Exception):
    """A record or a deployment that cannot be used (message is final)."""


def normalize(deployment) -> dict:
    """The deployment keys of ``deployment`` (missing ones as None); RecordError when unusable."""
    if not isinstance(deployment, dict):
        raise RecordError("a deployment must be a mapping with keys %s" % ", ".join(DEPLOYMENT_KEYS))
    unknown = sorted(set(deployment) - set(DEPLOYMENT_KEYS))
    if unknown:
        raise RecordError("unknown deployment keys %s (allowed: %s)"
                          % (", ".join(unknown), ", ".join(DEPLOYMENT_KEYS)))
    missing = [k for k in REQUIRED_KEYS if not deployment.get(k)]
    if missing:
        raise RecordError("the deployment lacks %s" % ", ".join(missing))
    out = {k: deployment.get(k) for k in DEPLOYMENT_KEYS}
    for key in ("model", "served_model_name", "unit", "repo_id", "commit", "path", "host",
                "vllm_version"):
        value = out[key]
        if value is not None and not isinstance(value, str):
            raise RecordError("deployment %s must be a string, got %r" % (key, value))
        if value and (_CONTROL_RE.search(value) or value != value.strip()):
            raise RecordError("deployment %s %r holds a control character or surrounding blanks; "
                              "pass the plain name" % (key, value))
    if not os.path.isabs(out["path"]):
        raise RecordError("deployment path %r is not an absolute path; pass the model folder the unit "
                          "serves" % out["path"])
    if not _UNIT_RE.match(out["unit"]):
        raise RecordError("deployment unit %r is not a systemd unit name (letters, digits, ':', '_', "
                          "'.', '@', '-', '\\'), e.g. 'vllm.service'" % out["unit"])
    if out["commit"] and not COMMIT_RE.match(out["commit"]):
        raise RecordError("deployment commit %r is not a 40-hex commit hash; pass the resolved commit "
                          "(or leave it empty for a plain model folder)" % out["commit"])
    if out["repo_id"]:
        try:
            validate_repo_id(out["repo_id"])
        except StoreError as exc:
            raise RecordError("deployment %s" % exc)
    if out["args"] is not None:
        if not isinstance(out["args"], list):
            raise RecordError("deployment args must be the ExecStart argv as a list")
        out["args"] = [str(a) for a in out["args"]]
    if out["port"] is not None:
        try:
            out["port"] = int(out["port"])
        except (TypeError, ValueError):
            raise RecordError("deployment port must be an integer, got %r" % (out["port"],))
        if not 1 <= out["port"] <= 65535:
            raise RecordError("deployment port %d is not a TCP port (1-65535)" % out["port"])
    return out


def options_problem(mode: str, saved_files, saved_dir) -> str:
    """Why the deployment_record module's options are unusable (naming the option), or ''."""
    modes = [("mode", mode)] + [("saved_files %s mode" % f["name"], f["mode"]) for f in saved_files]
    for option, value in modes:
        try:
            bits = int(value, 8)
        except (TypeError, ValueError):
            return "%s %r is not an octal permission like '0644'" % (option, value)
        if bits & ~0o7777 or bits & 0o022:
            return ("%s %r lets other users rewrite the file (what model_purge protects and what a "
                    "rollback restores depend on it); use '0644' or stricter" % (option, value))
    if saved_files and not saved_dir:
        return "saved_files needs saved_dir (where to keep them)"
    seen = set()
    for f in saved_files:
        name = f["name"]
        if "/" in name or name in ("", ".", "..") or _CONTROL_RE.search(name):
            return "saved_files name %r is not a plain file name (no '/', not '.' or '..')" % name
        if name in seen:
            return "saved_files name %r is listed twice; names must be unique" % name
        seen.add(name)
    return ""


def facts_options_problem(unit: str, replaces, port, repo_id) -> str:
    """Why vllm_service_info's options are unusable (naming the option and the fix), or ''."""
    for option, name in [("unit", unit)] + [("replaces", n) for n in replaces]:
        if name and not _UNIT_RE.match(name):
            return ("%s %r is not a systemd unit name (letters, digits, ':', '_', '.', '@', '-', '\\'), "
                    "e.g. 'vllm.service'" % (option, name))
    if port is not None and not 1 <= port <= 65535:
        return "port %d is not a TCP port (1-65535)" % port
    if repo_id is not None:
        try:
            validate_repo_id(repo_id)
        except StoreError as exc:
            return "model.%s" % exc
    return ""


def current(record):
    """The current deployment of ``record`` (DEPLOYMENT_KEYS + ``when``), or None."""
    if not record or not record.get("model"):
        return None
    out = {k: record.get(k) for k in DEPLOYMENT_KEYS}
    out["when"] = record.get("when")
    return out


def previous(record):
    """The deployment before the current one, or None."""
    prev = (record or {}).get("previous")
    return prev if isinstance(prev, dict) and prev.get("model") else None


def same(a, b) -> bool:
    """Two deployments are the same when every deployment key is equal (``when`` aside)."""
    if a is None or b is None:
        return a is b
    return all(a.get(k) == b.get(k) for k in DEPLOYMENT_KEYS)


def record_deployment(record, deployment, when: str):
    """(new record, changed): ``deployment`` becomes current; the old current becomes previous.

    Recording the deployment that is already current changes nothing (not even ``when``), so a
    run with nothing to do leaves the file as it is. Keys owned by others are kept.
    """
    record = dict(record or {})
    new = normalize(deployment)
    old = current(record)
    if same(old, new) and record.get("schema") == SCHEMA:
        return record, False
    out = {k: v for k, v in record.items() if k not in OWN_KEYS}
    out["schema"] = SCHEMA
    out.update(new)
    if same(old, new):
        out["when"] = record.get("when") or when
        out["previous"] = previous(record)
    else:
        out["when"] = when
        out["previous"] = old
    return out, True


def parse(text: str, path: str):
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RecordError("the deployment record %s is not valid JSON (%s); fix or remove it"
                          % (path, exc))
    if not isinstance(data, dict):
        raise RecordError("the deployment record %s is not a JSON object; fix or remove it" % path)
    prev = data.get("previous")
    if prev is not None and not isinstance(prev, dict):
        raise RecordError("the deployment record %s has a 'previous' that is not a mapping; "
                          "fix or remove it" % path)
    return data


def read(path: str):
    """The record at ``path`` as a dict, or None when there is none; RecordError when unusable."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RecordError("cannot read the deployment record %s: %s" % (path, exc.strerror or exc))
    return parse(text, path)


def dumps(record) -> str:
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def write(path: str, record, mode: int = 0o644) -> None:
    """Replace the record atomically (temp file in the same folder, fsync, rename)."""
    atomic_write_text(path, dumps(record), mode)


# --------------------------------------------------------------------------------------------
# saved configurations: <saved_dir>/active (the last verified one, restored when a swap fails)
# and <saved_dir>/previous (the one before it, restored by the rollback action)
# --------------------------------------------------------------------------------------------
def sha256_file(path: str):
    """The sha256 of a file, or None when it does not exist."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def plan_saved(files, sums: dict, deployment_replaced: bool) -> list:
    """What to copy so that active/ holds the live files and previous/ the replaced ones.

    ``files``: [{"name", "path", "mode"}]; ``sums``: {("live"|"active"|"previous", name): sha256
    or None}. ``deployment_replaced``: a new deployment replaced a recorded one in this run.
    Returns [("rotate", name)] (active -> previous) then [("save", name)] (live -> active).
    """
    actions = []
    if deployment_replaced:
        for f in files:
            active = sums.get(("active", f["name"]))
            if active is not None and active != sums.get(("previous", f["name"])):
                actions.append(("rotate", f["name"]))
    for f in files:
        live = sums.get(("live", f["name"]))
        if live is not None and live != sums.get(("active", f["name"])):
            actions.append(("save", f["name"]))
    return actions


def copy_file(src: str, dest: str, mode: int) -> None:
    """Copy ``src`` over ``dest`` atomically with ``mode``; dest's folder is created 0700 (it holds
    the saved unit and environment files)."""
    atomic_copy(src, dest, mode, makedirs=True, dir_mode=0o700)


def deployment_replaced(record, deployment) -> bool:
    """A recorded deployment exists and ``deployment`` differs from it: its saved files rotate to
    previous. Recording the same deployment again (a schema upgrade included) rotates nothing."""
    old = current(record)
    return old is not None and not same(old, normalize(deployment))


# --------------------------------------------------------------------------------------------
# staged saved configurations: <saved_dir>/.staged/{active,previous}/<name> and for.json
# --------------------------------------------------------------------------------------------
STAGED = ".staged"
STAGED_FOR = "for.json"
_DESTS = {"rotate": "previous", "save": "active"}


def staged_dir(saved_dir: str) -> str:
    return os.path.join(saved_dir, STAGED)


def staging_plan(saved_dir: str, files, actions, deployment, modes: dict):
    """(manifest, sources) for ``actions`` (plan_saved's): what ``.staged/for.json`` says and
    where each staged copy comes from.

    manifest: {"schema", "deployment": the normalized deployment the copies are for, "files":
    [{"name", "to": "previous"|"active", "mode"}]} (rotations first); sources: {(to, name): the
    file to copy into ``.staged/<to>/<name>``}: a rotation stages the current saved/active copy,
    a save the live file. Nothing is staged for no actions (manifest None)."""
    if not actions:
        return None, {}
    live = {f["name"]: f["path"] for f in files}
    entries, sources = [], {}
    for action, name in actions:
        to = _DESTS[action]
        entries.append({"name": name, "to": to, "mode": modes[name]})
        sources[(to, name)] = (os.path.join(saved_dir, "active", name) if action == "rotate"
                               else live[name])
    return {"schema": SCHEMA, "deployment": normalize(deployment), "files": entries}, sources


def recovery(staged: bool, manifest, record):
    """What to do with a ``.staged`` found at the start of a run (under the record's lock):

    - None: there is none;
    - "discard": it has no ``for.json`` (a run died while staging), or the record does not name
      the deployment it was staged for (the record write, the commit, never happened: active and
      previous were never touched);
    - "publish": the record names that deployment (the commit happened, the copies over
      active/previous may not have): copy them over, then remove it.
    """
    if not staged:
        return None
    if manifest is None:
        return "discard"
    return "publish" if same(current(record), manifest.get("deployment")) else "discard"


def parse_staged(text: str, path: str) -> dict:
    """``.staged/for.json`` as a manifest; RecordError (naming it) when unusable."""
    how = ("; remove %s to discard it (the record and the saved configurations are then as the "
           "record says) " % os.path.dirname(path))
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RecordError("the staged configuration %s is not valid JSON (%s)%s" % (path, exc, how))
    ok = isinstance(data, dict) and isinstance(data.get("deployment"), dict) and isinstance(data.get("files"), list)
    for entry in (data.get("files") if ok else None) or []:
        name = entry.get("name") if isinstance(entry, dict) else None
        if (not isinstance(name, str) or "/" in name or name in ("", ".", "..") or _CONTROL_RE.search(name)
                or entry.get("to") not in ("active", "previous") or not isinstance(entry.get("mode"), int)):
            ok = False
    if not ok:
        raise RecordError("the staged configuration %s is not what this module writes%s" % (path, how))
    return data


def read_staged(saved_dir: str):
    """(a .staged exists, its manifest or None when it has no for.json)."""
    root = staged_dir(saved_dir)
    if not os.path.lexists(root):
        return False, None
    path = os.path.join(root, STAGED_FOR)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (FileNotFoundError, NotADirectoryError):
        return True, None
    except OSError as exc:
        raise RecordError("cannot read the staged configuration %s: %s" % (path, exc.strerror or exc))
    return True, parse_staged(text, path)


def fsync_dir(path: str) -> None:
    """Make the names in folder ``path`` durable (a rename or unlink in it survives a crash)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stage(saved_dir: str, manifest: dict, sources: dict) -> None:
    """Build ``.staged`` (any leftover removed first): the copies, fsync'd, then ``for.json``
    last. Nothing under active/ or previous/ is touched."""
    root = staged_dir(saved_dir)
    discard(saved_dir)
    os.makedirs(saved_dir, mode=0o700, exist_ok=True)
    os.mkdir(root, 0o700)
    for entry in manifest["files"]:
        copy_file(sources[(entry["to"], entry["name"])], os.path.join(root, entry["to"], entry["name"]),
                  entry["mode"])
    for to in ("active", "previous"):
        fsync_dir(os.path.join(root, to))
    atomic_write_text(os.path.join(root, STAGED_FOR), json.dumps(manifest, sort_keys=True) + "\n", 0o600)
    fsync_dir(root)
    fsync_dir(saved_dir)


def publish(saved_dir: str, manifest: dict) -> None:
    """Copy the staged files over active/ and previous/ (each atomically; running it again after
    a crash gives the same result), make them durable, then remove ``.staged``."""
    root = staged_dir(saved_dir)
    for entry in manifest["files"]:
        copy_file(os.path.join(root, entry["to"], entry["name"]),
                  os.path.join(saved_dir, entry["to"], entry["name"]), entry["mode"])
    for to in ("active", "previous"):
        fsync_dir(os.path.join(saved_dir, to))
    discard(saved_dir)


def discard(saved_dir: str) -> None:
    """Remove ``.staged``: ``for.json`` first (durably), so that a crash in between leaves a
    ``.staged`` without one, which the next run discards."""
    root = staged_dir(saved_dir)
    if not os.path.lexists(root):
        return
    if os.path.islink(root) or not os.path.isdir(root):
        os.unlink(root)
    else:
        try:
            os.unlink(os.path.join(root, STAGED_FOR))
        except FileNotFoundError:
            pass
        else:
            fsync_dir(root)
        shutil.rmtree(root)
    fsync_dir(saved_dir)


def drop_uncommitted(saved_dir: str, record_path: str) -> None:
    """After a failed stage or record write: remove the ``.staged`` unless the record names its
    deployment (then the commit happened after all, and the next run publishes it), so the host
    is left exactly as before. Best effort: whatever stays, the next run's recovery settles."""
    try:
        staged, manifest = read_staged(saved_dir)
        if recovery(staged, manifest, read(record_path)) == "discard":
            discard(saved_dir)
    except (OSError, RecordError):
        pass
