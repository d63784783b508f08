# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The target as the plan counts it: what disk_plan reports of it (``plan_target``) and the bytes
it still needs on this store (``target_needs``: its files minus the cached blobs, in whole blocks)."""
from __future__ import annotations

from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import COMMIT_RE, repo_folder_name, round_up


def target_needs(store, repo_id: str, commit: str, files, block_size: int,
                 repo_type: str = "model") -> dict:
    """Bytes the target still needs: its files (dicts with path, size, etag) minus cached blobs.

    New blobs are rounded up to whole blocks; each snapshot link not yet there is counted as a
    block (a symlink's target is longer than ext4 inlines), so the estimate errs on the safe side.
    """
    repo = store.repos.get(repo_folder_name(repo_id, repo_type))
    have = repo.blobs if repo is not None else {}
    rev = repo.revisions.get(commit) if repo is not None and commit else None
    linked = rev.blobs if rev is not None else set()
    total = cached = download = blocks = 0
    seen = set()
    missing = 0
    links = 0
    for f in files:
        total += f["size"]
        if f["etag"] not in linked:
            links += 1
        if f["etag"] in have:
            cached += f["size"]
            continue
        if f["etag"] in seen:
            continue
        seen.add(f["etag"])
        missing += 1
        download += f["size"]
        blocks += round_up(f["size"], block_size)
    metadata = links * block_size
    return {
        "files": len(files),
        "total_bytes": total,
        "cached_bytes": cached,
        "missing_files": missing,
        "download_bytes": download,
        "needed_bytes": blocks + metadata,
        "metadata_bytes": metadata,
    }


def plan_target(entry, name, target_bytes, listed) -> dict:
    """The target as disk_plan reports it, before its needs are added (``listed``: list_target's)."""
    target = {"name": name, "repo_id": None, "revision": None, "commit": None}
    if entry is not None:
        target.update(repo_id=entry["repo_id"], revision=entry["revision"])
    if target_bytes is not None:
        target.update(source="explicit", files=None, total_bytes=target_bytes, cached_bytes=0,
                      missing_files=None, download_bytes=target_bytes, needed_bytes=target_bytes,
                      metadata_bytes=0)
        if entry is not None and COMMIT_RE.match(entry["revision"]):
            target["commit"] = entry["revision"]
    else:
        target.update(commit=listed["commit"], source=listed["source"])
    return target
