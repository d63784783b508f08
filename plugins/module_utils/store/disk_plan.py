# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Disk planning for a model swap: what the target needs, what may go, and whether it fits.

Pure logic over a scanned ``model_store.Store``: parse sizes and headroom, read the model catalog,
build the protections (served model, target, keep list), turn operator strings into store items,
list and order purge candidates, and compute the verdict with per-item freed bytes (shared blobs
counted once, via ``model_store.DeletionSimulator``). On a Xet-layout cache a payload of the shared
store counts once however many repos and revisions link it, and frees bytes only with the step that
removes its last link; payloads no link references are reclaimed with the orphaned partial
downloads (``orphans.shared``).

Used by the disk_plan and model_purge modules; unit-tested table-driven.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog
from ansible_collections.modelswap.vllm.plugins.module_utils.common.catalog import DEFAULT_REVISION
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_locks
from ansible_collections.modelswap.vllm.plugins.module_utils.store.model_store import (
    COMMIT_RE,
    DeletionSimulator,
    Item,
    SharedPayload,
    StoreError,
    human_bytes,
    is_within,
    parse_repo_folder,
    repo_folder_name,
    round_up,
    validate_repo_id,
)

VERDICTS = ("fits", "fits_after_purge", "does_not_fit")


class PlanError(Exception):
    """Bad input or a plan that cannot be made; the message names object, cause and fix."""


class NotInStore(PlanError):
    """An item that names nothing in the store."""


# --------------------------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------------------------
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "m": 1024 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gib": 1024 ** 3,
    "t": 1024 ** 4, "tib": 1024 ** 4, "p": 1024 ** 5, "pib": 1024 ** 5,
    "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4, "pb": 1000 ** 5,
}
_SIZE_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, what: str = "size") -> int:
    """'10GiB'/'10G' (binary), '10GB' (decimal), '1048576' or an int -> bytes; >= 0."""
    if isinstance(value, bool):
        raise PlanError("%s %r is not a size" % (what, value))
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise PlanError("%s %r is not a size: use bytes or a number with K/M/G/T (binary, also "
                            "KiB/MiB/GiB/TiB) or KB/MB/GB/TB (decimal)" % (what, value))
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise PlanError("%s %r is negative: it must be zero or more" % (what, value))
    return int(number * _UNITS[unit])


def parse_headroom(value, fs_total: int) -> int:
    """Headroom as bytes: '5%' is 5 % of the file system's size, else a size (see parse_bytes)."""
    text = str(value).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise PlanError("headroom %r is not a percentage like '5%%'" % (value,))
        if pct < 0:
            raise PlanError("headroom %r is negative: it must be between 0%% and 100%%" % (value,))
        if pct > 100:
            raise PlanError("headroom %r is over 100%% of the file system" % (value,))
        return int(fs_total * pct / 100.0)
    return parse_bytes(value, "headroom")


# --------------------------------------------------------------------------------------------
# catalog
# --------------------------------------------------------------------------------------------
def catalog_entry(models, name: str, role: str) -> dict:
    """The catalog entry ``name`` (validated); ``role`` says where the name came from."""
    if not isinstance(models, dict) or not models:
        raise PlanError("%s %r cannot be looked up: the model catalog (modelswap_models) is empty "
                        "or not a mapping" % (role, name))
    if name not in models:
        raise PlanError("unknown model name %r (%s): the catalog has %s; add it to modelswap_models "
                        "or fix the name" % (name, role, ", ".join(sorted(map(str, models)))))
    problems = entry_problems(name, models[name])
    if problems:
        raise PlanError("; ".join(problems))
    entry = models[name]
    return {
        "name": name,
        "repo_id": entry["repo_id"],
        "revision": str(entry.get("revision") or DEFAULT_REVISION),
        "allow_patterns": list(entry.get("allow_patterns") or []) or None,
        "ignore_patterns": list(entry.get("ignore_patterns") or []) or None,
    }


def entry_problems(name: str, entry) -> list:
    """What is wrong with one catalog entry (empty when valid): the catalog's own rules, the
    same the swap applies, so the plan never counts a target the deploy would refuse."""
    if not isinstance(entry, dict):
        return ["catalog entry %r is not a mapping" % name]
    return ["catalog entry %r: %s" % (name, problem) for problem in catalog.entry_problems(name, entry)]


# --------------------------------------------------------------------------------------------
# protections
# --------------------------------------------------------------------------------------------
@dataclass
class Protection:
    rule: str            # served | target | keep | path
    label: str           # human words: "the served model 'x' (deployment record /p)"
    folder: str = ""     # a cache repo folder ...
    commit: str = ""     # ... and one revision of it ("" = every revision)
    dir_name: str = ""   # a plain model directory
    path: str = ""       # a path that is neither (outside the store)

    def as_dict(self) -> dict:
        d = {"rule": self.rule, "what": self.label}
        if self.folder:
            rtype, repo_id = parse_repo_folder(self.folder)
            d["repo_id"] = repo_id
            d["revision"] = self.commit or "*"
        if self.dir_name or self.path:
            d["path"] = self.path
        return d


def protect_model(store, repo_id: str, revision: str, rule: str, label: str,
                  repo_type: str = "model") -> Protection:
    """Protect one revision of a repo (every revision when it cannot be pinned to a commit)."""
    folder = repo_folder_name(repo_id, repo_type)
    commit = revision if revision and COMMIT_RE.match(revision) else ""
    if not commit and revision:
        repo = store.repos.get(folder)
        commit = (repo.commit_for(revision) if repo else None) or ""
    return Protection(rule=rule, label=label, folder=folder, commit=commit)


def protect_path(store, path: str, rule: str, label: str) -> Protection:
    """Protect what a path points into: a snapshot, a repo, a plain model dir, or the path itself."""
    real = os.path.realpath(path)
    if store.cache_dir and is_within(real, store.cache_dir) and real != store.cache_dir:
        parts = os.path.relpath(real, store.cache_dir).split(os.sep)
        if parse_repo_folder(parts[0]):
            commit = parts[2] if len(parts) >= 3 and parts[1] == "snapshots" else ""
            return Protection(rule=rule, label=label, folder=parts[0], commit=commit, path=real)
    if store.models_dir and is_within(real, store.models_dir) and real != store.models_dir:
        name = os.path.relpath(real, store.models_dir).split(os.sep)[0]
        return Protection(rule=rule, label=label, dir_name=name, path=real)
    return Protection(rule=rule, label=label, path=real)


def protect_model_ref(store, ref: str, rule: str, label: str) -> Protection:
    """A vLLM model argument: a path, or a repo id (then every cached revision of it)."""
    if os.path.isabs(ref) or ref.startswith("."):
        return protect_path(store, ref, rule, label)
    try:
        validate_repo_id(ref)
    except StoreError:
        return Protection(rule=rule, label=label, path=ref)
    return Protection(rule=rule, label=label, folder=repo_folder_name(ref))


def protecting(item: Item, protections) -> Protection | None:
    """The first protection that covers ``item`` (None when it may go)."""
    for p in protections:
        if item.kind == "repo" and p.folder == item.folder:
            return p
        if item.kind == "revision" and p.folder == item.folder and p.commit in ("", item.commit):
            return p
        if item.kind == "dir":
            if p.dir_name == item.name:
                return p
            if p.path and (is_within(p.path, item.path) or is_within(item.path, p.path)):
                return p
    return None


# --------------------------------------------------------------------------------------------
# items
# --------------------------------------------------------------------------------------------
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
    repo_id, _, revision = rest.partition("@")
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


# --------------------------------------------------------------------------------------------
# target
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------
def duration_words(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 90:
        return "%d s" % seconds
    if seconds < 5400:
        return "%d min" % round(seconds / 60.0)
    return "%.1f h" % (seconds / 3600.0)


def reclaim_item(orphan) -> Item:
    """The Item that reclaims ``orphan``: an orphaned partial download (model_store.Orphan) or a
    shared-store payload no link references (model_store.SharedPayload)."""
    if isinstance(orphan, SharedPayload):
        return Item("payload", path=orphan.path)
    return Item("orphan", folder=orphan.folder, path=orphan.path)


def shared_table(store, device) -> tuple:
    """([row], [reclaimable SharedPayload]): the payloads of the shared (Xet) store that no link
    of the cache references, each with its allocated bytes (payload, .refs, .lock); reclaimable
    when on the target's file system."""
    rows, reclaimable = [], []
    for sp in store.unreferenced_payloads():
        size = sum(store.inodes[k][0] for k in sp.keys)
        rows.append({"path": sp.path, "bytes": size, "size": sp.size})
        if sp.keys and sp.keys[0][0] == device:
            reclaimable.append(sp)
    return rows, reclaimable


def make_plan(store, fs: dict, *, needed_bytes: int, headroom_bytes: int, candidates,
              orphans=(), served_items=(), served_label: str = "", target_label: str = "",
              allow_served_purge: bool = False, download_rate: int = 0, models=None) -> dict:
    """The verdict and the purge proposal.

    ``candidates`` are Items in purge order; ``orphans`` are reclaimable partial downloads
    (Orphan, and SharedPayload no link references), always reclaimed first; ``served_items`` are what purging the served model would
    delete — considered only when nothing else makes room, and proposed only if allowed.
    """
    available = fs["available"]
    required = needed_bytes + headroom_bytes
    sim = DeletionSimulator(store)
    orphan_bytes = 0
    for o in orphans:
        orphan_bytes += sim.apply(reclaim_item(o)).bytes
    table = []
    cumulative = orphan_bytes
    cut = None
    if available + orphan_bytes >= required:
        cut = 0
    for index, item in enumerate(candidates):
        effect = sim.apply(item)
        cumulative += effect.bytes
        row = item_dict(store, item, models)
        row.update({"order": index + 1, "bytes": effect.bytes, "size": effect.size,
                    "cumulative_bytes": cumulative, "last_used": item_last_used(store, item)})
        if effect.removes_repo and item.kind == "revision":
            row["removes_repo"] = True
        table.append(row)
        if cut is None and available + cumulative >= required:
            cut = index + 1
    all_bytes = cumulative
    result = {
        "available_bytes": available,
        "required_bytes": required,
        "needed_bytes": needed_bytes,
        "headroom_bytes": headroom_bytes,
        "orphan_bytes": orphan_bytes,
        "candidates": table,
        "candidates_bytes": all_bytes - orphan_bytes,
        "purge": [],
        "purge_bytes": 0,
        "purge_orphans": False,
        "shortfall_bytes": 0,
        "downtime": False,
        "served_purge": None,
        "reason": "",
    }
    if available >= required:
        result.update(verdict="fits", reason="free space covers the target and the headroom")
        return result
    if cut is not None:
        result.update(verdict="fits_after_purge", purge=[r["item"] for r in table[:cut]],
                      purge_bytes=(table[cut - 1]["cumulative_bytes"] if cut else orphan_bytes),
                      purge_orphans=bool(orphans),
                      reason="purging %d item(s)%s frees enough" % (
                          cut, " and the orphaned partial downloads" if orphans else ""))
        return result
    shortfall = required - (available + all_bytes)
    result.update(verdict="does_not_fit", shortfall_bytes=shortfall, purge_orphans=bool(orphans))
    served_bytes = 0
    for item in served_items:
        served_bytes += sim.apply(item).bytes
    if served_items and served_bytes >= shortfall:
        # Only purging the served model makes room: never proposed silently.
        eta = ""
        if download_rate:
            eta = ", about %s at %s/s" % (
                duration_words(needed_bytes / float(download_rate)), human_bytes(download_rate))
        downtime = ("serving stops when %s is purged and stays down until %s is downloaded (%s%s) "
                    "and started" % (served_label or "the served model", target_label or "the target",
                                     human_bytes(needed_bytes), eta))
        result["served_purge"] = {
            "items": [i.ident for i in served_items],
            "bytes": served_bytes,
            "would_fit": True,
            "downtime": downtime,
            "estimated_downtime_seconds": (int(needed_bytes / float(download_rate))
                                           if download_rate else None),
        }
        if allow_served_purge:
            # minimal: orphans, the served model, then candidates until it fits
            sim2 = DeletionSimulator(store)
            gained = sum(sim2.apply(reclaim_item(o)).bytes for o in orphans)
            gained += sum(sim2.apply(i).bytes for i in served_items)
            chosen = []
            for item in candidates:
                if available + gained >= required:
                    break
                gained += sim2.apply(item).bytes
                chosen.append(item.ident)
            result.update(verdict="fits_after_purge", shortfall_bytes=0, downtime=True,
                          purge=chosen + [i.ident for i in served_items], purge_bytes=gained,
                          reason="fits only by purging the served model (allowed): " + downtime)
        else:
            result["reason"] = ("only purging the served model %s (%s) would make room: %s; allow that "
                                "downtime explicitly (allow_served_purge) or free space elsewhere"
                                % (served_label, human_bytes(served_bytes), downtime))
    else:
        result["reason"] = ("short by %s even after purging every allowed candidate%s" % (
            human_bytes(shortfall), " and the served model" if served_items else ""))
    return result


def summary_line(plan: dict) -> str:
    """One line for humans: free, needed, to purge, verdict."""
    parts = ["free %s" % human_bytes(plan["available_bytes"]),
             "needed %s (+%s headroom)" % (human_bytes(plan["needed_bytes"]),
                                           human_bytes(plan["headroom_bytes"]))]
    if plan["purge"] or plan["purge_orphans"]:
        parts.append("purge %s: %s" % (human_bytes(plan["purge_bytes"]),
                                       ", ".join(plan["purge"] + (["partial downloads"]
                                                                  if plan["purge_orphans"] else []))))
    verdict = plan["verdict"]
    if verdict == "does_not_fit":
        verdict += " (short by %s)" % human_bytes(plan["shortfall_bytes"])
        if plan.get("served_purge"):
            verdict += "; only purging the served model would make room (downtime)"
    elif plan.get("downtime"):
        verdict += " (with downtime: the served model is purged)"
    parts.append(verdict)
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# what must not go: served model, target, keep list
# --------------------------------------------------------------------------------------------
def items_protected_by(store, protection: Protection) -> list:
    """The store items a protection covers (what purging that model would delete)."""
    if protection.folder:
        repo = store.repos.get(protection.folder)
        if repo is None:
            return []
        if protection.commit:
            rev = repo.revisions.get(protection.commit)
            return [Item("revision", folder=repo.folder, commit=rev.commit, path=rev.path)] if rev else []
        return [Item("repo", folder=repo.folder, path=repo.path)]
    if protection.dir_name and protection.dir_name in store.dirs:
        d = store.dirs[protection.dir_name]
        return [Item("dir", name=d.name, path=d.path)]
    return []


def build_protections(store, *, models=None, target=None, target_commit: str = "", keep=(),
                      served=None, record=None, record_path: str = "", unit=None,
                      unit_name: str = "", protect_paths=(), processes=()) -> dict:
    """Protections and the served model, from the catalog names and what the host says.

    ``record`` is the deployment record (dict or None), ``unit`` what served_model.served_from_unit
    returned (or None), ``processes`` the running vLLM servers (served_model.served_by_processes).
    Unknown catalog names raise PlanError.
    """
    protections = []
    served_prot = []
    served_info = {"name": None, "repo_id": None, "commit": None, "path": None, "sources": [],
                   "unit_active": unit.get("active") if unit else False}
    if served:
        entry = catalog_entry(models, served, "served")
        label = "the served model %r (served option)" % served
        served_prot.append(protect_model(store, entry["repo_id"], entry["revision"], "served", label))
        served_info.update(name=served, repo_id=entry["repo_id"], commit=served_prot[-1].commit or None)
        served_info["sources"].append("option")
    if record:
        name = record.get("model")
        label = "the served model %r (deployment record %s)" % (name or record.get("repo_id"), record_path)
        if record.get("repo_id"):
            try:
                validate_repo_id(record["repo_id"])
            except StoreError as exc:
                raise PlanError("the deployment record %s: %s; fix the record" % (record_path, exc))
            served_prot.append(protect_model(store, record["repo_id"], record.get("commit") or "",
                                             "served", label))
        if record.get("path"):
            served_prot.append(protect_path(store, record["path"], "served", label))
        served_info.update({k: served_info[k] or record.get(k) for k in ("repo_id", "commit", "path")})
        served_info["name"] = served_info["name"] or name
        served_info["sources"].append("deployment_record")
    if unit and unit.get("model"):
        label = "the model of unit %s (%s, ExecStart)" % (unit_name, unit.get("unit_state"))
        p = protect_model_ref(store, unit["model"], "served", label)
        served_prot.append(p)
        served_info["path"] = served_info["path"] or unit["model"]
        served_info["sources"].append("unit")
    running = []
    for proc in processes or ():
        label = "the model of the running vLLM server, PID %s" % proc["pid"]
        running.append(protect_model_ref(store, proc["model"], "served", label))
        served_prot.append(running[-1])
        served_info["path"] = served_info["path"] or proc["model"]
        if "process" not in served_info["sources"]:
            served_info["sources"].append("process")
    protections.extend(served_prot)
    target_info = None
    if target:
        entry = catalog_entry(models, target, "target")
        commit = target_commit or entry["revision"]
        protections.append(protect_model(store, entry["repo_id"], commit, "target",
                                         "the target model %r" % target))
        target_info = entry
    for name in keep or ():
        entry = catalog_entry(models, name, "keep")
        protections.append(protect_model(store, entry["repo_id"], entry["revision"], "keep",
                                         "model %r of the keep list" % name))
    for path in protect_paths or ():
        protections.append(protect_path(store, path, "path", "protected path %s" % path))
    served_items = []
    for p in served_prot:
        for item in items_protected_by(store, p):
            if item not in served_items:
                served_items.append(item)
    # A served model that is also the target or kept is not "the served model's" to purge.
    others = [p for p in protections if p.rule != "served"]
    served_items = [i for i in served_items if protecting(i, others) is None]
    served_label = repr(served_info["name"] or served_info["repo_id"] or served_info["path"] or "?")
    return {"protections": protections, "served_items": served_items, "served": served_info,
            "served_label": served_label, "target": target_info, "running": running}


# --------------------------------------------------------------------------------------------
# the whole plan (disk_plan's logic: the module reads the host, this decides)
# --------------------------------------------------------------------------------------------
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


def chosen_candidates(store, texts, *, models, protections, served_items, allow_served_purge: bool,
                      reuse, device, target_name) -> tuple:
    """The operator's candidates as store items, each checked, and the ``excluded`` rows of catalog
    models that are not in the store (a rerun after they went: nothing left to purge of them);
    PlanError naming the first bad one."""
    items, absent = [], []
    for text in texts:
        try:
            item = resolve_item(store, text, models)
        except NotInStore as exc:
            if isinstance(models, dict) and text in models:
                absent.append({"item": text, "why": "%s: nothing to purge" % exc, "rule": "absent"})
                continue
            raise PlanError("candidate %s; remove it from candidates (nothing was changed)" % exc)
        except PlanError as exc:
            raise PlanError("candidate %r: %s" % (text, exc))
        if item.kind == "dir" and store.dirs[item.name].is_link:
            raise PlanError("candidate %r is a symlink (to %s), not a model directory, and model_purge refuses "
                            "it; name the directory itself or remove it from candidates"
                            % (text, os.readlink(item.path)))
        guard = protecting(item, protections)
        if guard is not None and not (guard.rule == "served" and allow_served_purge and item in served_items):
            raise PlanError("candidate %r is protected: it is %s (rule: %s); remove it from candidates"
                            % (text, guard.label, guard.rule))
        lost = reused_bytes(store, item, reuse)
        if lost:
            raise PlanError("candidate %r holds %s of blobs the target %r reuses: purging it means downloading "
                            "them again; remove it from candidates" % (text, human_bytes(lost), target_name))
        if item_device(store, item) != device:
            raise PlanError("candidate %r is on another file system than the target: purging it frees no "
                            "room; remove it from candidates" % text)
        if item not in items:
            items.append(item)
    return items, absent


def orphan_table(store, device, in_use) -> tuple:
    """([row], [reclaimable orphan]): every orphaned partial download, ``in_use(orphan)`` saying
    whether a download may still hold it; only those on the target's file system can be reclaimed."""
    rows, reclaimable = [], []
    for orphan in store.orphans:
        busy = in_use(orphan)
        rows.append({"path": orphan.path, "repo_id": store.repos[orphan.folder].repo_id,
                     "bytes": orphan.bytes, "size": orphan.size, "state": "in_use" if busy else "reclaimable"})
        if not busy and item_device(store, Item("repo", folder=orphan.folder)) == device:
            reclaimable.append(orphan)
    return rows, reclaimable


def orphan_in_use(store):
    """in_use(orphan) for orphan_table: a lock of its repo is held, or its blob's lock is not free
    (each repo's locks probed once)."""
    busy_by_repo = {}

    def in_use(orphan):
        lock_dir = store_locks.lock_dir(store.cache_dir, orphan.folder)
        if orphan.folder not in busy_by_repo:
            busy_by_repo[orphan.folder] = store_locks.busy_locks(lock_dir)
        return (bool(busy_by_repo[orphan.folder])
                or store_locks.probe(lock_dir + "/" + orphan.etag + ".lock") is not False)
    return in_use


def store_warnings(store) -> list:
    """What disk_plan warns about the scanned store: up to three problems of each damaged repo."""
    return ["disk_plan: cache repo %s: %s" % (repo.repo_id, problem)
            for repo in store.repos.values() for problem in repo.problems[:3]]


def does_not_fit_message(target_name, fs_path: str, reason: str) -> str:
    """fail_on_does_not_fit's failure."""
    return "disk_plan: %s does not fit on %s: %s" % (repr(target_name or "the target"), fs_path, reason)


def disk_plan(store, fs: dict, state: dict, *, target: dict, listed_files, candidates, models,
              headroom_bytes: int, download_rate: int, clean_orphans: bool, allow_served_purge: bool,
              orphan_in_use) -> dict:
    """disk_plan's result (less ``timings``) from what the module read: the scanned store, the
    file system, the host's state (host_state), the target (plan_target plus target_needs)."""
    protections = state["protections"]
    device = fs["device"]
    excluded = []
    reuse = None
    if target.get("repo_id") and target.get("commit") and listed_files:
        reuse = (repo_folder_name(target["repo_id"]), {f["etag"] for f in listed_files})
    if candidates is None:
        items, excluded = all_candidates(store, protections, device, reuse)
        items = order_lru(store, items)
    else:
        items, excluded = chosen_candidates(store, candidates, models=models, protections=protections,
                                            served_items=state["served_items"],
                                            allow_served_purge=allow_served_purge,
                                            reuse=reuse, device=device, target_name=target["name"])
    served_items = [i for i in state["served_items"] if i not in items]
    orphan_rows, reclaimable = orphan_table(store, device, orphan_in_use)
    shared_rows, shared_reclaimable = shared_table(store, device)
    target_label = repr(target["name"] or "the target")
    plan = make_plan(
        store, fs, needed_bytes=target["needed_bytes"], headroom_bytes=headroom_bytes, candidates=items,
        orphans=reclaimable + shared_reclaimable if clean_orphans else [], served_items=served_items,
        served_label=state["served_label"], target_label=target_label,
        allow_served_purge=allow_served_purge, download_rate=download_rate, models=models)
    return dict(
        changed=False,
        verdict=plan["verdict"],
        fits=plan["verdict"] != "does_not_fit",
        reason=plan["reason"],
        summary=summary_line(plan),
        filesystem={k: fs[k] for k in ("path", "total_bytes", "free_bytes", "available_bytes", "block_size")},
        target=target,
        headroom_bytes=headroom_bytes,
        required_bytes=plan["required_bytes"],
        shortfall_bytes=plan["shortfall_bytes"],
        orphans={"reclaimable_bytes": (sum(o.bytes for o in reclaimable)
                                       + sum(sum(store.inodes[k][0] for k in sp.keys) for sp in shared_reclaimable)),
                 "in_use_bytes": sum(r["bytes"] for r in orphan_rows if r["state"] == "in_use"),
                 "files": orphan_rows, "shared": shared_rows},
        candidates=plan["candidates"],
        purge=plan["purge"],
        purge_bytes=plan["purge_bytes"],
        purge_orphans=plan["purge_orphans"],
        protected=[pr.as_dict() for pr in protections],
        excluded=excluded,
        served=state["served"],
        served_purge=plan["served_purge"],
        downtime=plan["downtime"],
        store={"cache_dir": store.cache_dir, "models_dir": store.models_dir, "repos": len(store.repos),
               "revisions": sum(len(r.revisions) for r in store.repos.values()),
               "dirs": len(store.dirs), "warnings": store.warnings[:20],
               "shared_payloads": len(store.shared), "shared_bytes": sum(sp.size for sp in store.shared.values())},
    )
