# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The verified manifest of a snapshot, the cache's refs, and the deployment record.

A manifest says: these files of ``repo_id@commit`` were verified (full content or sizes) at this
time, and this is how each looked on disk then (size, inode, mtime). It lives next to the
snapshot, outside the folders huggingface_hub scans:

- cache mode: ``<cache>/models--org--name/modelswap/<commit>.json``
- local_dir mode: ``<local_dir>/.cache/huggingface/modelswap/<commit>.json``

It also keeps the commit's whole tree listing (sizes and digests of every file), so a later run
can select files by other patterns and re-verify with no network at all. ``covers`` decides, with
one ``stat`` per file, whether a manifest still vouches for the files a run wants: a file that was
replaced, rewritten or removed since no longer matches and is verified (or fetched) again.

Every write is a temporary file in the same folder, fsynced, then renamed over the target. Nothing
here ever holds a token. Pure stdlib: unit-tested directly.
"""
from __future__ import annotations

import contextlib
import json
import os
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import atomic_write_text, locked, write_text_if_changed

FORMAT = "modelswap.hf_snapshot/1"
MODE_RANK = {"size": 1, "full": 2}
FINGERPRINT_KEYS = ("size", "ino", "dev", "mtime_ns")
SHARED_FINGERPRINT_KEYS = ("size", "ino", "mtime_ns")


class ManifestError(Exception):
    """A record that exists but cannot be used (message is final)."""


def atomic_write_json(path: str, data, mode: int = 0o644) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename."""
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n", mode, makedirs=True)


def read_json(path: str):
    """The JSON at ``path``; None when the file does not exist."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


# --------------------------------------------------------------------------------------------
# manifests
# --------------------------------------------------------------------------------------------
def manifest_path(meta_root: str, commit: str) -> str:
    return os.path.join(meta_root, "modelswap", commit + ".json")


def fingerprint(st) -> dict:
    """What identifies a file's content on disk without reading it."""
    return {"size": st.st_size, "ino": st.st_ino, "dev": st.st_dev, "mtime_ns": st.st_mtime_ns}


def build_manifest(*, repo_id: str, revision: str, commit: str, endpoint: str, layout: str,
                   snapshot: str, listing: dict, verified: dict, mode: str, patterns: dict,
                   tool: dict) -> dict:
    """``verified``: {path: {"algo", "digest", "size", "ino", "dev", "mtime_ns"}}."""
    return {
        "format": FORMAT,
        "repo_id": repo_id,
        "revision": revision,
        "commit": commit,
        "endpoint": endpoint,
        "layout": layout,
        "snapshot": snapshot,
        "verify": mode,
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "patterns": patterns,
        "files": verified,
        "bytes": sum(int(v["size"]) for v in verified.values()),
        "listing": listing,
        "tool": tool,
    }


def read_manifest(path: str, repo_id: str, commit: str):
    """A usable manifest of ``repo_id@commit`` at ``path``, or None (absent, foreign, damaged)."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    if data.get("repo_id") != repo_id or data.get("commit") != commit:
        return None
    if not isinstance(data.get("files"), dict) or not isinstance(data.get("listing"), dict):
        return None
    return data


def covers(manifest, wanted: dict, locate, mode: str, same_device: bool = True) -> tuple:
    """Whether ``manifest`` vouches for every file in ``wanted`` ({path: tree entry}).

    ``locate(path)`` gives the file to stat (symlinks are followed). Returns
    ``(ok, stale_paths)``: ``stale_paths`` lists the files that must be verified again.
    The device number is compared too, except for a manifest of a shared store (its ``store``
    key) or with ``same_device=False``: each host that mounts one NFS export sees its own.
    """
    if manifest is None:
        return False, sorted(wanted)
    keys = FINGERPRINT_KEYS if same_device and not manifest.get("store") else SHARED_FINGERPRINT_KEYS
    strong_enough = MODE_RANK.get(manifest.get("verify"), 0) >= MODE_RANK[mode]
    stale = []
    files = manifest["files"]
    for path, entry in wanted.items():
        rec = files.get(path)
        if not strong_enough or rec is None:
            stale.append(path)
            continue
        want_algo, want_digest = ("sha256", entry["lfs_sha256"]) if entry.get("lfs_sha256") else \
            ("git-sha1", entry["blob_id"])
        if int(rec.get("size", -1)) != int(entry["size"]):
            stale.append(path)
            continue
        if manifest.get("verify") == "full" and (rec.get("algo"), rec.get("digest")) != (want_algo, want_digest):
            stale.append(path)
            continue
        try:
            st = os.stat(locate(path))
        except OSError:
            stale.append(path)
            continue
        now = fingerprint(st)
        if {k: now[k] for k in keys} != {k: rec.get(k) for k in keys}:
            stale.append(path)
    return not stale, sorted(stale)


def remove_other_manifests(meta_root: str, keep_commit: str) -> list:
    """Drop the manifests of other commits (local_dir mode: one commit lives in a folder)."""
    removed = []
    directory = os.path.join(meta_root, "modelswap")
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if name.endswith(".json") and name != keep_commit + ".json":
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed


# --------------------------------------------------------------------------------------------
# huggingface_hub's own metadata: refs/<revision> (trees/<commit>.json: hub_client)
# --------------------------------------------------------------------------------------------
def write_ref(repo_path: str, revision: str, commit: str) -> bool:
    """Record ``refs/<revision>`` -> commit as huggingface_hub does; True when it changed."""
    if revision == commit:
        return False
    return write_text_if_changed(os.path.join(repo_path, "refs", *revision.split("/")), commit, 0o644, makedirs=True)


# --------------------------------------------------------------------------------------------
# the host's deployment record
# --------------------------------------------------------------------------------------------
def fetched_entry(result: dict) -> dict:
    """What the deployment record keeps about one fetched model (stable across no-op runs)."""
    return {
        "repo_id": result["repo_id"],
        "revision": result["revision"],
        "commit": result["commit"],
        "path": result["snapshot_path"],
        "files": result["files"],
        "bytes": result["bytes_total"],
        "verified": result["verification"]["mode"],
        "verified_at": result["verification"]["verified_at"],
        "manifest": result["manifest"],
    }


def plan_record(path: str, name: str, entry: dict) -> tuple:
    """(changed, before, after) of putting ``entry`` at ``fetched.<name>`` in the record at ``path``."""
    try:
        data = read_json(path)
    except ValueError as exc:
        raise ManifestError("the deployment record %s is not valid JSON (%s); fix or remove it" % (path, exc))
    except OSError as exc:
        raise ManifestError("cannot read the deployment record %s: %s" % (path, exc.strerror or exc))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ManifestError("the deployment record %s is not a JSON object; fix or remove it" % path)
    fetched = data.get("fetched")
    if fetched is not None and not isinstance(fetched, dict):
        raise ManifestError("the deployment record %s has a 'fetched' that is not a mapping; fix it" % path)
    before = (fetched or {}).get(name)
    return before != entry, before, entry


def update_record(path: str, name: str, entry: dict) -> bool:
    """Set ``fetched.<name>`` in the record at ``path`` (other keys kept); True when it changed."""
    with locked(path):   # the lock every writer of the record takes
        changed, _before, _after = plan_record(path, name, entry)
        if not changed:
            return False
        data = read_json(path) or {}
        data.setdefault("fetched", {})[name] = entry
        atomic_write_json(path, data, mode=0o644)
    return True
