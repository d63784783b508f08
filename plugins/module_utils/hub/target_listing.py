# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The target's files as the disk plan counts them: listed on the Hub (or its tree cache), or
taken from a listing the controller made once for the fleet, checked and filtered by the entry's
patterns. Each file is ``{"path", "size", "etag"}`` (``etag``: the name its blob gets in the
cache). Failures are the plan's PlanError (store/plan_inputs.py), whose message is final.
"""
from __future__ import annotations

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client
from ansible_collections.modelswap.vllm.plugins.module_utils.store.plan_inputs import PlanError
from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import COMMIT_RE

HUB_WAY_OUT = "or pass target_bytes to plan without the Hub"


def list_target(repo_id: str, revision: str, *, cache_dir: str = "", endpoint=None, token=None,
                allow_patterns=None, ignore_patterns=None, http_endpoint_trusted: bool = False,
                connect=hub_client.connect) -> dict:
    """{"commit", "files", "source"}: the target's files after allow/ignore patterns, each
    ``{"path", "size", "etag"}`` (``etag``: the name its blob gets in the cache).

    A pinned commit with a cached tree listing needs no network (source ``tree_cache``);
    otherwise hub_client resolves the revision (one request) and lists the commit (the tree cache
    first, else one request: source ``hub``). Every failure is a PlanError.
    """
    roots = (hub_client.tree_root(cache_dir, repo_id),) if cache_dir else ()
    listing = None
    commit = revision if hub_client.is_commit(revision) else None
    try:
        if commit:   # a branch may have moved on the Hub: only a pinned commit is trusted offline
            cached = hub_client.cached_listing(roots, repo_id, commit)
            if cached is not None:
                listing, source = cached[0], "tree_cache"
        if listing is None:
            hub_client.refuse_insecure(endpoint, bool(token), http_endpoint_trusted, "list %s@%s" % (repo_id, revision))
            try:
                if not hub_client.HAS_HF:
                    raise ImportError("No module named 'huggingface_hub'")
                client = connect(repo_id, endpoint=endpoint, token=token, fetching=False)
            except ImportError as exc:
                raise PlanError("listing %s@%s needs huggingface_hub on the host (%s); run the task with "
                                "a Python that has it (the vLLM virtualenv) or pass target_bytes"
                                % (repo_id, revision, exc))
            commit = client.resolve(revision)
            listing, source = client.listing(commit, roots)
        chosen = hub_client.select(listing, allow_patterns, ignore_patterns, repo_id, commit) if listing else {}
    except hub_client.HubError as exc:
        if exc.kind in ("insecure_endpoint", "bad_listing", "no_match"):
            raise PlanError(str(exc))
        raise PlanError("%s; %s" % (exc, HUB_WAY_OUT))
    return {"commit": commit, "files": hub_client.target_files(chosen), "source": source}


def given_listing(entry, listing) -> dict:
    """list_target's answer from a listing made elsewhere (hf_snapshot's ``listing``: the
    controller lists a fleet's target once): checked as a Hub listing is, the entry's patterns
    applied; PlanError when it is unusable."""
    commit = listing.get("commit") if isinstance(listing, dict) else None
    if not (isinstance(commit, str) and COMMIT_RE.match(commit) and isinstance(listing.get("files"), dict)):
        raise PlanError("the given listing of %s is not hf_snapshot's listing ({commit, files}); list the "
                        "target again" % entry["repo_id"])
    try:
        files = hub_client.trusted(listing["files"], "the given listing of %s@%s" % (entry["repo_id"], commit[:12]),
                                   "list the target again")
        chosen = hub_client.select(files, entry["allow_patterns"], entry["ignore_patterns"], entry["repo_id"], commit)
    except hub_client.HubError as exc:
        raise PlanError(str(exc))
    return {"commit": commit, "source": "given",
            "files": [{"path": path, "size": e["size"], "etag": e.get("lfs_sha256") or e["blob_id"]}
                      for path, e in chosen.items()]}
