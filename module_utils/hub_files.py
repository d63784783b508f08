# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The file list of a pinned model revision: from the cache's tree listing or from the Hub.

Each file comes back as ``{"path", "size", "etag"}`` where ``etag`` is the name its blob gets in
the cache (the sha256 for LFS files, the git blob sha1 otherwise), so the planner can tell what is
already there. huggingface_hub is optional at import; ``HAS_HF`` / ``HF_IMPORT_ERROR`` let the
module fail with ``missing_required_lib``.
"""
from __future__ import annotations

import json
import os

from ansible_collections.modelswap.vllm.plugins.module_utils import hub_trust as ht
from ansible_collections.modelswap.vllm.plugins.module_utils.disk_planning import PlanError, filter_paths
from ansible_collections.modelswap.vllm.plugins.module_utils.model_store import COMMIT_RE, repo_folder_name

try:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.hf_api import RepoFile
    HAS_HF = True
    HF_IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - exercised on hosts without the library
    HAS_HF = False
    HF_IMPORT_ERROR = exc


DEFAULT_ENDPOINT = "https://huggingface.co"


def _checked(files: list, what: str, fix: str) -> list:
    """``files`` ([{"path", "size", "etag", "blob_id", "lfs_sha256"?}]) once every entry is safe to
    use as a path and a blob name (hub_trust); PlanError naming the bad entry otherwise."""
    listing = {}
    for f in files:
        entry = {"size": f["size"], "blob_id": f["blob_id"]}
        if f.get("lfs_sha256") is not None:
            entry["lfs_sha256"] = f["lfs_sha256"]
        listing[f["path"]] = entry
    try:
        ht.check_listing(listing, what, fix)
    except ht.ListingError as exc:
        raise PlanError(str(exc))
    return [{"path": f["path"], "size": f["size"], "etag": f["etag"]} for f in files]


def read_tree_cache(cache_dir: str, repo_id: str, commit: str, repo_type: str = "model"):
    """Files from ``<repo folder>/trees/<commit>.json`` (written by snapshot_download), or None.

    An entry whose path or blob id is unsafe (hub_trust) is a PlanError, not a miss.
    """
    if not cache_dir or not COMMIT_RE.match(commit or ""):
        return None
    path = os.path.join(cache_dir, repo_folder_name(repo_id, repo_type), "trees", commit + ".json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("format_version") != 1:
            return None
        files = [{"path": p, "size": info["size"], "blob_id": info["blob_id"],
                  "lfs_sha256": info.get("lfs_sha256") or None,
                  "etag": info.get("lfs_sha256") or info["blob_id"]}
                 for p, info in data["files"].items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return _checked(files, "huggingface_hub's tree cache %s of %s@%s" % (path, repo_id, commit[:12]),
                    "remove that file (it was tampered with or damaged) and run again")


def target_files(repo_id: str, revision: str, *, cache_dir: str = "", endpoint=None, token=None,
                 allow_patterns=None, ignore_patterns=None, offline_ok: bool = True,
                 repo_type: str = "model", http_endpoint_trusted: bool = False) -> dict:
    """{"commit", "files", "source"}: the target's files after allow/ignore patterns.

    A pinned commit with a cached tree listing needs no network (source ``tree_cache``); otherwise
    the Hub is asked (source ``hub``): the revision is resolved to a commit, then the tree listed.
    """
    files = None
    source = "tree_cache"
    # a branch may have moved on the Hub: only a pinned commit is trusted offline
    commit = revision if COMMIT_RE.match(revision) else None
    if commit and offline_ok:
        files = read_tree_cache(cache_dir, repo_id, commit, repo_type)
    if files is None:
        problem = ht.token_endpoint_problem(endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT,
                                            bool(token), http_endpoint_trusted)
        if problem:
            raise PlanError("refusing to list %s@%s: %s" % (repo_id, revision, problem))
        if not HAS_HF:
            raise PlanError("listing %s@%s needs huggingface_hub on the host (%s); run the task with "
                            "a Python that has it (the vLLM virtualenv) or pass target_bytes"
                            % (repo_id, revision, HF_IMPORT_ERROR))
        source = "hub"
        api = HfApi(endpoint=endpoint or None, token=token or False)
        where = endpoint or "the Hub"
        try:
            if not commit:
                info = api.repo_info(repo_id, revision=revision, repo_type=repo_type)
                commit = info.sha
            files = read_tree_cache(cache_dir, repo_id, commit, repo_type)
            if files is not None:
                source = "tree_cache"
            else:
                listed = []
                for f in api.list_repo_tree(repo_id, revision=commit, recursive=True, repo_type=repo_type):
                    if isinstance(f, RepoFile):
                        sha = f.lfs.sha256 if f.lfs is not None else None
                        listed.append({"path": f.path, "size": f.size, "blob_id": f.blob_id, "lfs_sha256": sha,
                                       "etag": sha or f.blob_id})
                files = listed
        except PlanError:
            raise
        except GatedRepoError:
            raise PlanError("%s is gated on %s and the token (if any) has no access: set a token "
                            "with access, or pass target_bytes" % (repo_id, where))
        except RepositoryNotFoundError:
            raise PlanError("%s was not found on %s (or is private without a valid token): fix the "
                            "catalog's repo_id, the endpoint or the token" % (repo_id, where))
        except RevisionNotFoundError:
            raise PlanError("revision %s of %s was not found on %s: pin an existing commit in the "
                            "catalog" % (revision, repo_id, where))
        except HfHubHTTPError as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status in (401, 403):
                raise PlanError("listing %s@%s on %s was refused (HTTP %s): the token is invalid or has "
                                "no access; fix the token" % (repo_id, revision, where, status))
            raise PlanError("listing %s@%s on %s failed (HTTP %s): retry, or pass target_bytes when the "
                            "Hub is unreachable" % (repo_id, revision, where, status or "?"))
        except Exception as exc:  # connection refused, DNS, timeouts, offline mode
            raise PlanError("cannot reach %s to list %s@%s (%s: %s): check the endpoint and the network, "
                            "or pass target_bytes when the Hub is unreachable"
                            % (where, repo_id, revision, type(exc).__name__, exc))
    if source == "hub":
        files = _checked(files, "the file list %s served for %s@%s" % (where, repo_id, (commit or "")[:12]),
                         "a real Hub never lists such a file: check the endpoint (a broken or malicious "
                         "mirror, or a man in the middle on a plain http:// endpoint)")
    kept = set(filter_paths([f["path"] for f in files], allow_patterns, ignore_patterns))
    chosen = [f for f in files if f["path"] in kept]
    if files and not chosen:
        raise PlanError("the allow/ignore patterns of %s@%s match none of its %d files: fix "
                        "allow_patterns/ignore_patterns in the catalog" % (repo_id, revision, len(files)))
    return {"commit": commit, "files": chosen, "source": source}
