# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Disk planning for a model swap: the plan and its verdict.

Pure logic over a scanned ``model_store.Store``: given the target's needs (target_needs), the
protections (protections) and the purge candidates (purge_items), compute the verdict with per-item
freed bytes (shared blobs counted once, via ``model_store.DeletionSimulator``), check the operator's
own candidates, and table the orphaned partial downloads. On a Xet-layout cache a payload of the
shared store counts once however many repos and revisions link it, and frees bytes only with the
step that removes its last link; payloads no link references are reclaimed with the orphaned
partial downloads (``orphans.shared``). A step that removes a model's last revision frees its
vLLM cache folder too (``compile_caches``: the purge prunes it with the model). Its inputs
(sizes, headroom, the catalog) and its errors
(PlanError, NotInStore) are plan_inputs'.

Used by the disk_plan module (through fleet/store_context); unit-tested table-driven.
"""
from __future__ import annotations

import os

from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_locks
from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import repo_folder_name
from ansible_collections.modelswap.vllm.plugins.module_utils.store.model_store import DeletionSimulator, Item, SharedPayload, human_bytes
from ansible_collections.modelswap.vllm.plugins.module_utils.store.plan_inputs import NotInStore, PlanError
from ansible_collections.modelswap.vllm.plugins.module_utils.store.protections import protecting
from ansible_collections.modelswap.vllm.plugins.module_utils.store.purge_items import (
    all_candidates,
    item_device,
    item_dict,
    item_last_used,
    order_lru,
    reused_bytes,
    resolve_item,
)

VERDICTS = ("fits", "fits_after_purge", "does_not_fit")


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


def freed(sim, item, compile_caches) -> tuple:
    """(effect, compile cache bytes) of deleting ``item`` next: the simulator's effect, and the
    allocated bytes of the model's vLLM cache folder when this step removes the model's last
    revision (0 otherwise, and for a folder already counted)."""
    effect = sim.apply(item)
    cache = 0
    if effect.removes_repo and compile_caches:
        cache = compile_caches.pop(item.folder, 0)
    return effect, cache


def make_plan(store, fs: dict, *, needed_bytes: int, headroom_bytes: int, candidates,
              orphans=(), served_items=(), served_label: str = "", target_label: str = "",
              allow_served_purge: bool = False, download_rate: int = 0, models=None,
              compile_caches=None) -> dict:
    """The verdict and the purge proposal.

    ``candidates`` are Items in purge order; ``orphans`` are reclaimable partial downloads
    (Orphan, and SharedPayload no link references), always reclaimed first; ``served_items`` are what purging the served model would
    delete — considered only when nothing else makes room, and proposed only if allowed.
    ``compile_caches`` maps a repo folder to its vLLM cache folder's allocated bytes on the
    store's file system; a step that removes the repo frees those too: a row's
    ``compile_cache_bytes`` beside its ``bytes`` (the store's), both in ``cumulative_bytes`` and the
    verdict, and ``purge_compile_cache_bytes`` beside ``purge_bytes`` (what model_purge deletes).
    """
    available = fs["available"]
    required = needed_bytes + headroom_bytes
    sim = DeletionSimulator(store)
    caches = dict(compile_caches or {})
    orphan_bytes = 0
    for o in orphans:
        orphan_bytes += sim.apply(reclaim_item(o)).bytes
    table = []
    cumulative = orphan_bytes
    cut = None
    if available + orphan_bytes >= required:
        cut = 0
    for index, item in enumerate(candidates):
        effect, cache = freed(sim, item, caches)
        cumulative += effect.bytes + cache
        row = item_dict(store, item, models)
        row.update({"order": index + 1, "bytes": effect.bytes, "size": effect.size,
                    "compile_cache_bytes": cache,
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
        "purge_compile_cache_bytes": 0,
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
        caches_freed = sum(r["compile_cache_bytes"] for r in table[:cut])
        result.update(verdict="fits_after_purge", purge=[r["item"] for r in table[:cut]],
                      purge_bytes=(table[cut - 1]["cumulative_bytes"] if cut else orphan_bytes) - caches_freed,
                      purge_compile_cache_bytes=caches_freed,
                      purge_orphans=bool(orphans),
                      reason="purging %d item(s)%s frees enough" % (
                          cut, " and the orphaned partial downloads" if orphans else ""))
        return result
    shortfall = required - (available + all_bytes)
    result.update(verdict="does_not_fit", shortfall_bytes=shortfall, purge_orphans=bool(orphans))
    served_bytes = 0
    for item in served_items:
        effect, cache = freed(sim, item, caches)
        served_bytes += effect.bytes + cache
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
            sim2, caches2 = DeletionSimulator(store), dict(compile_caches or {})
            gained = sum(sim2.apply(reclaim_item(o)).bytes for o in orphans)
            caches_freed = 0
            for item in served_items:
                effect, cache = freed(sim2, item, caches2)
                gained, caches_freed = gained + effect.bytes, caches_freed + cache
            chosen = []
            for item in candidates:
                if available + gained + caches_freed >= required:
                    break
                effect, cache = freed(sim2, item, caches2)
                gained, caches_freed = gained + effect.bytes, caches_freed + cache
                chosen.append(item.ident)
            result.update(verdict="fits_after_purge", shortfall_bytes=0, downtime=True,
                          purge=chosen + [i.ident for i in served_items], purge_bytes=gained,
                          purge_compile_cache_bytes=caches_freed,
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
        caches = plan.get("purge_compile_cache_bytes") or 0
        parts.append("purge %s%s: %s" % (human_bytes(plan["purge_bytes"]),
                                         " (+%s of their vLLM caches)" % human_bytes(caches) if caches else "",
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
# the whole plan (disk_plan's logic: the module reads the host, this decides)
# --------------------------------------------------------------------------------------------
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
              orphan_in_use, compile_caches=None) -> dict:
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
        allow_served_purge=allow_served_purge, download_rate=download_rate, models=models,
        compile_caches=compile_caches)
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
        purge_compile_cache_bytes=plan["purge_compile_cache_bytes"],
        purge_orphans=plan["purge_orphans"],
        protected=[pr.as_dict() for pr in protections],
        excluded=excluded,
        served=state["served"],
        served_purge=plan["served_purge"],
        downtime=plan["downtime"],
        compile_caches={"bytes": sum((compile_caches or {}).values()), "folders": len(compile_caches or {})},
        store={"cache_dir": store.cache_dir, "models_dir": store.models_dir, "repos": len(store.repos),
               "revisions": sum(len(r.revisions) for r in store.repos.values()),
               "dirs": len(store.dirs), "warnings": store.warnings[:20],
               "shared_payloads": len(store.shared), "shared_bytes": sum(sp.size for sp in store.shared.values())},
    )
