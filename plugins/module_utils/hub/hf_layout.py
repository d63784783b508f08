# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Where a snapshot download lies on disk: a hub cache (``CacheLayout``: blobs named by etag,
snapshot links) or a plain folder (``LocalDirLayout``), where each file and lock goes, how a bad
file is removed without touching what another revision still uses, and the checks before writing
(a path confined to its folder, free space, a writable destination).
"""
from __future__ import annotations

import os

from ansible_collections.modelswap.vllm.plugins.module_utils.common import hub_trust
from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import listed, nearest_existing
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_errors import FetchError
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.store import xet_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import COMMIT_RE, repo_folder_name

REPO_LOCK_NAME = "modelswap.lock"                 # in <cache>/.locks/<repo folder>/
LOCAL_LOCK_NAME = ".modelswap-download.lock"       # in <local_dir>/.cache/huggingface/download/


class CacheLayout:
    """A Hugging Face hub cache: blobs named by etag, snapshots/<commit>/<path> symlinks."""

    kind = "cache"

    def __init__(self, cache_dir: str, repo_id: str):
        self.root = cache_dir
        self.repo_id = repo_id
        self.folder = repo_folder_name(repo_id)
        self.repo_path = os.path.join(cache_dir, self.folder)
        self.meta_root = self.repo_path
        self.tree_roots = (self.repo_path,)
        self.lock_dir = os.path.join(cache_dir, ".locks", self.folder)
        self.lock_path = os.path.join(self.lock_dir, REPO_LOCK_NAME)
        self.kept = []

    def snapshot(self, commit: str) -> str:
        return os.path.join(self.repo_path, "snapshots", commit)

    def locate(self, commit: str, path: str) -> str:
        return os.path.join(self.snapshot(commit), *path.split("/"))

    def blob(self, entry: dict) -> str:
        return os.path.join(self.repo_path, "blobs", entry.get("lfs_sha256") or entry["blob_id"])

    def unit(self, path: str, entry: dict) -> str:
        return entry.get("lfs_sha256") or entry["blob_id"]

    def present(self, commit: str, path: str, entry: dict) -> bool:
        return os.path.exists(self.locate(commit, path))

    def needs_transfer(self, commit: str, path: str, entry: dict) -> bool:
        return not os.path.exists(self.blob(entry))

    def name_problem(self, commit: str, path: str, entry: dict) -> str:
        """A pointer that leads to a blob of another name: stored under a wrong ETag."""
        pointer = self.locate(commit, path)
        if not os.path.islink(pointer):
            return ""
        target = os.path.basename(os.readlink(pointer))
        expected = entry.get("lfs_sha256") or entry["blob_id"]
        if target != expected:
            return "stored as blob %s, expected %s (a wrong ETag)" % (target, expected)
        return ""

    def remove(self, commit: str, path: str, entry: dict) -> list:
        """Delete a bad file: its snapshot link and the blob it leads to (within this repo).

        A blob that another snapshot link leads to, or that another commit's verified manifest
        lists, is kept (``self.kept``): a wrong ETag can name a good blob of a served revision, or
        a file can share its content. Nothing outside the repository folder is ever unlinked.
        """
        removed = []
        pointer = self.locate(commit, path)
        blobs_dir = os.path.join(self.repo_path, "blobs") + os.sep
        targets = [self.blob(entry)]
        if os.path.islink(pointer):
            target = os.path.normpath(os.path.join(os.path.dirname(pointer), os.readlink(pointer)))
            if target.startswith(blobs_dir) and target not in targets:
                targets.append(target)
        for p in [pointer] + targets:
            confine(p, self.repo_path, self.repo_id)
        if os.path.lexists(pointer):
            os.unlink(pointer)
            removed.append(pointer)
        users = self.blob_users(commit)
        for p in targets:
            name = os.path.basename(p)
            if name in users:
                self.kept.append({"blob": name, "because": users[name]})
                continue
            payload = xet_store.link_payload(self.root, p) if os.path.islink(p) else None
            if os.path.lexists(p):
                os.unlink(p)
                removed.append(p)
            if payload:
                removed += self._remove_payload(payload)
        return removed

    def _remove_payload(self, payload: str) -> list:
        """A bad blob that linked into the shared (Xet) store: hf_xet checks sizes only, so its
        payload holds the same wrong bytes under the right name, and huggingface_hub would link it
        again on the retry. It goes when no other link in the cache still reaches it."""
        links = xet_store.shared_references(self.root)[0].get(payload, ())
        gone, why = xet_store.remove_shared_payload(self.root, payload, links)
        if why and os.path.lexists(payload):
            self.kept.append({"blob": os.path.basename(payload), "because": why})
            return []
        return [payload] if gone or not os.path.lexists(payload) else []

    def blob_users(self, commit: str) -> dict:
        """{blob name: why it must stay}: blobs that snapshot links lead to, and blobs that the
        verified manifests of other commits list (their links may be gone, their record is not)."""
        users = {}
        blobs_dir = os.path.join(self.repo_path, "blobs")
        snapshots = os.path.join(self.repo_path, "snapshots")
        for dirpath, dirs, files in os.walk(snapshots):
            for name in files + dirs:
                link = os.path.join(dirpath, name)
                if not os.path.islink(link):
                    continue
                try:
                    target = os.path.normpath(os.path.join(dirpath, os.readlink(link)))
                except OSError:
                    continue
                if os.path.dirname(target) == blobs_dir:
                    rel = os.path.relpath(link, snapshots).split(os.sep, 1)
                    users.setdefault(os.path.basename(target), "snapshot %s links to it (%s)"
                                     % (rel[0][:12], rel[-1].replace(os.sep, "/")))
        directory = os.path.join(self.meta_root, "modelswap")
        for name in listed(directory):
            other = name[:-5]
            if not name.endswith(".json") or other == commit or not COMMIT_RE.match(other):
                continue
            manifest = hf_manifest.read_manifest(os.path.join(directory, name), self.repo_id, other)
            if manifest is None:
                continue
            listing = manifest["listing"]
            for fpath in manifest["files"]:
                info = listing.get(fpath)
                if isinstance(info, dict):
                    blob = info.get("lfs_sha256") or info.get("blob_id")
                    if isinstance(blob, str):
                        users.setdefault(blob, "the verified manifest of %s lists it (%s)" % (other[:12], fpath))
        return users

    def read_ref(self, revision: str):
        try:
            with open(os.path.join(self.repo_path, "refs", *revision.split("/")), encoding="utf-8") as fh:
                ref = fh.read().strip()
        except OSError:
            return None
        return ref if COMMIT_RE.match(ref) else None

    def download_args(self) -> dict:
        return {"cache_dir": self.root}

    def extra_files(self, wanted: dict, limit: int = 20) -> list:
        return []


class LocalDirLayout:
    """A plain folder (``local_dir``): files in place, huggingface_hub's metadata under .cache/."""

    kind = "local_dir"

    def __init__(self, local_dir: str, repo_id: str):
        self.root = local_dir
        self.repo_id = repo_id
        self.kept = []
        self.meta_root = os.path.join(local_dir, ".cache", "huggingface")
        self.tree_roots = (self.meta_root,)
        self.lock_dir = os.path.join(self.meta_root, "download")
        self.lock_path = os.path.join(self.lock_dir, LOCAL_LOCK_NAME)

    def snapshot(self, commit: str) -> str:
        return self.root

    def locate(self, commit: str, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    def unit(self, path: str, entry: dict) -> str:
        return path

    def present(self, commit: str, path: str, entry: dict) -> bool:
        return os.path.isfile(self.locate(commit, path))

    def needs_transfer(self, commit: str, path: str, entry: dict) -> bool:
        return True

    def name_problem(self, commit: str, path: str, entry: dict) -> str:
        return ""

    def metadata(self, path: str) -> str:
        return os.path.join(self.lock_dir, *path.split("/")) + ".metadata"

    def remove(self, commit: str, path: str, entry: dict) -> list:
        """Delete a bad file and huggingface_hub's metadata of it (never outside the local_dir)."""
        removed = []
        targets = (self.locate(commit, path), self.metadata(path))
        for p in targets:
            confine(p, self.root, self.repo_id)
        for p in targets:
            if os.path.lexists(p):
                os.unlink(p)
                removed.append(p)
        return removed

    def read_ref(self, revision: str):
        return None

    def download_args(self) -> dict:
        return {"local_dir": self.root}

    def extra_files(self, wanted: dict, limit: int = 20) -> list:
        """Files in the folder that the snapshot does not have (left by another commit or by hand)."""
        extra = []
        for dirpath, dirs, files in os.walk(self.root):
            if dirpath == self.root and ".cache" in dirs:
                dirs.remove(".cache")
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if rel not in wanted:
                    extra.append(rel)
                    if len(extra) >= limit:
                        return extra
        return extra


def confine(path: str, folder: str, repo_id: str) -> None:
    """FetchError unless ``path`` lies inside ``folder`` (resolved): the check before every unlink."""
    if not hub_trust.inside(path, folder):
        raise FetchError(
            "refusing to delete %s while cleaning a bad file of %s: it resolves outside %s (%s); "
            "nothing there was deleted; check for symlinks in that folder that lead elsewhere"
            % (path, repo_id, folder, os.path.realpath(path)), "unsafe_path")


def available_bytes(path: str) -> int:
    st = os.statvfs(nearest_existing(path))
    return st.f_bavail * st.f_frsize


def writable_problem(path: str, probe: bool) -> str:
    """Why files cannot be created under ``path`` ('' when they can).

    ``probe`` creates and removes a temporary file in the nearest existing folder (the only test
    that is right for root, read-only mounts and ACLs); without it (check mode) os.access decides.
    """
    base = nearest_existing(path)
    if not os.path.isdir(base):
        return "%s is not a directory" % base
    if not probe:
        if not os.access(base, os.W_OK | os.X_OK):
            return "%s is not writable by uid %d" % (base, os.getuid())
        try:
            if os.statvfs(base).f_flag & os.ST_RDONLY:
                return "%s is on a read-only file system" % base
        except OSError:
            pass
        return ""
    try:
        fd = os.open(os.path.join(base, ".modelswap-write-test.%d" % os.getpid()),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(os.path.join(base, ".modelswap-write-test.%d" % os.getpid()))
    except OSError as exc:
        return "cannot create files in %s (%s)" % (base, exc.strerror or exc)
    return ""
