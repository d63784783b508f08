# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Is a model fetched and verified on this host? Where is its snapshot?

vllm_service starts only a snapshot that hf_snapshot downloaded and verified: a manifest of
format ``modelswap.hf_snapshot/1`` for ``repo_id@commit`` (plugins/module_utils/store/hf_manifest.py) whose
files are all still on disk exactly as they were verified (size, inode, mtime: one ``stat`` per
file, no hashing). The snapshot is found, in this order:

1. an explicit path (``vllm_service_snapshot_path``);
2. the host's deployment record, ``fetched.<name>`` (written by model_fetch) when its repo and
   commit match;
3. the Hugging Face cache layout ``<cache>/models--org--name/snapshots/<commit>``.

The commit is the catalog's revision when it is a 40-hex commit; a branch or tag is resolved
through ``fetched.<name>`` (model_fetch records the commit it resolved).
"""
from __future__ import annotations

import os

from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.common import hub_trust
from ansible_collections.modelswap.vllm.plugins.module_utils.store import cache_layout

# cache_layout owns the commit rule (\Z, not $: "$" also matches before a trailing newline).
COMMIT_RE = cache_layout.COMMIT_RE
MODES = ("full", "size", "none")
FIX = "fetch it first (playbooks/fetch.yml, role model_fetch)"


def repo_folder(repo_id: str) -> str:
    return cache_layout.repo_folder_name(repo_id)


def manifest_for(path: str, commit: str, cache_dir=None, repo_id=None) -> str:
    """Where hf_snapshot keeps the manifest of the snapshot at ``path``."""
    parent = os.path.dirname(path.rstrip("/"))
    if os.path.basename(parent) == "snapshots":
        return hf_manifest.manifest_path(os.path.dirname(parent), commit)
    return hf_manifest.manifest_path(os.path.join(path, ".cache", "huggingface"), commit)


def locate(name, repo_id, revision, record=None, cache_dir=None, path=None) -> dict:
    """{"commit", "path", "manifest", "source"} of a catalog model on this host (no I/O).

    ``commit`` or ``path`` is None when it cannot be known; ``reason`` then says why.
    """
    fetched = ((record or {}).get("fetched") or {}).get(name)
    if not isinstance(fetched, dict) or fetched.get("repo_id") != repo_id:
        fetched = None
    commit = None
    if revision and COMMIT_RE.match(revision):
        commit = revision
    elif fetched and fetched.get("revision") == revision and COMMIT_RE.match(fetched.get("commit") or ""):
        commit = fetched["commit"]
    if fetched and fetched.get("commit") != commit:
        fetched = None
    out = {"commit": commit, "path": None, "manifest": None, "source": None, "reason": None}
    if path:
        out.update(path=path.rstrip("/") or "/", source="vllm_service_snapshot_path")
        if fetched and fetched.get("path") == out["path"] and fetched.get("manifest"):
            out["manifest"] = fetched["manifest"]
    elif fetched and fetched.get("path"):
        out.update(path=fetched["path"], manifest=fetched.get("manifest"), source="record fetched.%s" % name)
    elif commit and cache_dir:
        out.update(path=os.path.join(cache_dir, repo_folder(repo_id), "snapshots", commit),
                   source="cache %s" % cache_dir)
    if commit is None:
        out["reason"] = ("revision %r of %s is not a commit and the deployment record has no "
                         "fetched commit for it; %s (it resolves and records the commit)"
                         % (revision, repo_id, FIX))
    elif out["path"] is None:
        out["reason"] = "no snapshot path: set vllm_service_snapshot_path or vllm_service_hf_cache"
    if commit and out["path"] and not out["manifest"]:
        out["manifest"] = manifest_for(out["path"], commit)
    return out


def check(name, repo_id, revision, *, record=None, cache_dir=None, path=None, mode="full") -> dict:
    """Locate and verify a snapshot. Returns locate()'s keys plus "verified", "files", "bytes",
    "verified_at", "verify" and a "reason" when not verified."""
    if mode not in MODES:
        raise ValueError("mode must be one of %s" % ", ".join(MODES))
    try:
        cache_layout.validate_repo_id(repo_id)
    except cache_layout.StoreError as exc:
        out = {"commit": None, "path": None, "manifest": None, "source": None}
        return dict(out, verified=False, files=0, bytes=0, verified_at=None, verify=None,
                    reason=str(exc))
    loc = locate(name, repo_id, revision, record, cache_dir, path)
    out = dict(loc, verified=False, files=0, bytes=0, verified_at=None, verify=None)
    if loc["reason"]:
        return out
    where = loc["path"]
    if not os.path.isdir(where):
        out["reason"] = ("%s (%s@%s) is not on this host: %s does not exist; %s"
                         % (name, repo_id, loc["commit"], where, FIX))
        return out
    if not os.path.isfile(os.path.join(where, "config.json")):
        out["reason"] = ("%s has no config.json: it is not a model snapshot vLLM can serve"
                         % where)
        return out
    if mode == "none":
        out.update(verified=True, bytes=_size(where), reason=None, verify="none")
        return out
    manifest = hf_manifest.read_manifest(loc["manifest"], repo_id, loc["commit"])
    if manifest is None:
        out["reason"] = ("%s (%s@%s) at %s has no verified manifest (%s): it was not downloaded "
                         "and verified by hf_snapshot; %s"
                         % (name, repo_id, loc["commit"], where, loc["manifest"], FIX))
        return out
    listing = manifest.get("listing") or {}
    unsafe = hub_trust.listing_problems(listing) + [
        "path %r %s" % (p, hub_trust.path_problem(p)) for p in manifest["files"] if hub_trust.path_problem(p)]
    if unsafe:
        out["reason"] = ("the manifest %s has an unsafe entry (%s): it names files outside the snapshot or "
                         "blobs that are not hashes, so it vouches for nothing; remove it and %s again"
                         % (loc["manifest"], "; ".join(unsafe[:3]), FIX))
        return out
    wanted = {p: listing.get(p) or {"size": -1, "blob_id": ""} for p in manifest["files"]}
    ok, stale = hf_manifest.covers(manifest, wanted, lambda p: os.path.join(where, p), mode)
    out.update(verify=manifest.get("verify"), verified_at=manifest.get("verified_at"),
               files=len(manifest["files"]), bytes=int(manifest.get("bytes") or 0))
    if not manifest["files"]:
        out["reason"] = "the manifest %s lists no verified file" % loc["manifest"]
        return out
    if not ok:
        if hf_manifest.MODE_RANK.get(manifest.get("verify"), 0) < hf_manifest.MODE_RANK[mode]:
            out["reason"] = ("%s was verified by %s only, %s verification is required; %s with "
                             "full verification" % (where, manifest.get("verify"), mode, FIX))
        else:
            out["reason"] = ("%d file(s) of %s changed or vanished since they were verified "
                             "(%s); %s again" % (len(stale), where, ", ".join(stale[:5]), FIX))
        return out
    out["verified"] = True
    return out


def _size(path):
    total = 0
    for root, _dirs, files in os.walk(path):
        for n in files:
            try:
                total += os.stat(os.path.join(root, n)).st_size
            except OSError:
                pass
    return total
