# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Store items and purge candidates: an operator's string or a path as an Item, what an operator
reads about one (its catalog names), when it was last used and on which device, the bytes of the
target it would delete, and every unprotected candidate in least-recently-used order."""
from __future__ import annotations

import os
import re

from ansible_collections.modelswap.vllm.plugins.module_utils.common.catalog import DEFAULT_REVISION
from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import (
    COMMIT_RE, StoreError, is_within, parse_repo_folder, repo_folder_name, validate_repo_id)
from ansible_collections.modelswap.vllm.plugins.module_utils.store.model_store import DeletionSimulator, Item, human_bytes
from ansible_collections.modelswap.vllm.plugins.module_utils.store.plan_inputs import NotInStore, PlanError, catalog_entry
from ansible_collections.modelswap.vllm.plugins.module_utils.store.protections import protecting


def _split_type(text: str):
    for prefix, rtype in (("dataset:", "dataset"), ("space:", "space"), ("kernel:", "kernel"),
                          ("model:", "model")):
        if text.startswith(prefix):
            return rtype, text[len(prefix):]
    return "model", text


def item_for_path(store, path: str) -> Item:
    """An absolute path inside the store -> the item it is (a repo, a snapshot, a model dir)."""
    path = os.path.normpath(path)
    if store.cache_dir and is_within(path, store.cache_dir) and path != store.cache_dir:
        parts = os.path.relpath(path, store.cache_dir).split(os.sep)
        if parse_repo_folder(parts[0]) and (len(parts) == 1 or (len(parts) == 3 and parts[1] == "snapshots")):
            folder = parts[0]
            if folder not in store.repos:
                raise NotInStore("%s is not in the cache %s" % (path, store.cache_dir))
            if len(parts) == 1:
                return Item("repo", folder=folder, path=path)
            if parts[2] not in store.repos[folder].revisions:
                raise NotInStore("%s is not a cached revision" % path)
            return Item("revision", folder=folder, commit=parts[2], path=path)
        raise PlanError("%s is not a purgeable item: name a repo folder (%s/models--org--name), one of "
                        "its snapshots/<commit> folders, or a repo id" % (path, store.cache_dir))
    if store.models_dir and is_within(path, store.models_dir) and path != store.models_dir:
        parts = os.path.relpath(path, store.models_dir).split(os.sep)
        if len(parts) != 1:
            raise PlanError("%s is not a purgeable item: only whole model directories directly under "
                            "%s can be purged" % (path, store.models_dir))
        if parts[0] not in store.dirs:
            raise NotInStore("%s is not in the models folder %s" % (path, store.models_dir))
        return Item("dir", name=parts[0], path=path)
    raise PlanError("%s is outside the model store (%s)" % (
        path, ", ".join(p for p in (store.cache_dir, store.models_dir) if p)))


def _remains(folder: str, repo) -> Item:
    """A repo folder with no revision left (the blobs an interrupted or refused delete left behind,
    its snapshot gone): nothing of it can serve, so naming any revision of it purges the folder."""
    return Item("repo", folder=folder, path=repo.path)


def resolve_item(store, text: str, models=None) -> Item:
    """An operator's string -> an Item. Accepts a catalog name, ``[type:]org/name[@commit|@ref]``,
    a plain model directory name, or an absolute path. Raises NotInStore or PlanError."""
    if not isinstance(text, str) or not text.strip():
        raise PlanError("item %r is empty: name a catalog model, a repo id, a directory or a path" % (text,))
    text = text.strip()
    if os.path.isabs(text):
        return item_for_path(store, text)
    if isinstance(models, dict) and text in models:
        entry = catalog_entry(models, text, "purge item")
        folder = repo_folder_name(entry["repo_id"])
        repo = store.repos.get(folder)
        commit = repo.commit_for(entry["revision"]) if repo else None
        if not commit and repo is not None and not repo.revisions:
            return _remains(folder, repo)
        if not commit:
            raise NotInStore("catalog model %r (%s@%s) is not in the cache" % (
                text, entry["repo_id"], entry["revision"]))
        return Item("revision", folder=folder, commit=commit, path=repo.revisions[commit].path)
    rtype, rest = _split_type(text)
    repo_id, _unused, revision = rest.partition("@")
    try:
        validate_repo_id(repo_id)
    except StoreError as exc:
        raise PlanError("item %r: %s" % (text, exc))
    folder = repo_folder_name(repo_id, rtype)
    repo = store.repos.get(folder)
    is_dir = "/" not in repo_id and not revision and rtype == "model" and repo_id in store.dirs
    if is_dir and repo is not None:
        raise PlanError("item %r is ambiguous: both a cached repo and a directory in %s; write the "
                        "directory's absolute path or 'model:%s'" % (text, store.models_dir, text))
    if is_dir:
        d = store.dirs[repo_id]
        return Item("dir", name=repo_id, path=d.path)
    if repo is None:
        raise NotInStore("%r is not in the model store (no %s in %s)" % (
            text, folder, store.cache_dir or "any hub cache"))
    if not revision:
        return Item("repo", folder=folder, path=repo.path)
    commit = repo.commit_for(revision)
    if not commit and not repo.revisions:
        return _remains(folder, repo)
    if not commit:
        if not COMMIT_RE.match(revision) and not re.match(r"^[\w.\-/]+\Z", revision):
            raise PlanError("item %r: revision %r is neither a commit hash nor a ref name" % (text, revision))
        raise NotInStore("%r is not in the model store (revision %s of %s is not cached)" % (
            text, revision, repo_id))
    return Item("revision", folder=folder, commit=commit, path=repo.revisions[commit].path)


def item_dict(store, item: Item, models=None) -> dict:
    """What an operator reads about an item."""
    d = {"item": item.ident, "kind": item.kind}
    if item.kind in ("repo", "revision"):
        repo = store.repos[item.folder]
        d["repo_id"] = repo.repo_id
        d["path"] = repo.path if item.kind == "repo" else repo.revisions[item.commit].path
        if item.kind == "revision":
            d["revision"] = item.commit
            d["refs"] = sorted(repo.revisions[item.commit].refs)
        else:
            d["revisions"] = sorted(repo.revisions)
        names = catalog_names(models, repo.repo_id,
                              [item.commit] if item.kind == "revision" else list(repo.revisions), repo)
        if names:
            d["models"] = names
    elif item.kind == "dir":
        d["path"] = store.dirs[item.name].path
    else:
        d["path"] = item.path
    return d


def catalog_names(models, repo_id: str, commits, repo=None) -> list:
    if not isinstance(models, dict):
        return []
    out = []
    for name, entry in models.items():
        if not isinstance(entry, dict) or entry.get("repo_id") != repo_id:
            continue
        rev = str(entry.get("revision") or DEFAULT_REVISION)
        commit = repo.commit_for(rev) if repo is not None else (rev if COMMIT_RE.match(rev) else None)
        if commit in commits:
            out.append(name)
    return sorted(out)


def item_last_used(store, item: Item) -> float:
    if item.kind == "repo":
        return store.repos[item.folder].last_used
    if item.kind == "revision":
        repo = store.repos[item.folder]
        rev = repo.revisions[item.commit]
        return max((repo.blobs[n].atime for n in rev.blobs if n in repo.blobs), default=0.0)
    if item.kind == "dir":
        return store.dirs[item.name].last_used
    return 0.0


def item_device(store, item: Item):
    if item.kind == "dir":
        parts = store.dirs[item.name].parts
    else:
        parts = store.repos[item.folder].parts
    keys = parts.get(("rest",)) or []
    return keys[0][0] if keys else None


def reused_bytes(store, item: Item, reuse) -> int:
    """Bytes of blobs the target reuses that purging ``item`` would delete (0 when none).

    ``reuse`` is (repo folder, blob names of the target's files). Deleting the last cached
    revision of the target's repo deletes blobs the target would otherwise not download again.
    """
    if not reuse or item.kind not in ("repo", "revision") or item.folder != reuse[0]:
        return 0
    effect = DeletionSimulator(store).apply(item)
    repo = store.repos[item.folder]
    return sum(repo.blobs[n].size for n in effect.blobs & set(reuse[1]) if n in repo.blobs)


def all_candidates(store, protections, device=None, reuse=None):
    """Every unprotected item on ``device``: (items, excluded) where excluded says why not.

    ``reuse`` (see reused_bytes) excludes items whose purge would delete what the target reuses.
    """
    items, excluded = [], []

    def consider(item):
        lost = reused_bytes(store, item, reuse)
        if lost:
            excluded.append({"item": item.ident, "why": "it holds %s of blobs the target reuses (they "
                                                        "would be downloaded again)" % human_bytes(lost),
                             "rule": "target"})
        else:
            items.append(item)

    for folder in sorted(store.repos):
        repo = store.repos[folder]
        whole = Item("repo", folder=folder, path=repo.path)
        if device is not None and item_device(store, whole) != device:
            excluded.append({"item": whole.ident, "why": "on another file system than the target"})
            continue
        guard = protecting(whole, protections)
        if guard is None:
            consider(whole)
            continue
        for commit in sorted(repo.revisions):
            rev_item = Item("revision", folder=folder, commit=commit, path=repo.revisions[commit].path)
            p = protecting(rev_item, protections)
            if p is None:
                consider(rev_item)
            else:
                excluded.append({"item": rev_item.ident, "why": "protected: %s" % p.label, "rule": p.rule})
        if not repo.revisions:
            excluded.append({"item": whole.ident, "why": "protected: %s" % guard.label, "rule": guard.rule})
    for name in sorted(store.dirs):
        d = store.dirs[name]
        item = Item("dir", name=name, path=d.path)
        if d.is_link:
            excluded.append({"item": item.ident, "why": "a symlink, not a model directory"})
            continue
        if device is not None and item_device(store, item) != device:
            excluded.append({"item": item.ident, "why": "on another file system than the target"})
            continue
        p = protecting(item, protections)
        if p is None:
            items.append(item)
        else:
            excluded.append({"item": item.ident, "why": "protected: %s" % p.label, "rule": p.rule})
    return items, excluded


def order_lru(store, items) -> list:
    """Least recently used first (ties by id), what an operator expects a cache to evict."""
    return sorted(items, key=lambda i: (item_last_used(store, i), i.ident))
