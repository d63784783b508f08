# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""A pinned, verified, repeatable snapshot download with huggingface_hub (the logic of hf_snapshot).

huggingface_hub does every transfer (``HfApi`` for the revision and the file list,
``hf_hub_download`` per file, so its locks, Range resumes within a process, xet and cache layout
apply). Around it, ``SnapshotJob`` adds what an operator needs after hours of transfer
(docs/huggingface.md says why each is needed):

- the revision is resolved once to a commit and every file is fetched at that commit;
- allow/ignore patterns that select nothing are an error, not a silent success;
- one repository-wide lock (``RepoLock``) for the whole download; under it, partial files that
  killed runs left behind are removed, each only when nobody holds its per-file lock; a run that
  finds the lock held follows the holder while its progress moves (a download a killed
  controller left running is followed to its end, then only verified);
- each file is verified as soon as it lands, while others still download: sha256 for LFS files,
  git blob sha1 for the rest (hf_verify); a mismatch deletes the file and fetches it once more,
  then fails naming it;
- transient failures (connection errors, 408/429/5xx, short bodies) are retried per file with
  backoff; permanent ones (not found, gated, disk full, permissions) fail at once with a message
  that names the cause and the fix;
- a manifest of what was verified (hf_manifest) makes the next run an offline no-op.

huggingface_hub is imported lazily by ``load_hf`` after the environment it reads at import time
(xet, offline mode, timeouts) is set. ``HAS_HF`` says whether it is installed at all.
"""
from __future__ import annotations

import errno
import fcntl
import importlib.util
import json
import logging
import os
import re
import socket
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from ansible_collections.modelswap.vllm.plugins.module_utils.common.catalog import DEFAULT_REVISION
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_verify
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client
from ansible_collections.modelswap.vllm.plugins.module_utils.common import hub_trust
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_snapshot_progress import (
    HolderWatch, process_start, read_json_object)
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store.model_store import (
    COMMIT_RE,
    StoreError,
    repo_folder_name,
    validate_repo_id,
)
from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import (
    files_with_suffix, listed, nearest_existing)
from ansible_collections.modelswap.vllm.plugins.module_utils.store.store_locks import LockSet
from ansible_collections.modelswap.vllm.plugins.module_utils.store.store_locks import probe as probe_lock

try:
    HAS_HF = importlib.util.find_spec("huggingface_hub") is not None
except (ImportError, ValueError):  # pragma: no cover
    HAS_HF = False

REPO_LOCK_NAME = "modelswap.lock"                 # in <cache>/.locks/<repo folder>/
LOCAL_LOCK_NAME = ".modelswap-download.lock"       # in <local_dir>/.cache/huggingface/download/
DEFAULT_ENDPOINT = hub_client.DEFAULT_ENDPOINT
_CONTENTION = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
MAX_BACKOFF_S = 60.0
CHUNK_SIZE = 1024 * 1024


class FetchError(Exception):
    """A failure whose message is final (what, where, why, what to do)."""

    def __init__(self, msg: str, cause: str = "error", transient: bool = False):
        super().__init__(msg)
        self.cause = cause
        self.transient = transient

    @classmethod
    def from_hub(cls, err: hub_client.HubError) -> "FetchError":
        """The job's error for a HubError (its kind is the cause)."""
        return cls(str(err), err.kind, err.transient)


class Cancelled(Exception):
    """The job is stopping after another failure."""


# --------------------------------------------------------------------------------------------
# huggingface_hub, imported late
# --------------------------------------------------------------------------------------------
class HF:
    """The parts of huggingface_hub the job uses (one import, after the environment is set)."""

    def __init__(self):
        import huggingface_hub
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub import constants
        from huggingface_hub import errors
        from huggingface_hub.hf_api import RepoFile

        self.version = huggingface_hub.__version__
        self.HfApi = HfApi
        self.hf_hub_download = hf_hub_download
        self.constants = constants
        self.errors = errors
        self.RepoFile = RepoFile
        try:
            from huggingface_hub.file_download import get_hf_file_metadata
        except ImportError:  # pragma: no cover
            get_hf_file_metadata = None
        self.get_hf_file_metadata = get_hf_file_metadata
        try:
            from huggingface_hub import hf_hub_url
        except ImportError:  # pragma: no cover
            hf_hub_url = None
        self.hf_hub_url = hf_hub_url


def hf_environment(*, use_xet: bool, offline: bool, timeout: float) -> dict:
    """The variables huggingface_hub reads at import time, for this job."""
    env = {
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_ETAG_TIMEOUT": str(int(timeout)),
        "HF_HUB_DOWNLOAD_TIMEOUT": str(int(timeout)),
        "HF_HUB_OFFLINE": "1" if offline else "0",
    }
    if not use_xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    return env


def load_hf(*, use_xet: bool, offline: bool, timeout: float) -> HF:
    os.environ.update(hf_environment(use_xet=use_xet, offline=offline, timeout=timeout))
    hf = HF()
    # huggingface_hub reads HTTP bodies in DOWNLOAD_CHUNK_SIZE pieces (10 MiB): progress moves and a
    # dropped connection resumes only at that granularity. 1 MiB gives ten times finer progress and
    # resumes, and costs no throughput (it copies less; tests/bench/bench_hf_snapshot.py).
    if getattr(hf.constants, "DOWNLOAD_CHUNK_SIZE", 0) > CHUNK_SIZE:
        hf.constants.DOWNLOAD_CHUNK_SIZE = CHUNK_SIZE
    return hf


class _LibraryLog(logging.Handler):
    """Keeps huggingface_hub's warnings (retries, resumes) for the result instead of stderr."""

    def __init__(self, limit: int = 30):
        super().__init__(logging.WARNING)
        self.limit = limit
        self.lines = []
        self.dropped = 0

    def emit(self, record):
        try:
            line = record.getMessage()
        except Exception:  # pragma: no cover
            return
        self.note(line)

    def note(self, line: str) -> None:
        line = " ".join(str(line).split())[:300]
        if len(self.lines) < self.limit:
            self.lines.append(line)
        else:
            self.dropped += 1


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
# hf_xet reports a failed write of this host as a RuntimeError that carries Rust's io::Error text:
# "File reconstruction error: IO Error: No space left on device (os error 28)"
RUST_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")


def os_errno(exc):
    """The errno of an OSError, or of an I/O error hf_xet raised as a RuntimeError; else None."""
    if isinstance(exc, OSError):
        return exc.errno
    if isinstance(exc, RuntimeError):
        found = RUST_OS_ERROR_RE.findall(str(exc))
        return int(found[-1]) if found else None
    return None


def classify(exc, hf, *, repo_id: str, revision: str, where: str, token_given: bool,
             what: str, dest: str = "") -> FetchError:
    """A FetchError for an exception raised while doing ``what``: the Hub's failures as
    hub_client classifies them, this host's (a full disk, a folder it cannot write) here."""
    def local(e):
        code = os_errno(e)
        if code in (errno.ENOSPC, errno.EDQUOT):
            return FetchError(
                "%s: the disk is full (%s) under %s; free space (disk_plan proposes what to purge, "
                "model_purge removes it) or choose another cache_dir/local_dir, then run again"
                % (what, os.strerror(code), dest or "the destination"), "disk_full")
        if code in (errno.EACCES, errno.EPERM, errno.EROFS):
            return FetchError(
                "%s: cannot write under %s (%s); make it writable for uid %d or choose another "
                "destination" % (what, dest or "the destination", os.strerror(code), os.getuid()),
                "not_writable")
        return None

    if isinstance(exc, FetchError):
        return exc
    err = hub_client.classify(exc, getattr(hf, "errors", None), repo_id=repo_id, revision=revision, where=where,
                              token_given=token_given, what=what, local=local)
    return err if isinstance(err, FetchError) else FetchError.from_hub(err)


# --------------------------------------------------------------------------------------------
# where things are on disk
# --------------------------------------------------------------------------------------------
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
            payload = model_store.link_payload(self.root, p) if os.path.islink(p) else None
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
        links = model_store.shared_references(self.root)[0].get(payload, ())
        gone, why = model_store.remove_shared_payload(self.root, payload, links)
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


# --------------------------------------------------------------------------------------------
# locks and orphans
# --------------------------------------------------------------------------------------------
def read_lock_record(path: str):
    """What a repository lock's file says of its holder (a dict), or None (free, or being written)."""
    info = read_json_object(path)
    return info if info and info.get("pid") else None


def describe_holder(info) -> str:
    """A lock record as a sentence: ``pid 12 on gpu-a01 since <time>, run <id>``."""
    if not isinstance(info, dict) or not info.get("pid"):
        return "another process"
    text = "pid %s on %s since %s" % (info.get("pid"), info.get("host"), info.get("since"))
    return text + (", run %s" % info["run"] if info.get("run") else "")


def lock_in_flight(path: str, host=None, start_of=process_start, probe=probe_lock):
    """Who holds the repository lock ``path`` now ({pid, host, since, run}), or None when nobody does.

    Read-only: a holder on this host is judged by its record (its pid alive with its start time; a
    killed one leaves its record behind), any other (a shared store, a record without a start time)
    by a non-blocking flock taken and dropped at once.
    """
    info = read_lock_record(path)
    if info is None:
        return None
    here = socket.gethostname() if host is None else host
    if info.get("host") == here and info.get("pid_start") is not None and isinstance(info["pid"], int):
        live = start_of(info["pid"]) == info["pid_start"]
    else:
        live = probe(path) is True
    return {key: info.get(key) for key in ("pid", "host", "since", "run")} if live else None


class RepoLock:
    """An exclusive flock on one file, held for a whole download; tells who holds it.

    The file holds the holder's record: pid and its start time (a reused pid is not the holder),
    host, since, and its run id and progress file when it has them (a waiting run follows them).
    """

    def __init__(self, path: str, run: str = "", progress_file: str = ""):
        self.path = path
        self.run = run
        self.progress_file = progress_file
        self.fd = None
        self.seen = None        # the last holder record read while waiting

    def info(self):
        return read_lock_record(self.path)

    def holder(self) -> str:
        return describe_holder(self.info() or self.seen)

    def acquire(self, timeout: float, poll: float = 0.5, on_wait=None, keep_waiting=None) -> bool:
        """Take the lock; while another process holds it, wait ``timeout`` seconds, or, with
        ``keep_waiting`` (asked with the holder's record at every poll), as long as it says so."""
        deadline = time.monotonic() + max(0.0, timeout)
        waited = False
        while True:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o664)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _CONTENTION:
                    raise
                self.seen = self.info() or self.seen
                if keep_waiting is not None:
                    if not keep_waiting(self.seen):
                        return False
                elif time.monotonic() >= deadline:
                    return False
                if on_wait is not None and not waited:
                    on_wait(self.holder())
                waited = True
                time.sleep(poll)
                continue
            st = os.fstat(fd)
            try:
                cur = os.stat(self.path)
            except FileNotFoundError:
                cur = None
            if st.st_nlink == 0 or cur is None or (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)   # unlinked or replaced while we waited: lock the file that is there now
                continue
            record = {"pid": os.getpid(), "pid_start": process_start(os.getpid()), "host": socket.gethostname(),
                      "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            if self.run:
                record["run"] = self.run
            if self.progress_file:
                record["progress_file"] = self.progress_file
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
            self.fd = fd
            return True

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None


def _unlink_counted(path: str, removed: list) -> None:
    """Delete an orphan and note (path, bytes); one already gone is not an error."""
    size = _size(path)
    try:
        os.unlink(path)
        removed.append((path, size))
    except FileNotFoundError:
        pass


def _incompletes(directory: str, recursive: bool) -> list:
    return files_with_suffix(directory, ".incomplete", recursive)


def _lock_names(directory: str, skip: str) -> list:
    names = []
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            path = os.path.join(dirpath, name)
            if name.endswith(".lock") and path != skip and not os.path.islink(path):
                names.append(os.path.relpath(path, directory))
    return sorted(names)


def clean_orphans(layout) -> tuple:
    """Remove partial files of killed runs: ([(path, bytes)] removed, [path] left because busy).

    Call only while holding the repository lock. Cache: ``blobs/<etag>.<random>.incomplete`` goes
    when its lock ``.locks/<folder>/<etag>.lock`` can be taken (nobody downloads that blob now).
    local_dir: the partial files under ``.cache/huggingface/download`` go only when no per-file
    lock there is held (their lock names cannot be derived from the partial file's name).
    """
    removed, busy = [], []
    if layout.kind == "cache":
        orphans = _incompletes(os.path.join(layout.repo_path, "blobs"), recursive=False)
        if not orphans:
            return removed, busy
        holder = LockSet(layout.lock_dir)
        try:
            for path in orphans:
                etag = os.path.basename(path).split(".", 1)[0]
                if not holder.acquire(etag + ".lock"):
                    busy.append(path)
                    continue
                _unlink_counted(path, removed)
        finally:
            holder.release()
        return removed, busy
    orphans = _incompletes(layout.lock_dir, recursive=True)
    if not orphans:
        return removed, busy
    holder = LockSet(layout.lock_dir)
    try:
        for name in _lock_names(layout.lock_dir, layout.lock_path):
            if not holder.acquire(name):
                return removed, orphans
        for path in orphans:
            _unlink_counted(path, removed)
    finally:
        holder.release()
    return removed, busy


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0


# --------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------
def select(listing: dict, allow_patterns, ignore_patterns, repo_id: str, commit: str) -> dict:
    """{path: entry} kept by the patterns; FetchError when nothing is kept."""
    try:
        return hub_client.select(listing, allow_patterns, ignore_patterns, repo_id, commit)
    except hub_client.HubError as exc:
        raise FetchError.from_hub(exc)


# --------------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------------
DEFAULTS = dict(
    revision=DEFAULT_REVISION, cache_dir=None, local_dir=None, allow_patterns=None, ignore_patterns=None,
    token=None, endpoint=None, workers=8, verify_workers=0, verify="full", reverify=False,
    use_xet=True, offline=False, retries=5, retry_delay=2.0, timeout=30, lock_timeout=600, follow_timeout=86400,
    progress=None, http_endpoint_trusted=False, resolved_commit=None, listing=None, store="",
)


class SnapshotJob:
    """One hf_snapshot run. ``plan()`` reads only; ``execute()`` writes (and needs ``plan()``)."""

    def __init__(self, repo_id: str, *, hf=None, **opts):
        unknown = set(opts) - set(DEFAULTS)
        if unknown:
            raise TypeError("unknown options: %s" % ", ".join(sorted(unknown)))
        self.o = dict(DEFAULTS, **opts)
        self.repo_id = repo_id
        self.revision = self.o["revision"] or DEFAULT_REVISION
        self.hf = hf
        self.progress = self.o["progress"]
        self.token = self.o["token"] or None
        self.stop = threading.Event()
        self.library_log = _LibraryLog()
        self.timings = {}
        self.api = None
        self.client = None
        self.layout = None
        self.commit = None
        self.listing = None
        self.listing_source = None
        self.wanted = None
        self.manifest = None
        self.manifest_file = None
        self.resolved_by = None
        self.requests_made = False

    # ---------------------------------------------------------------- helpers
    @property
    def where(self) -> str:
        return hub_client.where_of(self.o["endpoint"])

    def _p(self, **fields):
        if self.progress is not None:
            self.progress.set(**fields)

    def _fail(self, exc, what: str) -> FetchError:
        return classify(exc, self.hf, repo_id=self.repo_id, revision=self.revision, where=self.where,
                        token_given=bool(self.token), what=what, dest=self.layout.root if self.layout else "")

    def _backoff(self, attempt: int) -> float:
        return min(MAX_BACKOFF_S, float(self.o["retry_delay"]) * (2 ** (attempt - 1)))

    def _retrying(self, fn, what: str):
        attempts = max(1, int(self.o["retries"]) + 1)
        for attempt in range(1, attempts + 1):
            if self.stop.is_set():
                raise Cancelled(what)
            try:
                return fn()
            except Cancelled:
                raise
            except Exception as exc:  # classified below; nothing is swallowed
                err = self._fail(exc, what)
                if not err.transient or attempt == attempts:
                    if err.transient:
                        err = FetchError("%s (gave up after %d attempts)" % (err, attempt), err.cause)
                    raise err from None
                delay = self._backoff(attempt)
                self.library_log.note("retry %d/%d of %s in %.1fs: %s" % (attempt, attempts - 1, what, delay, err))
                if self.stop.wait(delay):
                    raise Cancelled(what)

    # ---------------------------------------------------------------- read-only steps
    def setup(self) -> None:
        """Validate the options and build the layout (no network, no writes)."""
        try:
            validate_repo_id(self.repo_id)
        except StoreError as exc:
            raise FetchError("%s; fix repo_id (the catalog's repo_id)" % exc, "bad_repo_id")
        if not self.revision.strip() or ".." in self.revision.split("/") or self.revision.startswith("/"):
            raise FetchError("revision %r is malformed; use a commit hash, a branch or a tag" % self.revision,
                             "bad_revision")
        if int(self.o["follow_timeout"]) < 0:
            raise FetchError("follow_timeout must be 0 or more seconds, not %s" % self.o["follow_timeout"], "bad_option")
        given = self.o["resolved_commit"] or None
        if given is not None and not hub_client.is_commit(given):
            raise FetchError("resolved_commit %r is not a commit: give the 40 lowercase hex digits the revision "
                             "was resolved to (disk_plan's target.commit), or leave it empty"
                             % (given,), "bad_option")
        if given is not None and hub_client.is_commit(self.revision) and given != self.revision:
            raise FetchError("resolved_commit %s contradicts revision %s, itself a commit; pass one of them"
                             % (given, self.revision), "bad_option")
        listing = self.o["listing"]
        if listing is not None:
            commit = listing.get("commit") if isinstance(listing, dict) else None
            if not (isinstance(commit, str) and hub_client.is_commit(commit)
                    and isinstance(listing.get("files"), dict)):
                raise FetchError("listing must be hf_snapshot's returned listing ({commit: <40 hex>, files: "
                                 "{path: entry}}), got %s; pass that result or leave it unset"
                                 % type(listing).__name__, "bad_option")
            if commit != (given or (self.revision if hub_client.is_commit(self.revision) else commit)):
                raise FetchError("listing is of commit %s, not of the revision %s to fetch (resolved_commit %s); "
                                 "list the same commit" % (commit, self.revision, given), "bad_option")
        try:
            hub_client.refuse_insecure(self.o["endpoint"], bool(self.token) and not self.o["offline"],
                                       bool(self.o["http_endpoint_trusted"]), "fetch %s" % self.repo_id)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        # resolved as huggingface_hub resolves them, so paths and locks agree with the library's
        if self.o["local_dir"]:
            self.layout = LocalDirLayout(os.path.realpath(os.path.expanduser(self.o["local_dir"])), self.repo_id)
        else:
            cache = self.o["cache_dir"] or self.hf.constants.HF_HUB_CACHE
            self.layout = CacheLayout(os.path.realpath(os.path.expanduser(cache)), self.repo_id)
        if self.client is None and self.hf is not None:
            self.client = hub_client.HubClient(self.repo_id, self.hf, endpoint=self.o["endpoint"], token=self.token,
                                               call=self._retrying, api=self.api)
            self.api = self.client.api
        logger = logging.getLogger("huggingface_hub")
        if self.library_log not in logger.handlers:
            logger.addHandler(self.library_log)
            logger.propagate = False

    def resolve(self) -> str:
        """The commit of the revision: the revision itself (a commit), resolved_commit (the caller
        resolved it already), the cache's ref (offline), else one request to the Hub."""
        self._p(state="resolving")
        if COMMIT_RE.match(self.revision):
            self.commit, self.resolved_by = self.revision, "pinned"
            return self.commit
        if self.o["resolved_commit"]:
            self.commit, self.resolved_by = self.o["resolved_commit"], "given"
            return self.commit
        if self.o["offline"]:
            ref = self.layout.read_ref(self.revision)
            if ref is None:
                ref = self._manifest_revision(self.revision)
            if ref is None:
                raise FetchError(
                    "offline: revision %r of %s is not a commit and no cached ref or manifest names its "
                    "commit under %s; pin the commit or run with network access"
                    % (self.revision, self.repo_id, self.layout.root), "offline")
            self.commit, self.resolved_by = ref, "cache"
            return ref
        self.requests_made = True
        try:
            self.commit = self.client.resolve(self.revision)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        self.resolved_by = "hub"
        return self.commit

    def _manifest_revision(self, revision: str):
        directory = os.path.join(self.layout.meta_root, "modelswap")
        best = None
        try:
            names = os.listdir(directory)
        except OSError:
            return None
        for name in names:
            if not (name.endswith(".json") and COMMIT_RE.match(name[:-5])):
                continue
            data = hf_manifest.read_manifest(os.path.join(directory, name), self.repo_id, name[:-5])
            if data and data.get("revision") == revision:
                if best is None or data.get("verified_at", "") > best.get("verified_at", ""):
                    best = data
        return best["commit"] if best else None

    def load_manifest(self) -> None:
        self.manifest_file = hf_manifest.manifest_path(self.layout.meta_root, self.commit)
        self.manifest = hf_manifest.read_manifest(self.manifest_file, self.repo_id, self.commit)

    def load_listing(self) -> dict:
        """The commit's files: from the manifest, the caller (the ``listing`` option: the controller
        listed them once for a fleet), huggingface_hub's tree cache, or the Hub.

        The one place where a file list enters the job: every path and blob id in it is checked
        (hub_trust) before anything uses it to build a path, and a bad one stops the run here,
        before anything is written or deleted.
        """
        if self.manifest is not None and not self._partial_listing(self.manifest):
            return self._trusted(self.manifest["listing"], "manifest",
                                 "the manifest %s" % self.manifest_file,
                                 "remove that manifest and run again (the files are verified again)")
        given = self.o["listing"]
        if given is not None and given["commit"] == self.commit:
            return self._trusted(given["files"], "given", "the given listing",
                                 "list the commit again (hf_snapshot in check mode with return_listing)")
        try:
            cached = hub_client.cached_listing(self.layout.tree_roots, self.repo_id, self.commit)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        if cached is not None:
            self.listing, self.listing_source = cached[0], "tree_cache"
            return self.listing
        if self.o["offline"]:
            raise FetchError(
                "offline: no manifest and no cached file list of %s@%s under %s; run once with network "
                "access" % (self.repo_id, self.commit, self.layout.root), "offline")
        self.requests_made = True
        self._p(state="resolving")
        try:
            self.listing = self.client.list_tree(self.commit)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        self.listing_source = "hub"
        return self.listing

    def _partial_listing(self, manifest) -> bool:
        """A manifest written after a copy from a peer (peer_snapshot) lists only the files its
        patterns selected: it is this run's listing only for the same patterns."""
        if manifest.get("listing_scope") != "selected":
            return False
        mine = {"allow": self.o["allow_patterns"] or None, "ignore": self.o["ignore_patterns"] or None}
        return manifest.get("patterns") != mine

    def _trusted(self, listing, source: str, what: str, fix: str) -> dict:
        try:
            hub_client.trusted(listing, "%s for %s@%s" % (what, self.repo_id, self.commit[:12]), fix)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        self.listing, self.listing_source = listing, source
        return listing

    def plan(self) -> dict:
        """What a run would do: {"noop", "fetch": [paths], "verify": [paths], "bytes_to_fetch", ...}."""
        started = time.monotonic()
        self.resolve()
        self.load_manifest()
        self.load_listing()
        self.wanted = select(self.listing, self.o["allow_patterns"], self.o["ignore_patterns"],
                             self.repo_id, self.commit)
        plan = self._plan_files()
        self.timings["plan_s"] = time.monotonic() - started
        return plan

    def _locate(self, path: str):
        """Where `path` of the pinned commit lies in the layout."""
        return self.layout.locate(self.commit, path)

    def _plan_files(self) -> dict:
        mode = self.o["verify"]
        ok, stale = hf_manifest.covers(self.manifest, self.wanted, self._locate, mode)
        todo = sorted(self.wanted) if self.o["reverify"] else stale
        fetch, verify = [], []
        for path in todo:
            entry = self.wanted[path]
            if self.layout.present(self.commit, path, entry):
                verify.append(path)
            else:
                fetch.append(path)
        units = {}
        for path in fetch:
            entry = self.wanted[path]
            if self.layout.needs_transfer(self.commit, path, entry):
                units[self.layout.unit(path, entry)] = int(entry["size"])
        return {
            "noop": ok and not self.o["reverify"],
            "manifest_ok": ok,
            "fetch": fetch,
            "verify": verify,
            "bytes_to_fetch": sum(units.values()),
            "stale": stale,
        }

    def stale_files(self) -> list:
        """Selected files the current manifest does not vouch for (one stat each)."""
        return self._plan_files()["stale"]

    def preview(self, plan: dict) -> dict:
        """Check mode: ``would_fetch`` and ``verification`` of ``plan``, once the checks a run would
        fail on first have passed (a writable destination, access to the files, network when needed):
        one HEAD for the smallest file to fetch, no body, nothing written."""
        layout = self.layout
        problem = writable_problem(layout.root, probe=False) if not plan["noop"] else ""
        if problem:
            raise FetchError("cannot download %s into %s: %s; choose a writable destination or run with become"
                             % (self.repo_id, layout.root, problem), "not_writable")
        if plan["fetch"] and self.o["offline"]:
            raise FetchError("offline: %d files of %s@%s are missing under %s and would have to be downloaded; "
                             "run with network access" % (len(plan["fetch"]), self.repo_id, self.commit[:12],
                                                          layout.root), "offline")
        if plan["fetch"]:
            self.probe_access(min(plan["fetch"], key=lambda f: int(self.wanted[f]["size"])))
        return {
            "would_fetch": {"files": plan["fetch"], "bytes": plan["bytes_to_fetch"], "verify": plan["verify"]},
            "verification": {"mode": self.o["verify"], "ok": plan["noop"],
                             "source": "manifest" if plan["manifest_ok"] else "pending", "files": 0,
                             "hashed_bytes": 0, "seconds": 0.0, "workers": 0, "refetched": [],
                             "verified_at": (self.manifest or {}).get("verified_at")},
        }

    def probe_access(self, path: str) -> None:
        """One HEAD for ``path`` (check mode): access, gating and availability, no body."""
        if self.hf.get_hf_file_metadata is None or self.hf.hf_hub_url is None:
            return
        url = self.hf.hf_hub_url(self.repo_id, path, revision=self.commit,
                                 endpoint=self.o["endpoint"] or None)
        self.requests_made = True
        self._retrying(lambda: self.hf.get_hf_file_metadata(url, token=self.token or False,
                                                            timeout=float(self.o["timeout"])),
                       "checking access to %s of %s@%s" % (path, self.repo_id, self.commit[:12]))

    # ---------------------------------------------------------------- the work
    def execute(self, plan: dict) -> dict:
        """Download and verify under the repository lock; returns what happened."""
        layout = self.layout
        problem = writable_problem(layout.root, probe=True)
        if problem:
            raise FetchError("cannot download %s into %s: %s; choose a writable %s or run the task "
                             "with become" % (self.repo_id, layout.root,
                                              problem, "local_dir" if layout.kind == "local_dir" else "cache_dir"),
                             "not_writable")
        try:
            os.makedirs(layout.root, exist_ok=True)
        except OSError as exc:
            raise FetchError("cannot create %s: %s; create it or choose another destination"
                             % (layout.root, exc.strerror or exc), "not_writable")
        started = time.monotonic()
        lock = self.lock_repository()
        self.timings["lock_s"] = time.monotonic() - started
        try:
            return self._execute_locked(plan)
        finally:
            lock.release()

    def lock_repository(self) -> RepoLock:
        """The repository lock, taken. Another run's download that holds it is followed while its
        progress moves (a download a killed controller left running goes on to its end, and this
        run then finds its manifest); one that shows no progress for ``lock_timeout`` seconds, or
        still runs after ``follow_timeout``, fails this run as ``locked``."""
        layout, progress = self.layout, self.progress
        lock = RepoLock(layout.lock_path, run=(progress.data.get("id") or "") if progress else "",
                        progress_file=progress.path if progress else "")
        watch = HolderWatch(float(self.o["lock_timeout"]), float(self.o["follow_timeout"]))

        def follow(info) -> bool:
            if progress is not None:
                # one file, two writers: each run's poller would read the other's lines
                shared = bool(progress.path and (info or {}).get("progress_file")) and \
                    os.path.realpath(info["progress_file"]) == os.path.realpath(progress.path)
                if shared:
                    progress.mute(True)
                self._p(state="waiting", error=None, lock_holder=describe_holder(info),
                        following=(info or {}).get("run"))
            return watch.keep_waiting(info)

        if lock.acquire(float(self.o["lock_timeout"]), keep_waiting=follow):
            if progress is not None:
                progress.mute(False)
                progress.set(following=None)
            return lock
        who = lock.holder()
        if watch.reason == "limit":
            why = "still makes progress after this run followed it for %ds (follow_timeout)" % int(watch.limit_s)
        elif watch.progress is not None:
            why = "has shown no progress for %ds (lock_timeout)" % int(watch.stall_s)
        else:
            why = "has held it for more than %ds (lock_timeout) and writes no progress this run can follow" \
                % int(watch.stall_s)
        raise FetchError(
            "another download of %s into %s holds %s (%s) and %s; wait for it to end, or stop it, then run again"
            % (self.repo_id, layout.root, layout.lock_path, who, why), "locked")

    def _execute_locked(self, plan: dict) -> dict:
        layout = self.layout
        out = {"orphans_removed": [], "orphans_busy": [], "files_downloaded": 0, "bytes_downloaded": 0,
               "bytes_received": 0, "kept_blobs": layout.kept,
               "refetched": [], "verified": {}, "verify_failures": [], "verified_bytes": 0,
               "hashed_bytes": 0, "verify_seconds": 0.0, "download_seconds": 0.0}
        # another run may have finished while we waited for the lock
        self.load_manifest()
        if self.manifest is not None:
            plan = self._plan_files()
            if plan["noop"]:
                out["noop"] = True
                return out
        self._p(state="cleaning")
        started = time.monotonic()
        removed, busy = clean_orphans(layout)
        out["orphans_removed"] = [{"path": p, "bytes": b} for p, b in removed]
        out["orphans_busy"] = busy
        if layout.kind == "cache":
            hub_client.write_tree(layout.repo_path, self.commit, self.listing)
            if self.resolved_by == "hub":
                hf_manifest.write_ref(layout.repo_path, self.revision, self.commit)
        needed = plan["bytes_to_fetch"]
        free = available_bytes(layout.root)
        if needed > free:
            raise FetchError(
                "not enough space for %s@%s under %s: %d bytes to download, %d available; free space "
                "(disk_plan proposes what to purge, model_purge removes it) or choose another %s; "
                "nothing was downloaded" % (self.repo_id, self.commit[:12], layout.root, needed, free,
                                            "local_dir" if layout.kind == "local_dir" else "cache_dir"),
                "disk_full")
        self.timings["prepare_s"] = time.monotonic() - started
        started = time.monotonic()
        try:
            self._transfer_and_verify(plan, out)
        finally:
            self.timings["transfer_s"] = time.monotonic() - started
        return out

    def _fetch_unit(self, paths: list, again: bool = False) -> int:
        """hf_hub_download of each path (one unit: the paths that share a blob); returns count.

        ``again``: the unit failed verification and its repo blob (a link into the shared Xet store)
        was removed; its first file is downloaded with ``force_download``, so a bad payload of the
        store, which huggingface_hub would otherwise link again, is replaced for every link to it.
        Never for a repo blob still there (one another revision links): that would overwrite it."""
        args = self.layout.download_args()
        self.requests_made = True
        bar = self.progress.bar_class() if self.progress is not None else None
        for index, path in enumerate(paths):
            what = "downloading %s of %s@%s" % (path, self.repo_id, self.commit[:12])
            force = {"force_download": True} if again and index == 0 else {}
            self._retrying(lambda: self.hf.hf_hub_download(
                self.repo_id, path, revision=self.commit, endpoint=self.o["endpoint"] or None,
                token=self.token or False, etag_timeout=float(self.o["timeout"]), tqdm_class=bar,
                library_name="modelswap", **args, **force), what)
            if self.progress is not None:
                self.progress.add(files_done=1)
        return len(paths)

    def _verify_unit(self, paths: list, verifier) -> dict:
        path0 = paths[0]
        entry = self.wanted[path0]
        for path in paths:
            problem = self.layout.name_problem(self.commit, path, entry)
            if problem:
                return {"ok": False, "reason": problem, "hashed": 0, "size": entry["size"],
                        "algo": hf_verify.expected_digest(entry)[0], "digest": None, "seconds": 0.0}
        # in a cache, a blob that links into the shared (Xet) store is read only when it leads to
        # a regular file of that store (hf_verify.cache_target)
        return hf_verify.check_file(self.layout.locate(self.commit, path0), entry, verifier.mode,
                                    cancel=verifier.cancel,
                                    cache_dir=self.layout.root if self.layout.kind == "cache" else "")

    def _transfer_and_verify(self, plan: dict, out: dict) -> None:
        layout = self.layout
        units = {}
        for path in plan["fetch"] + plan["verify"]:
            units.setdefault(layout.unit(path, self.wanted[path]), []).append(path)
        fetch_units = {}
        for path in plan["fetch"]:
            fetch_units.setdefault(layout.unit(path, self.wanted[path]), []).append(path)
        verify_units = [u for u in units if u not in fetch_units]
        self._p(state="downloading" if fetch_units else "verifying", files_total=len(plan["fetch"]),
                bytes_total=plan["bytes_to_fetch"], files_done=0, bytes_done=0)
        workers = max(1, int(self.o["workers"]))
        verifier = hf_verify.Verifier(int(self.o["verify_workers"]) or 0, self.o["verify"])
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf-download")
        pending = {}
        refetched = set()
        shared_units = set()     # units whose bad repo blob was a link (the Xet store's)
        failures = []
        first_fetch = last_fetch = first_verify = last_verify = None
        started = time.monotonic()

        def submit_fetch(unit):
            nonlocal first_fetch
            first_fetch = first_fetch or time.monotonic()
            again = (unit in refetched and unit in shared_units
                     and not os.path.lexists(layout.blob(self.wanted[units[unit][0]])))
            pending[pool.submit(self._fetch_unit, units[unit], again)] = ("fetch", unit)

        def submit_verify(unit):
            nonlocal first_verify
            first_verify = first_verify or time.monotonic()
            pending[verifier.run(self._verify_unit, units[unit], verifier)] = ("verify", unit)

        for unit in fetch_units:
            submit_fetch(unit)
        for unit in verify_units:
            submit_verify(unit)
        try:
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in done:
                    kind, unit = pending.pop(fut)
                    paths = units[unit]
                    if fut.cancelled():
                        continue
                    try:
                        res = fut.result()
                    except (Cancelled, hf_verify.Cancelled):
                        continue
                    except FetchError as exc:
                        failures.append(exc)
                        self._stop_all(pending, verifier)
                        continue
                    except Exception as exc:  # a bug or an unexpected library error: report it
                        failures.append(self._fail(exc, "%s of %s" % (kind, paths[0])))
                        self._stop_all(pending, verifier)
                        continue
                    if kind == "fetch":
                        last_fetch = time.monotonic()
                        out["files_downloaded"] += res
                        if not self.stop.is_set():
                            submit_verify(unit)
                        continue
                    last_verify = time.monotonic()
                    out["hashed_bytes"] += res.get("hashed", 0)
                    if res["ok"]:
                        entry = self.wanted[paths[0]]
                        st = os.stat(layout.locate(self.commit, paths[0]))
                        for path in paths:
                            out["verified"][path] = dict(hf_manifest.fingerprint(st), algo=res["algo"],
                                                         digest=res["digest"] or hf_verify.expected_digest(entry)[1])
                        out["verified_bytes"] += int(entry["size"]) * len(paths)
                        if self.progress is not None:
                            self.progress.add(verified_files=len(paths), verified_bytes=int(entry["size"]))
                        continue
                    # a mismatch: delete the bad file(s); fetch once more, or give up
                    if layout.kind == "cache" and os.path.islink(layout.blob(self.wanted[paths[0]])):
                        shared_units.add(unit)
                    for path in paths:
                        layout.remove(self.commit, path, self.wanted[path])
                    if unit in refetched or self.stop.is_set():
                        out["verify_failures"].append({"path": paths[0], "reason": res["reason"]})
                        failures.append(FetchError(
                            "verifying %s of %s@%s failed after a fresh download: %s; the file was "
                            "deleted and nothing was recorded as verified; %s serves content that does not "
                            "match its own metadata: report it to the repository's owner or the mirror's "
                            "operator, then run again"
                            % (paths[0], self.repo_id, self.commit[:12], res["reason"], self.where),
                            "corrupt"))
                        self._stop_all(pending, verifier)
                        continue
                    if self.o["offline"]:
                        out["verify_failures"].append({"path": paths[0], "reason": res["reason"]})
                        failures.append(FetchError(
                            "verifying %s of %s@%s failed: %s; the file was deleted and must be downloaded "
                            "again, which offline mode forbids: run with network access"
                            % (paths[0], self.repo_id, self.commit[:12], res["reason"]), "offline"))
                        self._stop_all(pending, verifier)
                        continue
                    refetched.add(unit)
                    out["refetched"].append({"path": paths[0], "reason": res["reason"]})
                    self.library_log.note("re-fetching %s: %s" % (paths[0], res["reason"]))
                    if self.progress is not None:
                        self.progress.add(bytes_total=int(self.wanted[paths[0]]["size"]),
                                          files_total=len(paths))
                    submit_fetch(unit)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            verifier.shutdown(cancel=bool(failures))
        if self.progress is not None:
            out["bytes_downloaded"] = self.progress.data.get("bytes_written", 0)
            out["bytes_received"] = self.progress.data.get("bytes_received", 0)
        out["download_seconds"] = (last_fetch - first_fetch) if first_fetch and last_fetch else 0.0
        out["verify_seconds"] = (last_verify - first_verify) if first_verify and last_verify else 0.0
        out["pipeline_seconds"] = time.monotonic() - started
        if failures:
            first = failures[0]
            others = len(failures) - 1
            if others:
                first = FetchError("%s (and %d more failure%s)" % (first, others, "s" if others > 1 else ""),
                                   first.cause)
            first.partial = out
            raise first

    def _stop_all(self, pending: dict, verifier) -> None:
        self.stop.set()
        for fut in list(pending):
            if fut.cancel():
                pending.pop(fut, None)

    # ---------------------------------------------------------------- manifest
    def write_manifest(self, verified: dict) -> dict:
        """The new manifest: still-valid records of the old one plus what was verified now."""
        files = {}
        if self.manifest is not None:   # records that still hold, also of files other patterns chose
            for path, rec in self.manifest["files"].items():
                if path in self.listing and path not in verified:
                    ok, _ = hf_manifest.covers(self.manifest, {path: self.listing[path]}, self._locate, self.o["verify"])
                    if ok:
                        files[path] = rec
        files.update(verified)
        missing = sorted(set(self.wanted) - set(files))
        if missing:
            raise FetchError("internal: %d selected files were neither verified nor vouched for (e.g. %s); "
                             "run again" % (len(missing), missing[0]), "error")
        manifest = hf_manifest.build_manifest(
            repo_id=self.repo_id, revision=self.revision, commit=self.commit,
            endpoint=hub_client.endpoint_of(self.o["endpoint"]),
            layout=self.layout.kind, snapshot=self.layout.snapshot(self.commit), listing=self.listing,
            verified=files, mode=self.o["verify"],
            patterns={"allow": self.o["allow_patterns"] or None, "ignore": self.o["ignore_patterns"] or None},
            tool={"huggingface_hub": getattr(self.hf, "version", None), "module": "modelswap.vllm.hf_snapshot"})
        if self.o["store"]:   # a store other hosts mount: they see other device numbers (hf_manifest.covers)
            manifest["store"] = self.o["store"]
        started = time.monotonic()
        hf_manifest.atomic_write_json(self.manifest_file, manifest)
        self.timings["manifest_s"] = time.monotonic() - started
        if self.layout.kind == "local_dir":
            hf_manifest.remove_other_manifests(self.layout.meta_root, self.commit)
        self.manifest = manifest
        return manifest


def job_for(params: dict, hf, progress=None) -> SnapshotJob:
    """The SnapshotJob for hf_snapshot's options (``params``: the module's, unknown keys ignored)."""
    opts = {k: params[k] for k in DEFAULTS if k in params and k != "progress"}
    return SnapshotJob(params["repo_id"], hf=hf, progress=progress, **opts)
