# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The scanned inventory of a model store (``Store`` and its repos, revisions, blobs, orphans, plain
directories and shared payloads) and the size math that predicts what a deletion really frees.

A model store is a Hugging Face hub cache (``models--org--name/{blobs,snapshots,refs}``) and/or a
folder of plain model directories. ``store_scan.scan_store`` fills a ``Store``: for every inode it
meets, the bytes the file system allocates to it (``st_blocks * 512``) and its link count.

``DeletionSimulator`` then replays deletions in order, with the rules of huggingface_hub's
``HFCacheInfo.delete_revisions`` strategy (a revision's blobs go only when no remaining revision
links them; the last revision takes the whole repo folder), and returns for each step the bytes it
would newly free: shared blobs are counted once, a hard-linked inode only when its last link goes,
and a payload of the cache-wide shared (Xet) blob store (xet_store) only when every repo link to it
goes.

Pure stdlib: unit-tested directly, importable on any host.
"""
from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes
from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import parse_repo_folder, repo_folder_name
from ansible_collections.modelswap.vllm.plugins.module_utils.store.xet_store import is_shared_store


# --------------------------------------------------------------------------------------------
# inventory data
# --------------------------------------------------------------------------------------------
@dataclass
class Revision:
    commit: str
    path: str
    refs: set = field(default_factory=set)
    blobs: set = field(default_factory=set)        # names of repo blob entries its links point to
    files: int = 0                                # files in the snapshot (links or regular files)
    foreign_links: list = field(default_factory=list)  # links that leave the repo's blobs dir
    store_links: list = field(default_factory=list)    # (link, payload): foreign links into the shared store
    broken_links: list = field(default_factory=list)   # links to a blob that does not exist


@dataclass
class Blob:
    name: str
    size: int          # apparent size of the payload (the shared payload's size for a shared link)
    atime: float
    mtime: float
    shared: str = ""   # path of the shared-store payload when the entry is a link into it


@dataclass
class Orphan:
    """A ``*.incomplete`` partial download left in a repo's blobs folder."""
    path: str
    folder: str        # the repo folder it sits in
    etag: str          # the blob name it would have become (its lock is .locks/<folder>/<etag>.lock)
    size: int
    bytes: int         # allocated bytes
    mtime: float


@dataclass
class CacheRepo:
    folder: str
    repo_type: str
    repo_id: str
    path: str
    revisions: dict = field(default_factory=dict)   # commit -> Revision
    blobs: dict = field(default_factory=dict)       # name -> Blob
    refs: dict = field(default_factory=dict)        # ref name -> commit
    orphans: list = field(default_factory=list)
    problems: list = field(default_factory=list)    # why huggingface_hub would call it corrupted
    # commit -> its metadata entries: (path, (st_dev, st_ino), is_dir)
    meta: dict = field(default_factory=lambda: defaultdict(list))
    # inode occurrences by partition: ("snap", c) ("ref", r) ("blob", n) ("meta", c) ("orphan", p)
    # ("rest",) ("locks",)
    parts: dict = field(default_factory=lambda: defaultdict(list))

    @property
    def last_used(self) -> float:
        """Latest access of any blob (huggingface_hub's last_accessed), else 0."""
        return max((b.atime for b in self.blobs.values()), default=0.0)

    def revision_size(self, commit: str) -> int:
        """Apparent size of a revision: its distinct blobs (as huggingface_hub reports it)."""
        rev = self.revisions[commit]
        return sum(self.blobs[n].size for n in rev.blobs if n in self.blobs)

    @property
    def size(self) -> int:
        return sum(b.size for b in self.blobs.values())

    def commit_for(self, revision: str):
        """A commit hash for ``revision`` (a commit or a ref in this cache), else None."""
        if revision in self.revisions:
            return revision
        return self.refs.get(revision)


@dataclass
class PlainDir:
    name: str
    path: str
    size: int = 0
    files: int = 0
    last_used: float = 0.0
    is_link: bool = False
    parts: dict = field(default_factory=lambda: defaultdict(list))


@dataclass
class SharedPayload:
    path: str
    size: int
    keys: list                      # the payload, its .refs manifest and its .lock
    links: set = field(default_factory=set)   # (folder, blob name) that link to it


@dataclass
class Store:
    cache_dir: str = ""
    models_dir: str = ""
    repos: dict = field(default_factory=dict)     # folder -> CacheRepo
    dirs: dict = field(default_factory=dict)      # name -> PlainDir
    inodes: dict = field(default_factory=dict)    # key -> [allocated bytes, nlink, size, is_regular]
    shared: dict = field(default_factory=dict)    # payload path -> SharedPayload
    warnings: list = field(default_factory=list)
    marked: object = None                         # is_shared_store(cache_dir), read once

    def shared_marked(self) -> bool:
        """Whether the cache holds huggingface_hub's marked shared (Xet) store."""
        if self.marked is None:
            self.marked = is_shared_store(self.cache_dir)
        return self.marked

    def unreferenced_payloads(self) -> list:
        """Payloads of the shared store that no link of the scan references (a purge or a
        deletion that stopped between a link and its payload leaves them), sorted."""
        return [sp for path, sp in sorted(self.shared.items()) if not sp.links]

    def repo(self, repo_id: str, repo_type: str = "model"):
        return self.repos.get(repo_folder_name(repo_id, repo_type))

    @property
    def orphans(self) -> list:
        return [o for r in self.repos.values() for o in r.orphans]

    def device(self):
        """st_dev of the store's file system (cache first)."""
        return os.stat(self.cache_dir or self.models_dir).st_dev


# --------------------------------------------------------------------------------------------
# deletion simulation
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    """One purgeable thing. kind: repo | revision | dir | orphan | payload (of the shared store,
    that no link references)."""
    kind: str
    folder: str = ""        # repo folder (repo, revision, orphan)
    commit: str = ""        # revision
    name: str = ""          # plain dir name
    path: str = ""          # orphan file path / dir path / payload path

    @property
    def ident(self) -> str:
        """The id an operator reads and writes back: org/name, org/name@commit, a path."""
        if self.kind in ("repo", "revision"):
            rtype, repo_id = parse_repo_folder(self.folder)
            base = repo_id if rtype == "model" else "%s:%s" % (rtype, repo_id)
            return base if self.kind == "repo" else "%s@%s" % (base, self.commit)
        return self.path


@dataclass
class Effect:
    bytes: int           # allocated bytes newly freed
    size: int            # apparent bytes of regular files newly freed
    removes_repo: bool = False
    revisions: tuple = ()
    blobs: frozenset = frozenset()   # repo blob names this step deletes
    # apparent bytes of the blobs it deletes, counted as huggingface_hub's
    # DeleteCacheStrategy.expected_freed_size counts them (a shared payload when its last link goes)
    expected: int = 0
    payloads: tuple = ()             # shared-store payloads whose last link this step removes


class DeletionSimulator:
    """Replays deletions on a scanned Store; each ``apply`` returns what that step newly frees."""

    def __init__(self, store: Store):
        self.store = store
        self.removed = Counter()      # key -> link occurrences removed so far
        self.freed = set()
        self.gone_parts = defaultdict(set)   # folder or dir name -> removed partitions
        self.gone_revs = defaultdict(set)    # folder -> removed commits
        self.gone_repos = set()
        self.gone_dirs = set()
        self.shared_links_gone = defaultdict(set)
        self.payloads_gone = set()

    def _drop(self, parts_owner: dict, owner: str, part) -> list:
        if part in self.gone_parts[owner]:
            return []
        self.gone_parts[owner].add(part)
        return list(parts_owner.get(part, ()))

    def _account(self, keys: list, shared_links: list) -> Effect:
        inodes = self.store.inodes
        newly = []
        payloads = 0
        gone = []
        for key in keys:
            self.removed[key] += 1
            if key not in self.freed and self.removed[key] >= inodes[key][1]:
                self.freed.add(key)
                newly.append(key)
        for folder, name, payload in shared_links:
            sp = self.store.shared.get(payload)
            if sp is None:
                continue
            self.shared_links_gone[payload].add((folder, name))
            if sp.links <= self.shared_links_gone[payload]:
                if payload not in self.payloads_gone:
                    self.payloads_gone.add(payload)
                    payloads += sp.size
                    gone.append(payload)
                for key in sp.keys:
                    if key not in self.freed:
                        self.freed.add(key)
                        newly.append(key)
        return Effect(bytes=sum(inodes[k][0] for k in newly),
                      size=sum(inodes[k][2] for k in newly if inodes[k][3]), expected=payloads,
                      payloads=tuple(sorted(gone)))

    def _release_payload(self, path: str) -> Effect:
        """A payload no link references: its inodes (payload, .refs, .lock) go."""
        sp = self.store.shared.get(path)
        if sp is None or sp.links or path in self.payloads_gone:
            return Effect(0, 0)
        self.payloads_gone.add(path)
        inodes = self.store.inodes
        newly = [k for k in sp.keys if k not in self.freed]
        self.freed.update(newly)
        return Effect(bytes=sum(inodes[k][0] for k in newly),
                      size=sum(inodes[k][2] for k in newly if inodes[k][3]), payloads=(path,))

    def is_gone(self, item: Item) -> bool:
        if item.kind == "repo":
            return item.folder in self.gone_repos
        if item.kind == "revision":
            return item.folder in self.gone_repos or item.commit in self.gone_revs[item.folder]
        if item.kind == "dir":
            return item.name in self.gone_dirs
        if item.kind == "payload":
            return item.path in self.payloads_gone
        return ("orphan", item.path) in self.gone_parts[item.folder] or item.folder in self.gone_repos

    def apply(self, item: Item) -> Effect:
        if self.is_gone(item):
            return Effect(0, 0)
        if item.kind == "dir":
            d = self.store.dirs[item.name]
            self.gone_dirs.add(item.name)
            return self._account(self._drop(d.parts, "dir:" + item.name, ("rest",)), [])
        if item.kind == "payload":
            return self._release_payload(item.path)
        repo = self.store.repos[item.folder]
        if item.kind == "orphan":
            return self._account(self._drop(repo.parts, item.folder, ("orphan", item.path)), [])
        remaining = set(repo.revisions) - self.gone_revs[item.folder]
        doomed = remaining if item.kind == "repo" else {item.commit}
        return self._delete_revisions(repo, doomed, remaining)

    def apply_revisions(self, folder: str, commits) -> Effect:
        """Delete several revisions of one repo in one step (one huggingface_hub strategy)."""
        repo = self.store.repos[folder]
        remaining = set(repo.revisions) - self.gone_revs[folder]
        return self._delete_revisions(repo, set(commits) & remaining, remaining)

    def _delete_revisions(self, repo: CacheRepo, doomed: set, remaining: set) -> Effect:
        folder = repo.folder
        keys, shared, blobs = [], [], set()
        whole = not (remaining - doomed)
        if whole:
            # huggingface_hub deletes the whole repo folder; modelswap also drops .locks/<folder>.
            for part in list(repo.parts):
                if part[0] == "blob" and part not in self.gone_parts[folder]:
                    blobs.add(part[1])
                    blob = repo.blobs.get(part[1])
                    if blob is not None and blob.shared:
                        shared.append((folder, part[1], blob.shared))
                keys.extend(self._drop(repo.parts, folder, part))
            for commit in remaining:
                for link, payload in repo.revisions[commit].store_links:
                    shared.append((folder, "snapshot:" + link, payload))
            self.gone_repos.add(folder)
        else:
            keep_blobs = set()
            for commit in remaining - doomed:
                keep_blobs |= repo.revisions[commit].blobs
            for commit in doomed:
                rev = repo.revisions[commit]
                keys.extend(self._drop(repo.parts, folder, ("snap", commit)))
                keys.extend(self._drop(repo.parts, folder, ("meta", commit)))
                for ref in rev.refs:
                    keys.extend(self._drop(repo.parts, folder, ("ref", ref)))
                for name in rev.blobs - keep_blobs:
                    if ("blob", name) not in self.gone_parts[folder]:
                        blobs.add(name)
                    blob = repo.blobs[name]
                    if blob.shared:
                        shared.append((folder, name, blob.shared))
                    keys.extend(self._drop(repo.parts, folder, ("blob", name)))
        self.gone_revs[folder] |= doomed
        effect = self._account(keys, shared)
        effect.removes_repo = whole
        effect.revisions = tuple(sorted(doomed))
        effect.blobs = frozenset(blobs)
        effect.expected += sum(repo.blobs[n].size for n in blobs
                               if n in repo.blobs and not repo.blobs[n].shared)
        return effect


def item_bytes(store: Store, item: Item) -> int:
    """Bytes ``item`` alone would free from the current state."""
    return DeletionSimulator(store).apply(item).bytes


def listing(store: Store, removed=()) -> list:
    """One line per repo revision, plain dir and orphan (for diffs); ``removed`` items left out."""
    sim = DeletionSimulator(store)
    for item in removed:
        sim.apply(item)
    lines = []
    for folder in sorted(store.repos):
        repo = store.repos[folder]
        if folder in sim.gone_repos:
            continue
        for commit in sorted(repo.revisions):
            if commit in sim.gone_revs[folder]:
                continue
            refs = ",".join(sorted(repo.revisions[commit].refs)) or "-"
            lines.append("hf %s@%s refs=%s size=%s" % (
                Item("repo", folder).ident, commit, refs, human_bytes(repo.revision_size(commit))))
        for orphan in repo.orphans:
            if ("orphan", orphan.path) not in sim.gone_parts[folder]:
                lines.append("partial %s size=%s" % (orphan.path, human_bytes(orphan.size)))
    for name in sorted(store.dirs):
        if name not in sim.gone_dirs:
            d = store.dirs[name]
            lines.append("dir %s size=%s" % (d.path, human_bytes(d.size)))
    return lines
