#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_purge
short_description: Delete cached models safely, inside configured roots only
version_added: "0.1.0"
description:
  - Removes Hugging Face cache repos or single revisions with the semantics of huggingface_hub's
    C(HFCacheInfo.delete_revisions) (blobs that a remaining revision or another repo
    shares survive), and removes plain model directories.
  - The paths to delete are planned once, from the module's own scan, and deleted exactly as
    planned (through huggingface_hub's C(DeleteCacheStrategy) for healthy repos); nothing is
    derived from where a link points at delete time. With the locks held, right before deleting,
    every planned path is checked again (same inode and type, reached through no symlink, a blob
    a regular file in its repo's C(blobs) folder) and every affected repo is scanned again; if
    anything changed since the plan (a snapshot link retargeted, a planned file gone or replaced, a
    new revision or ref), the module fails naming the changes and deletes nothing.
  - Refuses, before deleting anything and with a message naming the item and the rule, the
    served model (from the deployment record, the running vLLM unit, any running vLLM server
    and O(served)), the target,
    O(keep) models, O(protect_paths), anything outside O(roots), a root itself, a path that
    leaves the roots through a symlink, and a revision whose snapshot links point outside its
    repo (huggingface_hub would delete the link targets).
  - Holds every download lock of an affected repo (C(<cache>/.locks/<repo>/*.lock), non-blocking)
    while it deletes; a repo with a live download is refused.
  - Cleans orphaned partial downloads (C(blobs/*.incomplete)) and stale lock files only in
    repos where it can take every lock, never like C(hf cache prune).
  - Check mode returns the list and the bytes that would be freed, and a diff of the store's
    contents. A real run reports the bytes actually freed, measured on the file system
    (C(statvfs)); a second run reports C(changed=false).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - modelswap.vllm.store
options:
  items:
    description:
      - What to delete. Each is a catalog name (its pinned revision), a repo id C(org/name) (every
        revision), C(org/name@<commit>), a plain directory name under O(models_dir), or an absolute
        path (a repo folder, a C(snapshots/<commit>) folder, a model directory).
      - Items are checked all together first; one refusal deletes nothing.
    type: list
    elements: str
    default: []
  roots:
    description:
      - Folders deletions must stay inside (compared after resolving symlinks). A root itself is never
        deleted. Defaults to O(cache_dir) and O(models_dir).
    type: list
    elements: path
  target:
    description:
      - Catalog name of the model being deployed; protected.
    type: str
  allow_served_purge:
    description:
      - Allow deleting the served model (downtime). Still refused while its vLLM unit runs, while
        any vLLM server process serves it, or when its state is unknown.
    type: bool
    default: false
  missing:
    description:
      - What to do with an item that is not in the store. C(ignore) reports it under RV(absent)
        (already purged, so a rerun is idempotent); C(fail) fails before deleting anything.
    type: str
    choices: [ignore, fail]
    default: ignore
  clean_orphans:
    description:
      - Delete orphaned C(*.incomplete) partial downloads in repos where no download holds a lock.
    type: bool
    default: true
  clean_stale_locks:
    description:
      - Delete lock files (and lock folders of repos no longer cached) that nobody holds.
    type: bool
    default: true
attributes:
  check_mode:
    support: full
    details: Lists what would go and the bytes it would free; touches nothing.
  diff_mode:
    support: full
    details: Before and after listings of the store (one line per revision, directory, partial file).
  platform:
    support: full
    platforms: posix
requirements:
  - huggingface_hub >= 1.0 on the host when Hugging Face cache items are deleted.
notes:
  - Set C(ansible_python_interpreter) for this task to a Python with huggingface_hub (on serving
    hosts, the vLLM virtualenv's).
  - The planned bytes are allocated bytes; on a busy file system the measured RV(freed_bytes) also
    counts what other writers did meanwhile.
seealso:
  - module: modelswap.vllm.disk_plan
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Purge what the disk plan proposed
  modelswap.vllm.model_purge:
    cache_dir: /var/lib/modelswap/hf/hub
    models: "{{ modelswap_models }}"
    target: "{{ modelswap_serve }}"
    keep: "{{ modelswap_keep }}"
    items: "{{ plan.purge }}"
    missing: fail

- name: Only clean orphaned partial downloads and stale locks
  modelswap.vllm.model_purge:
    cache_dir: /data/hf/hub
"""

RETURN = r"""
removed:
  description: What was (check mode, would be) deleted, with the bytes each frees.
  returned: always
  type: list
  elements: dict
  sample: [{"item": "org/old", "kind": "repo", "path": "/data/hf/hub/models--org--old", "bytes": 1073741824}]
absent:
  description: Items not in the store (nothing to do).
  returned: always
  type: list
  elements: str
orphans_removed:
  description: Partial downloads deleted (or to delete in check mode), with their bytes.
  returned: always
  type: list
  elements: dict
orphans_busy:
  description: Partial downloads left alone because a download holds their repo's lock.
  returned: always
  type: list
  elements: str
locks_removed:
  description: Stale lock files or lock folders deleted (or to delete).
  returned: always
  type: list
  elements: str
planned_bytes:
  description: Allocated bytes the purge frees by the plan (deletions, orphans, stale locks).
  returned: always
  type: int
expected_freed_size:
  description:
    - Apparent bytes of the cache blobs the purge deletes, counted as huggingface_hub's
      DeleteCacheStrategy.expected_freed_size counts them (a blob another revision still links is
      not counted; a shared-store payload only when its last link goes). From the plan, so check
      mode returns the same figure as the real run.
  returned: always
  type: int
changes:
  description: When the store changed between the plan and the deletion, what changed (nothing
    was deleted).
  returned: failure
  type: list
  elements: str
freed_bytes:
  description: Bytes actually freed, measured with statvfs before and after (null in check mode).
  returned: always
  type: int
diff:
  description: Store listing before and after.
  returned: when diff mode is on
  type: dict
"""

import dataclasses
import os
import shutil
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.modelswap.vllm.plugins.module_utils.store import disk_plan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_locks
from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import listed
from ansible_collections.modelswap.vllm.plugins.module_utils.store.store_context import (
    STORE_ARGS,
    host_state,
    scan,
)

try:
    from huggingface_hub import DeleteCacheStrategy
    HF_IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - exercised on hosts without the library
    DeleteCacheStrategy = None
    HF_IMPORT_ERROR = exc

ACTION = "model_purge"


def path_refusal(path: str, roots) -> str:
    """Why ``path`` may not be deleted under ``roots`` (real paths), or ''."""
    norm = os.path.normpath(path)
    real = os.path.realpath(norm)
    if not any(model_store.is_within(norm, r) or model_store.is_within(real, r) for r in roots):
        return "it is outside the roots (%s); only paths inside them can be purged" % ", ".join(roots)
    if real in roots or norm in roots:
        return "it is a root itself (%s); name an item inside it" % real
    if not any(model_store.is_within(real, r) for r in roots):
        return "it resolves through a symlink to %s, outside the roots (%s)" % (real, ", ".join(roots))
    if os.path.islink(norm):
        return "it is a symlink (to %s); name the directory itself" % os.readlink(norm)
    return ""


def lock_dirs_for(store, item):
    if item.kind == "dir":
        return os.path.join(item.path, ".cache", "huggingface", "download"), True
    return store_locks.lock_dir(store.cache_dir, item.folder), False


def folder_of(orphan_path: str) -> str:
    """<cache>/<folder>/blobs/<name>.incomplete -> <folder>."""
    return os.path.basename(os.path.dirname(os.path.dirname(orphan_path)))


def walk_alloc(path: str) -> int:
    total = 0
    seen = set()
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            try:
                st = os.lstat(name)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def free_bytes(paths) -> int:
    seen, total = set(), 0
    for path in paths:
        st = os.statvfs(path)
        dev = os.stat(path).st_dev
        if dev not in seen:
            seen.add(dev)
            total += st.f_bfree * st.f_frsize
    return total


def delete_step(store, step):
    """Delete exactly ``step``'s planned paths (model_store.delete_plan), already re-checked: a healthy
    repo's through huggingface_hub's strategy (its deletion order and shared-store cleanup), a
    damaged repo or a plain directory with rmtree."""
    if step.uses_hf:
        fields = {f.name for f in dataclasses.fields(DeleteCacheStrategy)}
        extra = {"cache_dir": Path(store.cache_dir)} if "cache_dir" in fields else {}
        DeleteCacheStrategy(
            expected_freed_size=step.expected,
            blobs=frozenset(Path(x) for x in step.paths("blob")),
            refs=frozenset(Path(x) for x in step.paths("ref")),
            repos=frozenset(Path(x) for x in step.paths("repo")),
            snapshots=frozenset(Path(x) for x in step.paths("snapshot")), **extra).execute()
        model_store.remove_metadata(step)
    else:
        shutil.rmtree(step.unlinks[0].path)
    if step.whole and step.folder:
        shutil.rmtree(store_locks.lock_dir(store.cache_dir, step.folder), ignore_errors=True)


def main():
    argument_spec = dict(STORE_ARGS)
    argument_spec.update(
        items=dict(type="list", elements="str", default=[]),
        roots=dict(type="list", elements="path"),
        missing=dict(type="str", choices=["ignore", "fail"], default="ignore"),
        clean_orphans=dict(type="bool", default=True),
        clean_stale_locks=dict(type="bool", default=True),
    )
    module = AnsibleModule(argument_spec=argument_spec, supports_check_mode=True,
                           required_one_of=[("cache_dir", "models_dir")])
    p = module.params
    store, _ = scan(module, ACTION)
    roots = []
    for root in p["roots"] or [store.cache_dir, store.models_dir]:
        if not root:
            continue
        if not os.path.isdir(root):
            module.fail_json(msg="%s: root %s is not an existing directory; fix roots (nothing was "
                                 "deleted)" % (ACTION, root))
        roots.append(os.path.realpath(root))
    state = host_state(module, store, ACTION)
    protections = state["protections"]

    # 1. resolve and judge every item; refuse before touching anything
    refused, absent, chosen = [], [], []
    for text in p["items"]:
        try:
            if isinstance(text, str) and os.path.isabs(text):
                why = path_refusal(text, roots)
                if why:
                    refused.append({"item": text, "rule": "roots", "why": why})
                    continue
                item = disk_plan.item_for_path(store, os.path.realpath(text))
            else:
                item = disk_plan.resolve_item(store, text, p["models"])
        except disk_plan.NotInStore as exc:
            if p["missing"] == "fail":
                refused.append({"item": text, "rule": "missing", "why": "%s (missing=fail)" % exc})
            else:
                absent.append(text)
            continue
        except disk_plan.PlanError as exc:
            refused.append({"item": text, "rule": "input", "why": str(exc)})
            continue
        why = path_refusal(item.path, roots)
        if why:
            refused.append({"item": text, "rule": "roots", "why": why})
            continue
        guard = disk_plan.protecting(item, protections)
        if guard is not None:
            if guard.rule == "served" and p["allow_served_purge"] and item in state["served_items"]:
                live = disk_plan.protecting(item, state["running"])
                if live is not None:
                    refused.append({"item": text, "rule": "served", "why": (
                        "it is %s; stop that server before purging the model it serves" % live.label)})
                    continue
                if state["served"]["unit_active"] is not False:
                    refused.append({"item": text, "rule": "served", "why": (
                        "it is %s and unit %s is %s; stop the service before purging the served "
                        "model" % (guard.label, p["vllm_unit"], "running" if state["served"]["unit_active"]
                                   else "in an unknown state"))})
                    continue
            else:
                refused.append({"item": text, "rule": guard.rule, "why": "it is %s" % guard.label})
                continue
        if item.kind == "revision":
            rev = store.repos[item.folder].revisions[item.commit]
            if rev.foreign_links:
                refused.append({"item": text, "rule": "roots", "why": (
                    "its snapshot links leave the repo's blobs (e.g. %s); huggingface_hub's strategy "
                    "would delete those targets; fix the links or purge the whole repo" % rev.foreign_links[0])})
                continue
        if item not in chosen:
            chosen.append(item)
    if refused:
        module.fail_json(msg="%s refused %s; nothing was deleted" % (ACTION, "; ".join(
            "%r: %s (rule: %s)" % (r["item"], r["why"], r["rule"]) for r in refused)),
            refused=refused, changed=False)

    # 2. group: a repo item covers its revisions; revisions of one repo go in one strategy
    whole = {i.folder for i in chosen if i.kind == "repo"}
    by_repo = {}
    steps = []
    for item in chosen:
        if item.kind == "repo":
            steps.append(("repo", item.folder, [item]))
        elif item.kind == "revision" and item.folder not in whole:
            if item.folder not in by_repo:
                by_repo[item.folder] = []
                steps.append(("revisions", item.folder, by_repo[item.folder]))
            by_repo[item.folder].append(item)
        elif item.kind == "dir":
            steps.append(("dir", item.name, [item]))
    sim = model_store.DeletionSimulator(store)
    removed = []
    repo_steps = []
    for kind, key, group in steps:
        if kind == "revisions":
            effect = sim.apply_revisions(key, [i.commit for i in group])
            if effect.removes_repo:
                kind = "repo"
        else:
            effect = sim.apply(group[0])
        for item in group:
            row = disk_plan.item_dict(store, item, p["models"])
            row["bytes"] = effect.bytes if item is group[0] else 0
            if effect.removes_repo and item.kind == "revision":
                row["removes_repo"] = True
            removed.append(row)
        if kind in ("repo", "revisions"):
            repo = store.repos[key]
            if repo.problems and kind == "revisions":
                module.fail_json(msg="%s refused %s: the cached repo is damaged (%s); purge the whole "
                                     "repo instead; nothing was deleted" % (ACTION, repo.repo_id, repo.problems[0]),
                                 changed=False)
            repo_steps.append((key, effect))
    plan = model_store.delete_plan(store, repo_steps, [g[0].name for k, _, g in steps if k == "dir"])

    # 3. orphans and stale locks (in repos that stay), only when the cache is inside the roots
    cache_in_roots = bool(store.cache_dir) and any(model_store.is_within(store.cache_dir, r) for r in roots)
    orphans, busy_orphans = [], []
    if p["clean_orphans"] and cache_in_roots:
        for folder in sorted(store.repos):
            if folder in sim.gone_repos:
                continue
            repo = store.repos[folder]
            if not repo.orphans:
                continue
            busy = store_locks.busy_locks(store_locks.lock_dir(store.cache_dir, folder))
            for o in repo.orphans:
                lock = os.path.join(store_locks.lock_dir(store.cache_dir, folder), o.etag + ".lock")
                if busy or store_locks.probe(lock) is not False:
                    busy_orphans.append(o.path)
                    continue
                effect = sim.apply(model_store.Item("orphan", folder=folder, path=o.path))
                orphans.append({"path": o.path, "repo_id": repo.repo_id, "bytes": effect.bytes})
    stale = []
    if p["clean_stale_locks"] and cache_in_roots:
        locks_root = os.path.join(store.cache_dir, ".locks")
        for folder in listed(locks_root):
            path = os.path.join(locks_root, folder)
            if folder in sim.gone_repos or os.path.islink(path) or not os.path.isdir(path):
                continue
            if store_locks.busy_locks(path):
                continue
            if folder not in store.repos and model_store.parse_repo_folder(folder):
                stale.append({"path": path, "bytes": walk_alloc(path), "dir": True})
                continue
            for name in sorted(os.listdir(path)):
                lock = os.path.join(path, name)
                if name.endswith(".lock") and store_locks.is_regular(lock):
                    stale.append({"path": lock, "bytes": os.lstat(lock).st_blocks * 512, "dir": False})
    planned = (sum(r["bytes"] for r in removed) + sum(o["bytes"] for o in orphans)
               + sum(s["bytes"] for s in stale))
    changed = bool(removed or orphans or stale)
    result = dict(changed=changed, removed=removed, absent=absent, orphans_removed=orphans,
                  orphans_busy=busy_orphans, locks_removed=[s["path"] for s in stale],
                  planned_bytes=planned, expected_freed_size=sum(st.expected for st in plan),
                  freed_bytes=None)
    if module._diff:
        gone = list(chosen) + [model_store.Item("orphan", folder=o.folder, path=o.path)
                               for r in store.repos.values() for o in r.orphans
                               if o.path in {x["path"] for x in orphans}]
        result["diff"] = {"before_header": "model store", "after_header": "model store",
                          "before": "\n".join(model_store.listing(store)) + "\n",
                          "after": "\n".join(model_store.listing(store, gone)) + "\n"}
    if module.check_mode or not changed:
        module.exit_json(**result)

    # 4. do it: hold every lock of what changes, check the plan still holds, delete exactly it
    if any(st.uses_hf for st in plan) and DeleteCacheStrategy is None:
        module.fail_json(msg=missing_required_lib("huggingface_hub"), exception=str(HF_IMPORT_ERROR))
    holders = []
    done = []

    def release():
        for h in holders:
            h.release()

    for kind, key, group in steps:
        item = group[0]
        directory, recursive = lock_dirs_for(store, item)
        holder = store_locks.LockSet(directory, recursive)
        busy = holder.acquire_all()
        if busy:
            release()
            module.fail_json(msg="%s refused %s: a download holds %s; wait for it to finish or stop it; "
                                 "nothing was deleted" % (ACTION, item.ident, busy[0]), changed=False)
        holders.append(holder)
    changes = model_store.plan_changes(store, plan)
    if changes:
        release()
        module.fail_json(msg="%s refused: the store changed since it was planned (%s%s); nothing was "
                             "deleted; find out who writes to it, then run again to plan afresh" % (
                                 ACTION, "; ".join(changes[:5]),
                                 "; and %d more" % (len(changes) - 5) if len(changes) > 5 else ""),
                         changes=changes, changed=False)
    before = free_bytes([r for r in (store.cache_dir, store.models_dir) if r])
    try:
        for st in plan:
            delete_step(store, st)
            done.append(st.label)
    except OSError as exc:
        release()
        module.fail_json(msg="%s: deleting failed (%s); done before the failure: %s" % (
            ACTION, exc, ", ".join(done) or "nothing"), changed=bool(done), **{
                k: v for k, v in result.items() if k != "changed"})
    release()

    # orphans: per repo, only with every lock of the repo held
    removed_orphans = []
    for folder in sorted({folder_of(o["path"]) for o in orphans}):
        mine = [o for o in orphans if folder_of(o["path"]) == folder]
        holder = store_locks.LockSet(store_locks.lock_dir(store.cache_dir, folder))
        if holder.acquire_all():
            result["orphans_busy"].extend(o["path"] for o in mine)
            continue
        created = []
        try:
            for o in mine:
                etag = os.path.basename(o["path"]).split(".", 1)[0]
                lock = os.path.join(store_locks.lock_dir(store.cache_dir, folder), etag + ".lock")
                existed = os.path.lexists(lock)
                if not holder.acquire(etag + ".lock"):
                    result["orphans_busy"].append(o["path"])
                    continue
                if not existed:
                    created.append(lock)
                try:
                    os.unlink(o["path"])
                    removed_orphans.append(o)
                except FileNotFoundError:
                    pass
            if not p["clean_stale_locks"]:
                for lock in created:
                    if os.path.lexists(lock):
                        os.unlink(lock)
        finally:
            holder.release()
    result["orphans_removed"] = removed_orphans

    removed_locks = []
    for s in stale:
        if s["dir"]:
            holder = store_locks.LockSet(s["path"])
            if not holder.acquire_all():
                shutil.rmtree(s["path"], ignore_errors=True)
                removed_locks.append(s["path"])
            holder.release()
        else:
            holder = store_locks.LockSet(os.path.dirname(s["path"]))
            if holder.acquire(os.path.basename(s["path"])):
                holder.remove_held()
                removed_locks.append(s["path"])
            holder.release()
    # lock files created for orphans of repos that are clean now
    if p["clean_stale_locks"]:
        for folder in {folder_of(o["path"]) for o in removed_orphans}:
            holder = store_locks.LockSet(store_locks.lock_dir(store.cache_dir, folder))
            if not holder.acquire_all():
                for path in holder.remove_held():
                    if path not in removed_locks:
                        removed_locks.append(path)
            holder.release()
    result["locks_removed"] = removed_locks
    after = free_bytes([r for r in (store.cache_dir, store.models_dir) if r])
    result.update(freed_bytes=after - before,
                  changed=bool(done or removed_orphans or removed_locks))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
