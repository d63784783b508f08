# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""model_purge's logic: judge the items, plan what goes, then delete exactly the plan.

The module reads (store_context.scan, host_state), calls ``plan_purge`` (which judges every item,
groups them into deletion steps, plans the paths each step unlinks, the orphaned partial downloads
and the stale lock files) and, outside check mode, ``apply_purge``: with every download lock of
what changes held, the plan is checked again (unlink_plan.plan_changes) and deleted as planned.

The plan functions read the scanned store and probe locks but change nothing; each is
table-tested directly (tests/unit/plugins/module_utils/store/test_model_purge.py). Refusals and
failures raise PurgeError, whose message is final and whose ``details`` are the extra result keys.

A purge is verified: huggingface_hub's strategy only logs a path it could not delete (an immutable
file, an NFS root_squash mount, a task without become) and returns, so after each step every
planned path is looked at again (``leftovers``); what is still there is removed once more as
planned, and what stays is named with its cause: the item is not reported removed and the module
fails (tests/unit/plugins/module_utils/store/test_model_purge.py, leftovers; the module in
tests/unit/plugins/modules/test_model_purge.py).

On a Xet-layout cache (docs/architecture.md, "The Xet cache layout") a repo's blobs are links into
the cache-wide shared store: a step unlinks them (never follows them), and a payload goes only when
no link left in the cache references it, checked under the payload's lock from the links really
on disk (xet_store.remove_shared_payload), not only from its ``.refs`` hint. The plan names the
payloads (``shared``): those whose last link the purge removes and, with ``clean_orphans``, those
no link references any more (what a purge that died between a link and its payload left).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import stat
import sys
from pathlib import Path

from ansible_collections.modelswap.vllm.plugins.module_utils.store import plan_inputs
from ansible_collections.modelswap.vllm.plugins.module_utils.store import protections
from ansible_collections.modelswap.vllm.plugins.module_utils.store import purge_items
from ansible_collections.modelswap.vllm.plugins.module_utils.store import cache_layout
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import unlink_plan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import xet_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_locks
from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import allocated_under, listed

try:
    from huggingface_hub import DeleteCacheStrategy
    HF_IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - exercised on hosts without the library
    DeleteCacheStrategy = None
    HF_IMPORT_ERROR = exc

ACTION = "model_purge"


class PurgeError(Exception):
    """A purge that failed; the message is final, ``details`` the result keys to return with it."""

    def __init__(self, msg: str, **details):
        super().__init__(msg)
        self.details = details


class PurgeRefused(PurgeError):
    """A purge refused before anything was deleted (an item, a root, a lock, a changed store)."""


@dataclasses.dataclass
class PurgePlan:
    """Everything a purge deletes, decided before deleting (check mode returns it as it is)."""
    chosen: list            # the judged items (model_store.Item), in the order given
    absent: list            # item strings not in the store (missing=ignore)
    steps: list             # group_steps(chosen): (kind, key, [Item])
    removed: list           # one row per item, with the bytes its step frees
    deletions: list         # unlink_plan.delete_plan steps: the exact paths to unlink
    orphans: list = dataclasses.field(default_factory=list)        # {"path", "repo_id", "bytes"}
    busy_orphans: list = dataclasses.field(default_factory=list)   # partial files a download holds
    stale: list = dataclasses.field(default_factory=list)          # {"path", "bytes", "dir"}
    # shared-store payloads to remove: {"path", "bytes", "size", "why", "unreferenced"}
    shared: list = dataclasses.field(default_factory=list)

    def result(self) -> dict:
        """The module's result for this plan (a real run replaces the orphans, locks and bytes)."""
        planned = (sum(r["bytes"] for r in self.removed) + sum(o["bytes"] for o in self.orphans)
                   + sum(s["bytes"] for s in self.stale)
                   + sum(p["bytes"] for p in self.shared if p["unreferenced"]))
        return dict(changed=bool(self.removed or self.orphans or self.stale or self.shared), removed=self.removed,
                    absent=self.absent, orphans_removed=self.orphans, orphans_busy=self.busy_orphans,
                    locks_removed=[s["path"] for s in self.stale], planned_bytes=planned,
                    shared_removed=[dict(p) for p in self.shared], shared_kept=[],
                    expected_freed_size=sum(step.expected for step in self.deletions), freed_bytes=None)

    def needs_huggingface_hub(self) -> bool:
        return any(step.uses_hf for step in self.deletions)


# ------------------------------------------------------------------------------ reading helpers
def path_refusal(path: str, roots) -> str:
    """Why ``path`` may not be deleted under ``roots`` (real paths), or ''."""
    norm = os.path.normpath(path)
    real = os.path.realpath(norm)
    if not any(cache_layout.is_within(norm, r) or cache_layout.is_within(real, r) for r in roots):
        return "it is outside the roots (%s); only paths inside them can be purged" % ", ".join(roots)
    if real in roots or norm in roots:
        return "it is a root itself (%s); name an item inside it" % real
    if not any(cache_layout.is_within(real, r) for r in roots):
        return "it resolves through a symlink to %s, outside the roots (%s)" % (real, ", ".join(roots))
    if os.path.islink(norm):
        return "it is a symlink (to %s); name the directory itself" % os.readlink(norm)
    return ""


def lock_dirs_for(store, item):
    """(the lock folder a download of ``item`` uses, whether to walk it recursively)."""
    if item.kind == "dir":
        return os.path.join(item.path, ".cache", "huggingface", "download"), True
    return store_locks.lock_dir(store.cache_dir, item.folder), False


def folder_of(orphan_path: str) -> str:
    """<cache>/<folder>/blobs/<name>.incomplete -> <folder>."""
    return os.path.basename(os.path.dirname(os.path.dirname(orphan_path)))


def free_bytes(paths) -> int:
    """Free bytes of the file systems holding ``paths``, each file system counted once."""
    seen, total = set(), 0
    for path in paths:
        st = os.statvfs(path)
        dev = os.stat(path).st_dev
        if dev not in seen:
            seen.add(dev)
            total += st.f_bfree * st.f_frsize
    return total


# ------------------------------------------------------------------------------------- the plan
def purge_roots(store, roots_option) -> list:
    """The roots deletions stay inside, as real paths (default: the store's folders)."""
    roots = []
    for root in roots_option or [store.cache_dir, store.models_dir]:
        if not root:
            continue
        if not os.path.isdir(root):
            raise PurgeRefused("%s: root %s is not an existing directory; fix roots (nothing was "
                               "deleted)" % (ACTION, root))
        roots.append(os.path.realpath(root))
    return roots


def served_refusal(item, guard, state, unit_name: str) -> str:
    """Why the served ``item`` may not go even with allow_served_purge, or '': a vLLM server still
    serves it, or its unit runs (or its state is unknown)."""
    live = protections.protecting(item, state["running"])
    if live is not None:
        return "it is %s; stop that server before purging the model it serves" % live.label
    if state["served"]["unit_active"] is not False:
        return ("it is %s and unit %s is %s; stop the service before purging the served "
                "model" % (guard.label, unit_name, "running" if state["served"]["unit_active"]
                           else "in an unknown state"))
    return ""


def judge_items(store, items, *, roots, models, state, missing: str = "ignore",
                allow_served_purge: bool = False, unit_name: str = "") -> tuple:
    """(refused, absent, chosen): every item resolved and checked against the roots and the
    protections, all together, so that one refusal deletes nothing. ``refused`` rows are
    {"item", "rule", "why"}; ``chosen`` the store items, each once, in the order given."""
    refused, absent, chosen = [], [], []
    for text in items:
        try:
            if isinstance(text, str) and os.path.isabs(text):
                why = path_refusal(text, roots)
                if why:
                    refused.append({"item": text, "rule": "roots", "why": why})
                    continue
                item = purge_items.item_for_path(store, os.path.realpath(text))
            else:
                item = purge_items.resolve_item(store, text, models)
        except plan_inputs.NotInStore as exc:
            if missing == "fail":
                refused.append({"item": text, "rule": "missing", "why": "%s (missing=fail)" % exc})
            else:
                absent.append(text)
            continue
        except plan_inputs.PlanError as exc:
            refused.append({"item": text, "rule": "input", "why": str(exc)})
            continue
        why = path_refusal(item.path, roots)
        if why:
            refused.append({"item": text, "rule": "roots", "why": why})
            continue
        guard = protections.protecting(item, state["protections"])
        if guard is not None:
            if guard.rule == "served" and allow_served_purge and item in state["served_items"]:
                why = served_refusal(item, guard, state, unit_name)
                if why:
                    refused.append({"item": text, "rule": "served", "why": why})
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
    return refused, absent, chosen


def refusal_message(refused) -> str:
    return "%s refused %s; nothing was deleted" % (ACTION, "; ".join(
        "%r: %s (rule: %s)" % (r["item"], r["why"], r["rule"]) for r in refused))


def group_steps(chosen) -> list:
    """[(kind, key, [Item])]: a repo item covers its revisions (they are dropped); the revisions of
    one repo go in one step (one huggingface_hub strategy); each directory is a step."""
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
    return steps


def plan_removal(store, steps, simulator, models=None) -> tuple:
    """(removed rows, unlink_plan.delete_plan steps): the bytes each step frees, simulated in order
    on ``simulator`` (a DeletionSimulator the orphans are then planned on); PurgeRefused for
    revisions of a damaged repo."""
    removed = []
    repo_steps = []
    for kind, key, group in steps:
        if kind == "revisions":
            effect = simulator.apply_revisions(key, [i.commit for i in group])
            if effect.removes_repo:
                kind = "repo"
        else:
            effect = simulator.apply(group[0])
        for item in group:
            row = purge_items.item_dict(store, item, models)
            row["bytes"] = effect.bytes if item is group[0] else 0
            if effect.removes_repo and item.kind == "revision":
                row["removes_repo"] = True
            removed.append(row)
        if kind in ("repo", "revisions"):
            repo = store.repos[key]
            if repo.problems and kind == "revisions":
                raise PurgeRefused("%s refused %s: the cached repo is damaged (%s); purge the whole "
                                   "repo instead; nothing was deleted" % (ACTION, repo.repo_id, repo.problems[0]),
                                   changed=False)
            repo_steps.append((key, effect))
    deletions = unlink_plan.delete_plan(store, repo_steps, [g[0].name for k, _unused, g in steps if k == "dir"])
    return removed, deletions


def cache_in_roots(store, roots) -> bool:
    """Orphans and stale locks are cleaned only when the cache itself is inside the roots."""
    return bool(store.cache_dir) and any(cache_layout.is_within(store.cache_dir, r) for r in roots)


def plan_orphans(store, simulator) -> tuple:
    """(orphans, busy paths): partial downloads in repos that stay, where no download holds a
    lock of the repo or the blob's own lock; their bytes simulated after the removals."""
    orphans, busy_orphans = [], []
    for folder in sorted(store.repos):
        if folder in simulator.gone_repos:
            continue
        repo = store.repos[folder]
        if not repo.orphans:
            continue
        busy = store_locks.busy_locks(store_locks.lock_dir(store.cache_dir, folder))
        for orphan in repo.orphans:
            lock = os.path.join(store_locks.lock_dir(store.cache_dir, folder), orphan.etag + ".lock")
            if busy or store_locks.probe(lock) is not False:
                busy_orphans.append(orphan.path)
                continue
            effect = simulator.apply(model_store.Item("orphan", folder=folder, path=orphan.path))
            orphans.append({"path": orphan.path, "repo_id": repo.repo_id, "bytes": effect.bytes})
    return orphans, busy_orphans


def plan_stale_locks(store, simulator) -> list:
    """[{"path", "bytes", "dir"}]: lock files nobody holds in repos that stay, and the lock folders
    of repos no longer cached (a folder with a held lock is left whole)."""
    stale = []
    locks_root = os.path.join(store.cache_dir, ".locks")
    for folder in listed(locks_root):
        path = os.path.join(locks_root, folder)
        if folder in simulator.gone_repos or os.path.islink(path) or not os.path.isdir(path):
            continue
        if store_locks.busy_locks(path):
            continue
        if folder not in store.repos and cache_layout.parse_repo_folder(folder):
            stale.append({"path": path, "bytes": allocated_under(path), "dir": True})
            continue
        for name in sorted(os.listdir(path)):
            lock = os.path.join(path, name)
            if name.endswith(".lock") and store_locks.is_regular(lock):
                stale.append({"path": lock, "bytes": os.lstat(lock).st_blocks * 512, "dir": False})
    return stale


def plan_shared(store, simulator, deletions, clean_orphans: bool) -> list:
    """The shared-store payloads the purge removes: those whose last link a deletion step removes
    (their bytes are the step's), then, with ``clean_orphans``, those no link references (their
    bytes simulated here). Each {"path", "bytes", "size", "why", "unreferenced"}."""
    rows, seen = [], set()
    for step in deletions:
        for path in step.payloads:
            sp = store.shared.get(path)
            if sp is None or path in seen:
                continue
            seen.add(path)
            rows.append({"path": path, "bytes": sum(store.inodes[k][0] for k in sp.keys), "size": sp.size,
                         "why": "its last link goes with %s" % step.label, "unreferenced": False})
    if clean_orphans:
        for sp in store.unreferenced_payloads():
            if sp.path in seen:
                continue
            effect = simulator.apply(model_store.Item("payload", path=sp.path))
            rows.append({"path": sp.path, "bytes": effect.bytes, "size": sp.size,
                         "why": "no link in the cache references it", "unreferenced": True})
    return rows


def plan_purge(store, state, *, roots, items, models=None, missing: str = "ignore",
               allow_served_purge: bool = False, unit_name: str = "", clean_orphans: bool = True,
               clean_stale_locks: bool = True) -> PurgePlan:
    """The whole plan from what the module read; PurgeRefused (nothing deleted) when an item is
    refused or a repo whose revisions are named is damaged."""
    refused, absent, chosen = judge_items(store, items, roots=roots, models=models, state=state,
                                          missing=missing, allow_served_purge=allow_served_purge,
                                          unit_name=unit_name)
    if refused:
        raise PurgeRefused(refusal_message(refused), refused=refused, changed=False)
    steps = group_steps(chosen)
    simulator = model_store.DeletionSimulator(store)
    removed, deletions = plan_removal(store, steps, simulator, models)
    plan = PurgePlan(chosen=chosen, absent=absent, steps=steps, removed=removed, deletions=deletions)
    in_roots = cache_in_roots(store, roots)
    if clean_orphans and in_roots:
        plan.orphans, plan.busy_orphans = plan_orphans(store, simulator)
    if clean_stale_locks and in_roots:
        plan.stale = plan_stale_locks(store, simulator)
    if in_roots:
        plan.shared = plan_shared(store, simulator, deletions, clean_orphans)
    return plan


def purge_diff(store, plan: PurgePlan) -> dict:
    """The store's listing before and after the plan (diff mode)."""
    planned_orphans = {o["path"] for o in plan.orphans}
    gone = list(plan.chosen) + [model_store.Item("orphan", folder=o.folder, path=o.path)
                                for r in store.repos.values() for o in r.orphans
                                if o.path in planned_orphans]
    return {"before_header": "model store", "after_header": "model store",
            "before": "\n".join(model_store.listing(store)) + "\n",
            "after": "\n".join(model_store.listing(store, gone)) + "\n"}


# ------------------------------------------------------------------------------------ the apply
def delete_step(store, step) -> list:
    """Delete exactly ``step``'s planned paths (unlink_plan.delete_plan), already re-checked: a healthy
    repo's through huggingface_hub's strategy (its deletion order and shared-store cleanup), a
    damaged repo or a plain directory with rmtree; then check them on disk (``leftovers``).
    Returns what is still there, [(path, cause)]; the repo's lock folder goes only when nothing is."""
    try:
        if step.uses_hf:
            fields = {f.name for f in dataclasses.fields(DeleteCacheStrategy)}
            extra = {"cache_dir": Path(store.cache_dir)} if "cache_dir" in fields else {}
            # it logs a path it cannot delete (PermissionError) and goes on: leftovers() finds it
            DeleteCacheStrategy(
                expected_freed_size=step.expected,
                blobs=frozenset(Path(x) for x in step.paths("blob")),
                refs=frozenset(Path(x) for x in step.paths("ref")),
                repos=frozenset(Path(x) for x in step.paths("repo")),
                snapshots=frozenset(Path(x) for x in step.paths("snapshot")), **extra).execute()
        else:
            shutil.rmtree(step.unlinks[0].path)
    except OSError:
        pass    # what the failure left is found, removed once more or named, below
    if step.uses_hf:
        try:
            unlink_plan.remove_metadata(step)
        except OSError:
            pass
    left = leftovers(step)
    if not left and step.whole and step.folder:
        shutil.rmtree(store_locks.lock_dir(store.cache_dir, step.folder), ignore_errors=True)
    return left


def _lstat(path: str):
    """(lstat result or None when the path is gone, the OSError that hides whether it is there)."""
    try:
        return os.lstat(path), None
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except OSError as exc:
        return None, exc


def _rmtree(path: str) -> list:
    """rmtree ``path`` going past failures; [(path, OSError)] for each failure."""
    failures = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _func, failed, exc: failures.append((failed, exc)))
    else:
        shutil.rmtree(path, onerror=lambda _func, failed, info: failures.append((failed, info[1])))
    return failures


def remove_once(path: str) -> list:
    """Remove ``path`` once: a real folder with rmtree (going past failures), anything else with
    unlink (a link is never followed). Returns [(path, OSError)] for what could not be removed."""
    st, exc = _lstat(path)
    if exc is not None:
        return [(path, exc)]
    if st is None:
        return []
    if stat.S_ISDIR(st.st_mode):
        return _rmtree(path)
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        return [(path, exc)]
    return []


def _cause(exc) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def leftovers(step) -> list:
    """What of ``step``'s planned paths (unlink_plan.PurgeStep.unlinks) is still on disk after its
    deletion, [(path, cause)], in plan order; empty when all of it is gone.

    huggingface_hub's strategy logs a path it cannot delete and goes on, so each planned path still
    there is removed once more, exactly as planned, and only if it is still what the plan saw
    (unlink_plan.unlink_problem: same inode and type, reached through no symlink; otherwise it is
    left alone and that is its cause). What that second removal cannot delete is named with the
    OSError's strerror (a folder's own "Directory not empty" only when nothing inside says more);
    what it deletes is not a leftover.
    """
    out = []
    for u in step.unlinks:
        st, exc = _lstat(u.path)
        if exc is not None:
            out.append((u.path, _cause(exc)))
            continue
        if st is None:
            continue
        why = unlink_plan.unlink_problem(u)
        if why:
            out.append((u.path, why))
            continue
        failures = remove_once(u.path)
        st, exc = _lstat(u.path)
        if st is None and exc is None:
            continue
        named = [(p, e) for p, e in failures if getattr(e, "errno", None) != errno.ENOTEMPTY] or failures
        if named:
            out.extend((p, _cause(e)) for p, e in named)
        else:
            out.append((u.path, _cause(exc) if exc is not None else "still there after a second removal"))
    return out


def left_row(step, left) -> dict:
    """The result's row for a step that left ``left`` ([(path, cause)]) on disk."""
    causes = []
    for _path, cause in left:
        if cause not in causes:
            causes.append(cause)
    return {"item": step.label, "paths": [p for p, _unused in left], "cause": "; ".join(causes)}


def count_entries(step) -> int:
    """How many of ``step``'s planned paths and the entries inside its folders are on disk."""
    n = 0
    for u in step.unlinks:
        st, _unused = _lstat(u.path)
        if st is None:
            continue
        n += 1
        if stat.S_ISDIR(st.st_mode):
            for _dirpath, dirnames, filenames in os.walk(u.path):
                n += len(dirnames) + len(filenames)
    return n


def leftover_message(removed: int, planned: int, left, shown: int = 3) -> str:
    """The failure of a purge that left ``left`` (left_row()s) on disk, ``removed`` of ``planned``
    items really gone."""
    parts = []
    for row in left:
        paths = ", ".join(row["paths"][:shown])
        if len(row["paths"]) > shown:
            paths += " and %d more" % (len(row["paths"]) - shown)
        parts.append("%s: still on disk: %s (%s)" % (row["item"], paths, row["cause"]))
    return ("%s: deleted %d of %d; %s; find why (lsattr shows an immutable file; a read-only or "
            "root_squash mount; a task without become), fix it and run the purge again" % (
                ACTION, removed, planned, "; ".join(parts)))


def rows_of(plan: PurgePlan, steps) -> list:
    """The rows of ``plan.removed`` that the deletion ``steps`` (unlink_plan.PurgeStep) account for:
    a repo step's items by its folder, a plain directory's by its path."""
    keys = {step.folder or step.label for step in steps}
    out = []
    for kind, key, group in plan.steps:
        idents = {item.ident for item in group}
        rows = [row for row in plan.removed if row["item"] in idents]
        if rows and (rows[0]["path"] if kind == "dir" else key) in keys:
            out.extend(rows)
    return out


def store_folders(store) -> list:
    return [r for r in (store.cache_dir, store.models_dir) if r]


def delete_planned(store, plan: PurgePlan, result: dict) -> tuple:
    """Hold every download lock of what changes, check the plan still holds, delete exactly it and
    check what each step left on disk; the locks are released whatever happens. Returns (the
    steps deleted whole, left_row()s of the others, whether those others deleted anything at all,
    the free bytes measured right before the first deletion).
    PurgeRefused (nothing deleted) for a busy lock or a changed store, PurgeError for an
    unexpected failure (``result`` returned with it, ``removed`` what was really removed)."""
    holders = []
    done, left = [], []
    partial = False
    try:
        for _kind, _key, group in plan.steps:
            item = group[0]
            directory, recursive = lock_dirs_for(store, item)
            holder = store_locks.LockSet(directory, recursive)
            busy = holder.acquire_all()
            if busy:
                raise PurgeRefused("%s refused %s: a download holds %s; wait for it to finish or stop it; "
                                   "nothing was deleted" % (ACTION, item.ident, busy[0]), changed=False)
            holders.append(holder)
        changes = unlink_plan.plan_changes(store, plan.deletions)
        if changes:
            raise PurgeRefused("%s refused: the store changed since it was planned (%s%s); nothing was "
                               "deleted; find out who writes to it, then run again to plan afresh" % (
                                   ACTION, "; ".join(changes[:5]),
                                   "; and %d more" % (len(changes) - 5) if len(changes) > 5 else ""),
                               changes=changes, changed=False)
        before = free_bytes(store_folders(store))
        try:
            for step in plan.deletions:
                entries = count_entries(step)
                step_left = delete_step(store, step)
                if step_left:
                    left.append(left_row(step, step_left))
                    partial = partial or count_entries(step) < entries
                else:
                    done.append(step)
        except OSError as exc:
            raise PurgeError("%s: deleting failed (%s); done before the failure: %s" % (
                ACTION, exc, ", ".join(s.label for s in done) or "nothing"), **dict(
                    {k: v for k, v in result.items() if k != "changed"}, changed=True,
                    removed=rows_of(plan, done), left=left))
    finally:
        for holder in holders:
            holder.release()
    return done, left, partial, before


def remove_orphans(store, orphans, busy_orphans: list, clean_stale_locks: bool) -> list:
    """Delete the planned orphans, per repo, only with every lock of the repo and the blob's own
    lock held; one that became busy is added to ``busy_orphans``. Returns the orphans deleted."""
    removed_orphans = []
    for folder in sorted({folder_of(o["path"]) for o in orphans}):
        mine = [o for o in orphans if folder_of(o["path"]) == folder]
        holder = store_locks.LockSet(store_locks.lock_dir(store.cache_dir, folder))
        if holder.acquire_all():
            busy_orphans.extend(o["path"] for o in mine)
            continue
        created = []
        try:
            for orphan in mine:
                etag = os.path.basename(orphan["path"]).split(".", 1)[0]
                lock = os.path.join(store_locks.lock_dir(store.cache_dir, folder), etag + ".lock")
                existed = os.path.lexists(lock)
                if not holder.acquire(etag + ".lock"):
                    busy_orphans.append(orphan["path"])
                    continue
                if not existed:
                    created.append(lock)
                try:
                    os.unlink(orphan["path"])
                    removed_orphans.append(orphan)
                except FileNotFoundError:
                    pass
            if not clean_stale_locks:
                # the locks taken to delete them were not there before: leave none behind
                for lock in created:
                    if os.path.lexists(lock):
                        os.unlink(lock)
        finally:
            holder.release()
    return removed_orphans


def remove_stale_locks(store, stale, removed_orphans, clean_stale_locks: bool) -> list:
    """Delete the planned stale locks that nobody holds now, then the lock files taken for the
    orphans of repos that are clean now. Returns the paths deleted."""
    removed_locks = []
    for lock in stale:
        if lock["dir"]:
            holder = store_locks.LockSet(lock["path"])
            if not holder.acquire_all():
                shutil.rmtree(lock["path"], ignore_errors=True)
                removed_locks.append(lock["path"])
            holder.release()
        else:
            holder = store_locks.LockSet(os.path.dirname(lock["path"]))
            if holder.acquire(os.path.basename(lock["path"])):
                holder.remove_held()
                removed_locks.append(lock["path"])
            holder.release()
    if clean_stale_locks:
        for folder in {folder_of(o["path"]) for o in removed_orphans}:
            holder = store_locks.LockSet(store_locks.lock_dir(store.cache_dir, folder))
            if not holder.acquire_all():
                for path in holder.remove_held():
                    if path not in removed_locks:
                        removed_locks.append(path)
            holder.release()
    return removed_locks


def remove_shared(store, plan: PurgePlan) -> tuple:
    """Remove the planned shared-store payloads that no link in the cache references now (the
    references read again from the cache after the deletions, each checked under the payload's
    lock). Returns (rows removed, rows kept with ``because``, left_row()s of those whose unlink
    failed). A payload a link still reaches is kept: a purge never breaks another repo's link."""
    removed, kept, left = [], [], []
    if not plan.shared:
        return removed, kept, left
    refs, complete = xet_store.shared_references(store.cache_dir)
    for row in plan.shared:
        path = row["path"]
        if not complete:
            kept.append(dict(row, because="a folder of the cache could not be listed, so a link to it may "
                                          "exist unseen"))
            continue
        try:
            _size, why = xet_store.remove_shared_payload(store.cache_dir, path, refs.get(path, ()))
        except OSError as exc:
            left.append({"item": "shared payload %s" % path, "paths": [path], "cause": _cause(exc)})
            continue
        if why:
            kept.append(dict(row, because=why))
        else:
            removed.append(row)
    return removed, kept, left


def apply_purge(store, plan: PurgePlan, result: dict, *, clean_stale_locks: bool = True) -> dict:
    """Delete the plan (delete_planned, then the orphans and stale locks); ``result`` (the plan's,
    with its diff) updated with what was really removed (``removed``: only items whose planned
    paths are all gone; ``left``: what is still on disk, with its cause) and the bytes freed, from
    statvfs. PurgeError, with that result, when anything planned is still on disk."""
    done, left, partial, before = delete_planned(store, plan, result)
    removed_orphans = remove_orphans(store, plan.orphans, result["orphans_busy"], clean_stale_locks)
    result["orphans_removed"] = removed_orphans
    result["locks_removed"] = remove_stale_locks(store, plan.stale, removed_orphans, clean_stale_locks)
    shared_removed, shared_kept, shared_left = remove_shared(store, plan)
    left = left + shared_left
    result.update(shared_removed=shared_removed, shared_kept=shared_kept)
    after = free_bytes(store_folders(store))
    result.update(removed=rows_of(plan, done), left=left, freed_bytes=after - before,
                  changed=bool(done or partial or removed_orphans or result["locks_removed"] or shared_removed))
    if left:
        raise PurgeError(leftover_message(len(result["removed"]), len(plan.removed), left), **result)
    return result
