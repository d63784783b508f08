# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Inventory of a model store and the size math that predicts what a deletion really frees.

A model store is a Hugging Face hub cache (``models--org--name/{blobs,snapshots,refs}``) and/or a
folder of plain model directories. ``scan_store`` walks it once with ``os.scandir`` (one ``lstat``
per entry, one ``readlink`` per snapshot link) and records, for every inode it meets, the bytes the
file system allocates to it (``st_blocks * 512``) and its link count.

``DeletionSimulator`` then replays deletions in order, with the rules of huggingface_hub's
``HFCacheInfo.delete_revisions`` strategy (a revision's blobs go only when no remaining revision
links them; the last revision takes the whole repo folder), and returns for each step the bytes it
would newly free: shared blobs are counted once, a hard-linked inode only when its last link goes,
and a payload of the cache-wide shared (Xet) blob store only when every repo link to it goes.

The Xet layout (huggingface_hub >= 2.x downloading through hf_xet) adds a cache-wide shared store,
``<cache>/blobs`` (marked by ``.huggingface-shared-blobs``, content ``1``): each payload is a regular
read-only file ``blobs/<xx>/<xet hash>``, with ``<hash>.refs`` (the repo blob links that reference
it, a hint) and ``<hash>.lock``; a repo's ``blobs/<etag>`` is then a relative link into it. The
store folder is not a repo; a payload is counted once however many links reach it and freed only
with its last link; ``shared_references`` and ``remove_shared_payload`` reconcile the store from
the links really in the cache (docs/architecture.md, "The Xet cache layout").

Pure stdlib: unit-tested directly, importable on any host.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog
from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
FOLDER_PREFIX = {v: k for k, v in REPO_TYPES.items()}
# The catalog owns the commit and repo id rules.
COMMIT_RE = catalog.COMMIT_RE
XET_HASH_RE = re.compile(r"^[0-9a-f]{64}\Z")
IGNORED_NAMES = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})
# huggingface_hub's shared blob store (utils/_shared_blobs.py: SHARED_BLOBS_DIR_NAME,
# SHARED_BLOBS_MARKER_NAME, SHARED_BLOBS_LAYOUT_VERSION, the .refs and .lock suffixes)
SHARED_STORE_DIR = "blobs"
SHARED_STORE_MARKER = ".huggingface-shared-blobs"
SHARED_STORE_LAYOUT = "1\n"
PREFIX_RE = re.compile(r"^[0-9a-f]{2}\Z")

_SHARED_LOCK = threading.Lock()


class StoreError(Exception):
    """A model store that cannot be read or an identifier that is malformed (message is final)."""


def validate_repo_id(repo_id) -> str:
    """Return ``repo_id`` if it is a valid Hub repo id, else raise StoreError saying why."""
    problem = catalog.repo_id_problem(repo_id)
    if problem:
        raise StoreError(problem)
    return repo_id


def repo_folder_name(repo_id: str, repo_type: str = "model") -> str:
    """The cache folder of a repo: ``models--org--name`` (huggingface_hub's repo_folder_name)."""
    return "--".join([FOLDER_PREFIX[repo_type]] + repo_id.split("/"))


def parse_repo_folder(name: str):
    """``models--org--name`` -> ("model", "org/name"); None when the name is not a repo folder."""
    prefix, sep, rest = name.partition("--")
    if not sep or prefix not in REPO_TYPES or not rest:
        return None
    return REPO_TYPES[prefix], rest.replace("--", "/")


def allocated(st) -> int:
    """Bytes the file system allocates to an inode (what deleting its last link frees)."""
    return st.st_blocks * 512


def round_up(size: int, block: int) -> int:
    """``size`` rounded up to whole blocks of ``block`` bytes (an estimate of a new file's use)."""
    if block <= 0:
        return size
    return -(-size // block) * block


def is_within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (both absolute and normalised)."""
    path = os.path.normpath(path)
    root = os.path.normpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# --------------------------------------------------------------------------------------------
# the cache-wide shared (Xet) blob store
# --------------------------------------------------------------------------------------------
def shared_store_dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, SHARED_STORE_DIR)


def is_shared_store(cache_dir: str) -> bool:
    """Whether ``<cache_dir>/blobs`` is huggingface_hub's marked shared store (its
    ``is_shared_blobs_dir``: a real folder holding the marker, a regular file reading ``1``)."""
    if not cache_dir:
        return False
    folder = shared_store_dir(cache_dir)
    marker = os.path.join(folder, SHARED_STORE_MARKER)
    try:
        if not (stat.S_ISDIR(os.lstat(folder).st_mode) and stat.S_ISREG(os.lstat(marker).st_mode)):
            return False
        with open(marker, encoding="utf-8") as fh:
            return fh.read() == SHARED_STORE_LAYOUT
    except (OSError, UnicodeDecodeError):
        return False


def shared_payload_path(cache_dir: str, path: str):
    """``path`` (lexically normalised) when it names a payload of the store: exactly
    ``<cache>/blobs/<xx>/<64 hex>`` with ``xx`` the hash's first two digits; else None."""
    path = os.path.normpath(path)
    if os.path.dirname(os.path.dirname(path)) != shared_store_dir(cache_dir):
        return None
    name = os.path.basename(path)
    if XET_HASH_RE.match(name) and os.path.basename(os.path.dirname(path)) == name[:2]:
        return path
    return None


def store_payloads(cache_dir: str) -> list:
    """The payloads of a marked shared store (regular files, as huggingface_hub's
    shared_store_blob_paths lists them), sorted; [] when the store is not marked."""
    if not is_shared_store(cache_dir):
        return []
    out = []
    folder = shared_store_dir(cache_dir)
    for prefix in sorted(_listed(folder)):
        pdir = os.path.join(folder, prefix)
        if not PREFIX_RE.match(prefix) or not _is_dir(pdir):
            continue
        for name in sorted(_listed(pdir)):
            path = os.path.join(pdir, name)
            if XET_HASH_RE.match(name) and name.startswith(prefix) and _is_reg(path):
                out.append(path)
    return out


def _listed(folder: str) -> list:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_reg(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def link_payload(cache_dir: str, link: str):
    """The payload the symlink ``link`` points to (its target resolved lexically, as
    huggingface_hub's _shared_blob_target does), or None."""
    try:
        target = os.readlink(link)
    except OSError:
        return None
    return shared_payload_path(cache_dir, os.path.join(os.path.dirname(link), target))


def shared_references(cache_dir: str) -> tuple:
    """({payload: set of link paths}, complete) from the links really in the cache: every
    ``<cache>/<folder>/blobs/<name>`` that is a symlink into the store, whatever the folder's name
    (more references only keep more). ``complete`` is False when a folder's blobs could not be
    listed: a payload may then be referenced by a link that was not seen."""
    refs = {}
    complete = True
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return refs, False
    for name in entries:
        if name in (".locks", SHARED_STORE_DIR) or name in IGNORED_NAMES:
            continue
        blobs = os.path.join(cache_dir, name, "blobs")
        try:
            it = os.scandir(blobs)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            complete = False
            continue
        with it:
            for entry in it:
                try:
                    if not entry.is_symlink():
                        continue
                except OSError:
                    continue
                payload = link_payload(cache_dir, entry.path)
                if payload:
                    refs.setdefault(payload, set()).add(entry.path)
    return refs, complete


def manifest_references(cache_dir: str, payload: str):
    """The links the payload's ``.refs`` names that still point to it (validated against the file
    system, as huggingface_hub's _read_valid_manifest_references does); an empty set when there is
    no manifest, None when one exists but cannot be read."""
    manifest = payload + ".refs"
    try:
        st = os.lstat(manifest)
    except FileNotFoundError:
        return set()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        with open(manifest, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    out = set()
    for line in lines:
        if not line or os.path.isabs(line) or ".." in line.split("/"):
            continue
        link = os.path.join(cache_dir, *line.split("/"))
        if os.path.islink(link) and link_payload(cache_dir, link) == payload:
            out.add(link)
    return out


def _payload_lock(payload: str):
    """The payload's ``.lock`` (the file huggingface_hub's _shared_blob_lock flocks for a publish,
    a link and a sweep of that hash) opened without following a link and flocked non-blocking:
    the fd, or None when someone holds it."""
    fd = os.open(payload + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", payload + ".lock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return fd


def _unlink_held(path: str, fd: int) -> None:
    """Unlink the lock file ``path`` we hold as ``fd`` (only if it is still that file)."""
    try:
        if os.path.samestat(os.lstat(path), os.fstat(fd)):
            os.unlink(path)
    except FileNotFoundError:
        pass


def remove_shared_payload(cache_dir: str, payload: str, links=()) -> tuple:
    """Remove one payload of the shared store, with its ``.refs`` and ``.lock``, only if no link
    in the cache references it. ``links`` are the links shared_references() found to it (made
    before: each is checked again); the manifest's are read under the payload's lock, which every
    publish and link of huggingface_hub holds while it adds a reference. Returns (removed bytes,
    why it stays: '' when removed or already gone). Raises OSError when an unlink fails.

    The payload must be exactly ``<cache>/blobs/<xx>/<hash>`` of a marked store, reached through no
    symlink (its folder's real path is its folder) and a regular file: nothing else is unlinked.
    """
    cache_dir = os.path.normpath(cache_dir)
    if shared_payload_path(cache_dir, payload) != os.path.normpath(payload):
        return 0, "it is not a payload path of the shared store %s" % shared_store_dir(cache_dir)
    if not is_shared_store(cache_dir):
        return 0, "%s is not a marked shared store" % shared_store_dir(cache_dir)
    folder = os.path.dirname(payload)
    if os.path.realpath(folder) != folder:
        return 0, "its folder is reached through a symlink (it resolves to %s)" % os.path.realpath(folder)
    if not os.path.lexists(payload) and not os.path.lexists(payload + ".lock"):
        return 0, ""
    fd = _payload_lock(payload)
    if fd is None:
        return 0, "huggingface_hub holds its lock (a download publishes or links it)"
    try:
        try:
            st = os.lstat(payload)
        except FileNotFoundError:
            # swept already (huggingface_hub's sweep keeps the .lock): the lock goes once the
            # manifest is gone too
            if not os.path.lexists(payload + ".refs"):
                _unlink_held(payload + ".lock", fd)
            return 0, ""
        if not stat.S_ISREG(st.st_mode):
            return 0, "it is not a regular file"
        live = sorted(link for link in links if link_payload(cache_dir, link) == payload)
        if live:
            return 0, "%s still links to it" % live[0]
        manifest = manifest_references(cache_dir, payload)
        if manifest is None:
            return 0, "its manifest %s.refs cannot be read" % payload
        if manifest:
            return 0, "%s still links to it" % sorted(manifest)[0]
        os.unlink(payload)
        try:
            os.unlink(payload + ".refs")
        except FileNotFoundError:
            pass
        _unlink_held(payload + ".lock", fd)
        return st.st_size, ""
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _shared_modes(cache_dir: str) -> tuple:
    """(payload mode, folder mode) as huggingface_hub's _shared_blob_mode and
    _shared_directory_mode give them: read-only payloads, readable by whoever may traverse the
    cache root; folders with the cache root's own bits."""
    cache_mode = stat.S_IMODE(os.stat(cache_dir).st_mode)
    payload = 0o400 | (0o040 if cache_mode & stat.S_IXGRP else 0) | (0o004 if cache_mode & stat.S_IXOTH else 0)
    return payload, cache_mode & (0o777 | stat.S_ISGID | stat.S_ISVTX)


def _ensure_shared_store(cache_dir: str, modes: tuple) -> str:
    """Make ``<cache>/blobs`` the marked shared store if it does not exist yet ('' when it is one
    now), as huggingface_hub's first Xet download does; a folder that exists unmarked is not
    adopted (the reason). ``modes``: _shared_modes(cache_dir)."""
    if is_shared_store(cache_dir):
        return ""
    folder = shared_store_dir(cache_dir)
    try:
        os.mkdir(folder, modes[1])
    except FileExistsError:
        return "%s exists and is not a marked shared store" % folder
    marker = os.path.join(folder, SHARED_STORE_MARKER)
    tmp = "%s.%08x.tmp" % (marker, os.getpid() & 0xFFFFFFFF)
    with open(tmp, "x", encoding="utf-8") as fh:
        fh.write(SHARED_STORE_LAYOUT)
    os.chmod(tmp, modes[0])
    os.replace(tmp, marker)
    return "" if is_shared_store(cache_dir) else "%s could not be marked" % folder


def publish_shared_payload(cache_dir: str, blob: str, xet_hash: str) -> tuple:
    """Move the verified regular repo blob ``blob`` (``<cache>/<repo folder>/blobs/<name>``) into
    the cache-wide shared store as ``blobs/<xx>/<xet_hash>`` and leave a relative link in its
    place, the layout huggingface_hub's Xet downloads make (its publish_blob_to_shared_store:
    the reference appended to ``<hash>.refs`` before the link shows, under ``<hash>.lock``). The
    file keeps its inode (a rename), so what vouched for it still does.

    Returns (payload path, '') when published, (None, why) when the blob stays this repo's own
    regular file, which huggingface_hub reads as well: the store cannot be made, someone holds the
    payload's lock, or the store already has that payload (another repo's, whose links and
    manifests vouch for that inode: it is neither replaced nor trusted for this one)."""
    cache_dir = os.path.normpath(cache_dir)
    if not XET_HASH_RE.match(xet_hash or ""):
        return None, "%r is not a xet hash" % (xet_hash,)
    relative = os.path.relpath(blob, cache_dir).replace(os.sep, "/")
    parts = relative.split("/")
    if len(parts) != 3 or parse_repo_folder(parts[0]) is None or parts[1] != "blobs" or not _is_reg(blob):
        return None, "%s is not a regular repo blob of the cache %s" % (blob, cache_dir)
    payload_mode, folder_mode = modes = _shared_modes(cache_dir)
    why = _ensure_shared_store(cache_dir, modes)
    if why:
        return None, why
    prefix = os.path.join(shared_store_dir(cache_dir), xet_hash[:2])
    try:
        os.mkdir(prefix, folder_mode)
    except FileExistsError:
        pass
    if not _is_dir(prefix):
        return None, "%s is not a folder" % prefix
    payload = os.path.join(prefix, xet_hash)
    fd = _payload_lock(payload)
    if fd is None:
        return None, "huggingface_hub holds the lock of %s (a download publishes or links it)" % payload
    link = None
    try:
        if os.path.lexists(payload):
            return None, "the shared store already has %s (another repo's)" % payload
        manifest = os.open(payload + ".refs", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            if not stat.S_ISREG(os.fstat(manifest).st_mode):
                return None, "%s.refs is not a regular file" % payload
            line = (relative + "\n").encode()
            if os.write(manifest, line) != len(line):
                return None, "%s.refs could not be written" % payload
            os.fsync(manifest)
        finally:
            os.close(manifest)
        link = os.path.join(os.path.dirname(blob), ".%s.%s.shared" % (os.path.basename(blob), secrets.token_hex(4)))
        os.symlink(os.path.relpath(payload, os.path.dirname(blob)), link)
        os.chmod(blob, payload_mode)
        os.replace(blob, payload)
        try:
            os.replace(link, blob)
        except OSError:
            os.replace(payload, blob)       # back as it was: the blob is never lost
            raise
        link = None
        return payload, ""
    finally:
        if link is not None and os.path.lexists(link):
            os.unlink(link)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


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
# scanning
# --------------------------------------------------------------------------------------------
def _record(store: Store, st, bucket: list) -> None:
    key = (st.st_dev, st.st_ino)
    if key not in store.inodes:
        mode = st.st_mode
        nlink = 1 if stat.S_ISDIR(mode) else st.st_nlink
        store.inodes[key] = [allocated(st), nlink, st.st_size, stat.S_ISREG(mode)]
    bucket.append(key)


def _walk_all(store: Store, path: str, bucket: list) -> tuple:
    """Record every inode under ``path`` (not following links); return (apparent size, files, atime)."""
    size = files = 0
    last = 0.0
    stack = [path]
    while stack:
        cur = stack.pop()
        try:
            it = os.scandir(cur)
        except OSError as exc:
            store.warnings.append("cannot list %s: %s" % (cur, exc.strerror))
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                _record(store, st, bucket)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
                elif stat.S_ISREG(st.st_mode):
                    size += st.st_size
                    files += 1
                    last = max(last, st.st_atime)
    return size, files, last


def _scan_snapshot(store: Store, repo: CacheRepo, rev: Revision, blobs_dir: str) -> None:
    # The hot loop of a scan (one iteration per snapshot file): inlined record, and links resolved
    # by their expected "../" depth before falling back to path normalisation.
    bucket = repo.parts[("snap", rev.commit)]
    append = bucket.append
    inodes = store.inodes
    blobs = repo.blobs
    rev_blobs = rev.blobs
    prefix = blobs_dir + os.sep
    readlink = os.readlink
    S_ISDIR, S_ISLNK, S_ISREG = stat.S_ISDIR, stat.S_ISLNK, stat.S_ISREG
    files = 0
    stack = [(rev.path, "../../blobs/")]
    while stack:
        cur, rel_prefix = stack.pop()
        cut = len(rel_prefix)
        try:
            it = os.scandir(cur)
        except OSError as exc:
            repo.problems.append("cannot list %s: %s" % (cur, exc.strerror))
            continue
        with it:
            for entry in it:
                if entry.name in IGNORED_NAMES:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                mode = st.st_mode
                if key not in inodes:
                    inodes[key] = [st.st_blocks * 512, 1 if S_ISDIR(mode) else st.st_nlink,
                                   st.st_size, S_ISREG(mode)]
                append(key)
                if S_ISDIR(mode):
                    stack.append((entry.path, "../" + rel_prefix))
                    continue
                files += 1
                if not S_ISLNK(mode):
                    continue
                target = readlink(entry.path)
                if target.startswith(rel_prefix) and "/" not in target[cut:]:
                    name = target[cut:]
                else:
                    if not os.path.isabs(target):
                        target = os.path.join(cur, target)
                    target = os.path.normpath(target)
                    if target.startswith(prefix) and os.sep not in target[len(prefix):]:
                        name = target[len(prefix):]
                    else:
                        rev.foreign_links.append("%s -> %s" % (entry.path, target))
                        payload = shared_payload_path(store.cache_dir, target) if store.cache_dir else None
                        if payload and store.shared_marked() and os.path.exists(payload):
                            rev.store_links.append((entry.path, payload))
                        continue
                if name in blobs:
                    rev_blobs.add(name)
                else:
                    rev.broken_links.append(entry.path)
    rev.files += files


def _shared_target(cache_dir: str, link_target: str, link_dir: str):
    """The shared-store payload a repo blob link points to, or None."""
    target = link_target if os.path.isabs(link_target) else os.path.join(link_dir, link_target)
    target = os.path.normpath(target)
    store_dir = os.path.join(cache_dir, "blobs")
    rel = os.path.relpath(target, store_dir)
    parts = rel.split(os.sep)
    if len(parts) == 2 and XET_HASH_RE.match(parts[1]) and parts[0] == parts[1][:2]:
        return target
    return None


def _add_payload(store: Store, payload: str, st=None) -> SharedPayload:
    """Record a payload of the shared store with its .refs and .lock (caller holds _SHARED_LOCK)."""
    keys = []
    if st is None:
        st = os.lstat(payload)
    _record(store, st, keys)
    for extra in (".refs", ".lock"):
        try:
            _record(store, os.lstat(payload + extra), keys)
        except OSError:
            pass
    sp = SharedPayload(payload, st.st_size, keys)
    store.shared[payload] = sp
    return sp


def scan_repo(store: Store, path: str, folder: str) -> CacheRepo:
    parsed = parse_repo_folder(folder)
    repo = CacheRepo(folder=folder, repo_type=parsed[0], repo_id=parsed[1], path=path)
    rest = repo.parts[("rest",)]
    st = os.lstat(path)
    _record(store, st, rest)
    blobs_dir = os.path.join(path, "blobs")
    shared_store = store.shared_marked()
    snapshots = []
    with os.scandir(path) as top:
        entries = list(top)
    for entry in entries:
        est = entry.stat(follow_symlinks=False)
        if entry.name == "blobs" and stat.S_ISDIR(est.st_mode):
            _record(store, est, rest)
            with os.scandir(entry.path) as it:
                for b in it:
                    bst = b.stat(follow_symlinks=False)
                    if b.name.endswith(".incomplete"):
                        bucket = repo.parts[("orphan", b.path)]
                        _record(store, bst, bucket)
                        repo.orphans.append(Orphan(path=b.path, folder=folder,
                                                   etag=b.name.split(".", 1)[0], size=bst.st_size,
                                                   bytes=allocated(bst), mtime=bst.st_mtime))
                        continue
                    bucket = repo.parts[("blob", b.name)]
                    _record(store, bst, bucket)
                    size, atime, mtime, shared = bst.st_size, bst.st_atime, bst.st_mtime, ""
                    if stat.S_ISLNK(bst.st_mode):
                        target = os.readlink(b.path)
                        payload = _shared_target(store.cache_dir, target, entry.path) if shared_store else None
                        try:
                            pst = os.stat(b.path)
                        except OSError:
                            repo.problems.append("blob link %s is broken" % b.path)
                            continue
                        size, atime, mtime = pst.st_size, pst.st_atime, pst.st_mtime
                        if payload:
                            shared = payload
                            with _SHARED_LOCK:
                                sp = store.shared.get(payload) or _add_payload(store, payload, pst)
                                sp.links.add((folder, b.name))
                        else:
                            repo.problems.append("blob %s links outside the cache: %s" % (b.path, target))
                    elif stat.S_ISDIR(bst.st_mode):
                        _walk_all(store, b.path, bucket)
                        continue
                    repo.blobs[b.name] = Blob(b.name, size, atime, mtime, shared)
        elif entry.name == "snapshots" and stat.S_ISDIR(est.st_mode):
            _record(store, est, rest)
            with os.scandir(entry.path) as it:
                for s in it:
                    if s.name in IGNORED_NAMES:
                        _record(store, s.stat(follow_symlinks=False), rest)
                        continue
                    sst = s.stat(follow_symlinks=False)
                    if not stat.S_ISDIR(sst.st_mode):
                        _record(store, sst, rest)
                        repo.problems.append("snapshots folder holds a file: %s" % s.path)
                        continue
                    rev = Revision(commit=s.name, path=s.path)
                    _record(store, sst, repo.parts[("snap", s.name)])
                    repo.revisions[s.name] = rev
                    snapshots.append(rev)
        elif entry.name == "refs" and stat.S_ISDIR(est.st_mode):
            _record(store, est, rest)
            stack = [entry.path]
            while stack:
                cur = stack.pop()
                with os.scandir(cur) as it:
                    for r in it:
                        rst = r.stat(follow_symlinks=False)
                        if stat.S_ISDIR(rst.st_mode):
                            _record(store, rst, rest)
                            stack.append(r.path)
                            continue
                        name = os.path.relpath(r.path, entry.path).replace(os.sep, "/")
                        if r.name in IGNORED_NAMES:
                            _record(store, rst, rest)
                            continue
                        _record(store, rst, repo.parts[("ref", name)])
                        try:
                            with open(r.path, encoding="utf-8") as fh:
                                repo.refs[name] = fh.read()
                        except (OSError, UnicodeDecodeError):
                            repo.problems.append("ref %s is unreadable" % r.path)
        # per-commit metadata: huggingface_hub's tree listings and missing-file markers, and
        # hf_snapshot's manifests (modelswap/<commit>.json); each goes with its revision
        elif entry.name in ("trees", ".no_exist", "modelswap") and stat.S_ISDIR(est.st_mode):
            _record(store, est, rest)
            with os.scandir(entry.path) as it:
                for t in it:
                    tst = t.stat(follow_symlinks=False)
                    commit = t.name[:-5] if entry.name != ".no_exist" and t.name.endswith(".json") else t.name
                    bucket = repo.parts[("meta", commit)] if COMMIT_RE.match(commit) else rest
                    _record(store, tst, bucket)
                    if bucket is not rest:
                        repo.meta[commit].append((t.path, (tst.st_dev, tst.st_ino),
                                                  stat.S_ISDIR(tst.st_mode)))
                    if stat.S_ISDIR(tst.st_mode):
                        _walk_all(store, t.path, bucket)
        else:
            _record(store, est, rest)
            if stat.S_ISDIR(est.st_mode):
                _walk_all(store, entry.path, rest)
    for rev in snapshots:
        _scan_snapshot(store, repo, rev, blobs_dir)
        for link, payload in rev.store_links:
            with _SHARED_LOCK:
                sp = store.shared.get(payload) or _add_payload(store, payload)
                sp.links.add((folder, "snapshot:" + link))
        if rev.broken_links:
            repo.problems.append("revision %s has %d broken link(s), e.g. %s"
                                 % (rev.commit, len(rev.broken_links), rev.broken_links[0]))
    if not os.path.isdir(os.path.join(path, "snapshots")):
        repo.problems.append("no snapshots folder in %s" % path)
    for ref, commit in repo.refs.items():
        if commit in repo.revisions:
            repo.revisions[commit].refs.add(ref)
        else:
            repo.problems.append("ref %s points to a missing revision %s" % (ref, commit))
    locks = os.path.join(store.cache_dir, ".locks", folder)
    if os.path.isdir(locks) and not os.path.islink(locks):
        lock_bucket = repo.parts[("locks",)]
        _record(store, os.lstat(locks), lock_bucket)
        _walk_all(store, locks, lock_bucket)
    return repo


def scan_plain_dir(store: Store, path: str, name: str) -> PlainDir:
    st = os.lstat(path)
    d = PlainDir(name=name, path=path, is_link=stat.S_ISLNK(st.st_mode))
    bucket = d.parts[("rest",)]
    _record(store, st, bucket)
    if not d.is_link:
        d.size, d.files, d.last_used = _walk_all(store, path, bucket)
    return d


def _scan_repo_safe(store: Store, path: str, folder: str):
    try:
        return scan_repo(store, path, folder)
    except OSError as exc:
        store.warnings.append("cannot scan %s: %s" % (path, exc))
        return None


def scan_store(cache_dir: str = "", models_dir: str = "", workers: int = 1) -> Store:
    """Scan a hub cache and/or a folder of plain model directories (absolute, existing dirs).

    Repos are scanned by ``workers`` threads. File system calls release the GIL, so threads pay on
    a cold cache (50k files: 7.1 s -> 4.0 s with 8 threads here) and cost on a warm one (0.85 s ->
    1.6 s, GIL contention): one thread is the default.
    """
    store = Store(cache_dir=cache_dir or "", models_dir=models_dir or "")
    if cache_dir:
        for payload in store_payloads(cache_dir):   # those no link references too
            try:
                _add_payload(store, payload)
            except OSError:
                continue
        with os.scandir(cache_dir) as it:
            entries = sorted(it, key=lambda e: e.name)
        todo = []
        for entry in entries:
            if entry.name in (".locks", "blobs", "CACHEDIR.TAG") or entry.name in IGNORED_NAMES:
                continue
            if parse_repo_folder(entry.name) is None or not entry.is_dir(follow_symlinks=False):
                store.warnings.append("not a cache repo, left alone: %s" % entry.path)
                continue
            todo.append((entry.path, entry.name))
        if workers > 1 and len(todo) > 1:
            with ThreadPoolExecutor(max_workers=min(workers, len(todo))) as pool:
                scanned = list(pool.map(lambda t: _scan_repo_safe(store, *t), todo))
        else:
            scanned = [_scan_repo_safe(store, *t) for t in todo]
        for (path, folder), repo in zip(todo, scanned):
            if repo is not None:
                store.repos[folder] = repo
    if models_dir:
        with os.scandir(models_dir) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if cache_dir and is_within(cache_dir, entry.path):
                continue  # the hub cache lives inside the models folder: it is not a model
            if not (entry.is_dir(follow_symlinks=False) or entry.is_symlink()):
                continue
            store.dirs[entry.name] = scan_plain_dir(store, entry.path, entry.name)
    return store


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


# --------------------------------------------------------------------------------------------
# the delete plan: exactly the paths a purge unlinks, checked again right before it does
# --------------------------------------------------------------------------------------------
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
        "meta": {c: sorted((p, k) for p, k, _ in entries) for c, entries in repo.meta.items()},
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
