# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The expected files of a peer copy, and what this host's cache already has of them.

The expected files come from the Hub's listing of the commit, made once per run on the
controller: ``[{"path", "size", "etag"}]`` (``etag``: the sha256 of an LFS file, which is also its
blob name in the cache, or the git blob sha1 of any other file; store/disk_plan.py's
``list_target`` gives that shape). ``expected_listing`` turns it into hf_snapshot's tree entries,
every path and id checked (hub_trust) before it becomes a path on disk; ``inspect`` reads, and
writes nothing, whether a verified manifest vouches for them (one ``stat`` per file) and which
blobs are missing. ``shared_entry`` and ``shared_link`` recognise huggingface_hub 2.4's links
into a cache-wide Xet store (``blobs/<xx>/<xet hash>``): on the peer, in its dry run's listing,
and here.

``PeerError``, a failure with the ``cause`` the role acts on, is defined here, below the other
files of peer_snapshot's logic.
"""
from __future__ import annotations

import os
import posixpath
import re

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_verify
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.common import hub_trust
from ansible_collections.modelswap.vllm.plugins.module_utils.store import xet_store

FILES_FIX = ("pass the controller's listing of the target ({commit, files: [{path, size, etag}]}, "
             "store/disk_plan.py list_target or the role's own listing)")


class PeerError(Exception):
    """A failure with a ``cause`` the role acts on (the message is final)."""

    def __init__(self, msg: str, cause: str, result=None):
        super().__init__(msg)
        self.cause = cause
        self.result = result or {}


# --------------------------------------------------------------------------------------------
# the expected files
# --------------------------------------------------------------------------------------------
def lfs_pointer_oid(sha256: str, size: int) -> str:
    """The git blob id the Hub lists for an LFS file: that of its pointer file."""
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n" % (sha256, size)
    return hf_verify.git_blob_id(pointer.encode())


def expected_listing(files) -> dict:
    """``{path: {"size", "blob_id", "lfs_sha256"?, "xet_hash"?}}`` (hf_snapshot's tree entries) from ``files``.

    An etag of 64 hex digits is an LFS file's sha256; one of 40 is a git blob sha1. Every path and
    id is checked (hub_trust) before it becomes a path on disk; PeerError names a bad entry.
    """
    if not isinstance(files, list) or not files:
        raise PeerError("the expected file list is empty or not a list; %s" % FILES_FIX, "bad_files")
    listing = {}
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            raise PeerError("files[%d] is not a mapping of path, size, etag; %s" % (i, FILES_FIX), "bad_files")
        path, size, etag = f.get("path"), f.get("size"), f.get("etag")
        if path in listing:
            raise PeerError("files lists %r twice; %s" % (path, FILES_FIX), "bad_files")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PeerError("files[%d] (%r) has size %r, not a byte count; %s" % (i, path, size, FILES_FIX),
                            "bad_files")
        if not isinstance(etag, str) or hub_trust.id_problem(etag):
            raise PeerError("files[%d] (%r) has etag %r, which is neither a sha256 nor a git blob id; %s"
                            % (i, path, etag, FILES_FIX), "bad_files")
        if len(etag) == 64:
            listing[path] = {"size": size, "blob_id": lfs_pointer_oid(etag, size), "lfs_sha256": etag}
        else:
            listing[path] = {"size": size, "blob_id": etag}
        if f.get("xet_hash") is not None:
            listing[path]["xet_hash"] = f["xet_hash"]       # checked by listing_problems below
    problems = hub_trust.listing_problems(listing)
    if problems:
        raise PeerError("the expected file list has an unsafe entry: %s; nothing was written or deleted; %s"
                        % ("; ".join(problems), FILES_FIX), "bad_files")
    return listing


def blob_of(entry: dict) -> str:
    return entry.get("lfs_sha256") or entry["blob_id"]


def units(wanted: dict) -> dict:
    """{etag: [paths]}: files that share a blob are copied and hashed once."""
    out = {}
    for path in sorted(wanted):
        out.setdefault(blob_of(wanted[path]), []).append(path)
    return out


# --------------------------------------------------------------------------------------------
# what is here
# --------------------------------------------------------------------------------------------
def link_target(layout, commit: str, path: str, entry: dict) -> str:
    """The relative link huggingface_hub makes: snapshots/<commit>/<path> -> ../../blobs/<etag>."""
    link = layout.locate(commit, path)
    return os.path.relpath(layout.blob(entry), os.path.dirname(link))


def inspect(layout, commit: str, wanted: dict, shared: bool) -> dict:
    """Read-only: does a manifest vouch for ``wanted`` (one stat per file), which blobs are missing."""
    manifest_file = hf_manifest.manifest_path(layout.meta_root, commit)
    manifest = hf_manifest.read_manifest(manifest_file, layout.repo_id, commit)
    ok, stale = hf_manifest.covers(manifest, wanted, lambda p: layout.locate(commit, p), "full",
                                   same_device=not shared)
    missing = {}
    for etag, paths in units(wanted).items():
        if not os.path.lexists(os.path.join(layout.repo_path, "blobs", etag)):
            missing[etag] = int(wanted[paths[0]]["size"])
    reason = None
    if not ok:
        reason = ("no verified manifest of %s@%s at %s" % (layout.repo_id, commit[:12], manifest_file)
                  if manifest is None else
                  "%d file(s) not vouched for by %s (e.g. %s)" % (len(stale), manifest_file, ", ".join(stale[:3])))
    return {"manifest": manifest, "manifest_file": manifest_file, "verified": ok, "stale": stale,
            "missing": missing, "missing_bytes": sum(missing.values()), "reason": reason}


# --------------------------------------------------------------------------------------------
# huggingface_hub's links into a cache-wide Xet store, on the peer and here
# --------------------------------------------------------------------------------------------
# huggingface_hub 2.4's cache-wide store of Xet payloads (utils/_shared_blobs.py): regular files
# <cache>/blobs/<first 2 hex>/<xet hash>, in a store xet_store.is_shared_store recognises.
SHARED_ENTRY_RE = re.compile(r"^blobs/([0-9a-f]{2})/([0-9a-f]{64})$")


def shared_entry(folder: str, target: str):
    """``blobs/<xx>/<xet hash>`` (relative to the cache) when ``target``, the value of the link
    ``<folder>/blobs/<name>``, is huggingface_hub's link into the cache-wide Xet store; else None."""
    if not target or target.startswith("/"):
        return None
    rel = posixpath.normpath(posixpath.join(folder, "blobs", target))
    m = SHARED_ENTRY_RE.match(rel)
    return rel if m and m.group(2).startswith(m.group(1)) else None


def shared_link(layout, name: str):
    """``blobs/<xx>/<xet hash>`` when ``<repo>/blobs/<name>`` is huggingface_hub's link into this
    cache's marked shared Xet store (a link this host's own downloads made); else None."""
    try:
        target = os.readlink(os.path.join(layout.repo_path, "blobs", name))
    except OSError:
        return None
    return shared_entry(layout.folder, target) if xet_store.is_shared_store(layout.root) else None
