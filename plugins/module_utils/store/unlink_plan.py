# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The delete plan: exactly the paths a purge unlinks (``delete_plan``, from the scan and the
DeletionSimulator's effects alone), checked again right before it does (``unlink_problem``,
``plan_changes``: a path moved, replaced or retargeted since the scan), and the revision metadata
huggingface_hub's strategy leaves behind (``remove_metadata``).

Pure stdlib: unit-tested directly, importable on any host.
"""
from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass

from ansible_collections.modelswap.vllm.plugins.module_utils.store.model_store import CacheRepo, Item, Store
from ansible_collections.modelswap.vllm.plugins.module_utils.store.store_scan import scan_repo


@dataclass(frozen=True)
class Unlink:
    """One path a purge deletes, as the scan saw it."""
    kind: str        # repo | snapshot | ref | blob | meta (a file) | meta_dir | dir (plain model)
    path: str
    key: tuple       # (st_dev, st_ino) when planned
    link: str = ""   # a blob entry that links into the shared store: the payload it links to


@dataclass
class PurgeStep:
    """What one purge step deletes: a whole repo, revisions of one repo, or a plain directory."""
    label: str            # what 'done' reports: org/name, org/name@c1,c2, or the directory
    folder: str           # the repo folder; '' for a plain directory
    whole: bool           # the whole folder goes (a repo or a plain directory)
    uses_hf: bool         # deleted through huggingface_hub's strategy (a healthy repo)
    unlinks: list         # Unlink, in deletion order: snapshots, refs, blobs, then metadata
    expected: int = 0     # Effect.expected
    # shared-store payloads whose last link this step removes (Effect.payloads): removed after
    # the step by remove_shared_payload, only if no link in the cache references them by then
    payloads: tuple = ()

    def paths(self, kind: str) -> list:
        return [u.path for u in self.unlinks if u.kind == kind]


def _first_key(parts: dict, part) -> tuple:
    keys = parts.get(part)
    return keys[0] if keys else ()


def delete_plan(store: Store, repo_steps, dir_names=()) -> list:
    """The delete plan, from the scan alone: ``repo_steps`` is [(folder, effect)] with the
    DeletionSimulator's effect of each step, ``dir_names`` the plain directories to delete.

    A step that removes its repo deletes the repo folder; a revision step deletes the revisions'
    snapshot folders, their refs, the blob entries ``effect.blobs`` names (those no remaining
    revision links), and their metadata (``trees/<commit>.json``, ``modelswap/<commit>.json``,
    ``.no_exist/<commit>``). Nothing is derived from where a link points at delete time.
    """
    steps = []
    for folder, effect in repo_steps:
        repo = store.repos[folder]
        ident = Item("repo", folder).ident
        uses_hf = not repo.problems and bool(repo.revisions)
        if effect.removes_repo:
            steps.append(PurgeStep(ident, folder, True, uses_hf,
                                   [Unlink("repo", repo.path, _first_key(repo.parts, ("rest",)))],
                                   effect.expected, effect.payloads))
            continue
        unlinks = []
        for commit in effect.revisions:
            rev = repo.revisions[commit]
            unlinks.append(Unlink("snapshot", rev.path, _first_key(repo.parts, ("snap", commit))))
        for commit in effect.revisions:
            for ref in sorted(repo.revisions[commit].refs):
                unlinks.append(Unlink("ref", os.path.join(repo.path, "refs", *ref.split("/")),
                                      _first_key(repo.parts, ("ref", ref))))
        for name in sorted(effect.blobs):
            blob = repo.blobs.get(name)
            unlinks.append(Unlink("blob", os.path.join(repo.path, "blobs", name),
                                  _first_key(repo.parts, ("blob", name)),
                                  blob.shared if blob is not None else ""))
        for commit in effect.revisions:
            for path, key, is_dir in sorted(repo.meta.get(commit, ())):
                unlinks.append(Unlink("meta_dir" if is_dir else "meta", path, key))
        steps.append(PurgeStep("%s@%s" % (ident, ",".join(effect.revisions)), folder, False,
                               uses_hf, unlinks, effect.expected, effect.payloads))
    for name in dir_names:
        d = store.dirs[name]
        steps.append(PurgeStep(d.path, "", True, False,
                               [Unlink("dir", d.path, _first_key(d.parts, ("rest",)))]))
    return steps


_KIND_WORDS = {"repo": "repo folder", "snapshot": "snapshot folder", "ref": "ref", "blob": "blob",
               "meta": "metadata file", "meta_dir": "metadata folder", "dir": "model directory"}


def unlink_problem(u: Unlink) -> str:
    """Why deleting ``u`` now would not delete what was planned, or ''.

    The path must still sit where it was planned, reached through no symlink (its folder's real
    path is its folder: every planned path is built on the store's real path), be the same inode
    and of the planned type: a blob a regular file (or the planned link into the shared store),
    a folder a real folder, a ref or metadata file a regular file.
    """
    what = "%s %s" % (_KIND_WORDS[u.kind], u.path)
    parent = os.path.dirname(u.path)
    real_parent = os.path.realpath(parent)
    if real_parent != parent:
        return "%s is now reached through a symlink (its folder resolves to %s)" % (what, real_parent)
    try:
        st = os.lstat(u.path)
    except FileNotFoundError:
        return "%s is gone" % what
    except OSError as exc:
        return "%s cannot be read (%s)" % (what, exc.strerror)
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        target = os.readlink(u.path)
        resolved = os.path.normpath(os.path.join(parent, target))
        if not (u.kind == "blob" and u.link and resolved == u.link):
            return "%s is now a symlink to %s" % (what, target)
    elif u.kind in ("repo", "snapshot", "meta_dir", "dir"):
        if not stat.S_ISDIR(mode):
            return "%s is no longer a folder" % what
    elif not stat.S_ISREG(mode):
        return "%s is no longer a regular file" % what
    elif u.kind == "blob" and u.link:
        return "%s no longer links into the shared store" % what
    if u.key and (st.st_dev, st.st_ino) != tuple(u.key):
        return "%s was replaced by another file" % what
    return ""


def repo_state(repo: CacheRepo) -> dict:
    """What a purge of ``repo`` relies on: revisions and where their links point, refs, blob
    entries (inode and shared payload), metadata entries, problems."""
    return {
        "revisions": {c: (frozenset(r.blobs), tuple(sorted(r.foreign_links)),
                          tuple(sorted(r.broken_links))) for c, r in repo.revisions.items()},
        "refs": dict(repo.refs),
        "blobs": {n: (_first_key(repo.parts, ("blob", n)), b.shared) for n, b in repo.blobs.items()},
        "meta": {c: sorted((p, k) for p, k, _unused in entries) for c, entries in repo.meta.items()},
        "problems": sorted(repo.problems),
    }


def state_changes(label: str, before: dict, after: dict) -> list:
    """What differs between two repo_state()s, one sentence each."""
    out = []
    b_revs, a_revs = before["revisions"], after["revisions"]
    for commit in sorted(set(b_revs) - set(a_revs)):
        out.append("%s: revision %s is gone" % (label, commit))
    for commit in sorted(set(a_revs) - set(b_revs)):
        out.append("%s: revision %s appeared" % (label, commit))
    for commit in sorted(set(a_revs) & set(b_revs)):
        (b_blobs, b_foreign, b_broken), (a_blobs, a_foreign, a_broken) = b_revs[commit], a_revs[commit]
        for link in a_foreign:
            if link not in b_foreign:
                out.append("%s: revision %s has a link that now leaves the repo's blobs: %s"
                           % (label, commit, link))
        for path in a_broken:
            if path not in b_broken:
                out.append("%s: revision %s has a link that is now broken: %s" % (label, commit, path))
        if a_blobs != b_blobs and not (set(a_foreign) - set(b_foreign) or set(a_broken) - set(b_broken)):
            out.append("%s: revision %s now links other blobs (%s instead of %s)" % (
                label, commit, ", ".join(sorted(a_blobs - b_blobs)) or "fewer",
                ", ".join(sorted(b_blobs - a_blobs)) or "the same and more"))
    if before["refs"] != after["refs"]:
        out.append("%s: refs changed (%s)" % (label, ", ".join(
            "%s: %s -> %s" % (r, before["refs"].get(r, "none"), after["refs"].get(r, "none"))
            for r in sorted(set(before["refs"]) | set(after["refs"]))
            if before["refs"].get(r) != after["refs"].get(r))))
    b_blobs, a_blobs = before["blobs"], after["blobs"]
    for name in sorted(set(b_blobs) | set(a_blobs)):
        if name not in a_blobs:
            out.append("%s: blob %s is gone" % (label, name))
        elif name not in b_blobs:
            out.append("%s: blob %s appeared" % (label, name))
        elif a_blobs[name] != b_blobs[name]:
            out.append("%s: blob %s was replaced" % (label, name))
    if before["meta"] != after["meta"]:
        out.append("%s: revision metadata changed" % label)
    for problem in after["problems"]:
        if problem not in before["problems"]:
            out.append("%s: %s" % (label, problem))
    return out


def plan_changes(store: Store, steps) -> list:
    """Why ``steps`` (delete_plan()) no longer match the store on disk, one sentence each; empty
    when every planned path is still what the scan saw. Each affected repo is scanned again and
    compared with the first scan: a snapshot link retargeted, a blob replaced, a revision or ref
    added since the plan all count (a remaining revision must not come to link a planned blob)."""
    out = []
    for step in steps:
        for u in step.unlinks:
            why = unlink_problem(u)
            if why:
                out.append(why)
        if not step.folder:
            continue
        repo = store.repos[step.folder]
        try:
            fresh = scan_repo(Store(cache_dir=store.cache_dir), repo.path, step.folder)
        except OSError as exc:
            out.append("%s: cannot scan it again (%s)" % (repo.repo_id, exc))
            continue
        out.extend(state_changes(repo.repo_id, repo_state(repo), repo_state(fresh)))
    seen = set()
    return [x for x in out if not (x in seen or seen.add(x))]


def remove_metadata(step: PurgeStep) -> None:
    """Delete the metadata entries of ``step`` that huggingface_hub's strategy leaves behind."""
    for u in step.unlinks:
        if u.kind == "meta" and os.path.lexists(u.path):
            os.unlink(u.path)
        elif u.kind == "meta_dir" and os.path.isdir(u.path) and not os.path.islink(u.path):
            shutil.rmtree(u.path)
