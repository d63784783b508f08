# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Content verification of downloaded Hugging Face files, in parallel across files.

The Hub's tree listing of a commit names every file's content: the sha256 of an LFS file
(``lfs.oid``, which is also its blob name in the cache) and the git blob id of any other file
(``sha1(b"blob <size>\\0" + content)``). huggingface_hub itself only checks sizes, so a flipped
byte or a wrong ETag lands in the cache silently; ``hash_file`` recomputes the right digest and
``Verifier`` runs it on a thread pool.

Threads, not processes: ``hashlib`` releases the GIL while it hashes a buffer larger than 2 KiB,
so N threads hash N files on N cores (tests/bench/bench_hf_snapshot.py measures it), without
pickling or a second interpreter. Each thread reads through its own preallocated buffer with
``readinto`` and advises the kernel that the read is sequential.

What is read in a Hugging Face cache (``check_file(..., cache_dir=...)``, ``cache_target``): a
snapshot entry that is a link must lead to a blob of its own repo; a repo blob that is itself a link
(the Xet layout: a link into the cache-wide shared store ``<cache>/blobs/<xx>/<hash>``) is read only
when its target, resolved, is a regular file of that store, opened with ``O_NOFOLLOW``; a link that
leads anywhere else (an absolute path outside the cache, a device, a FIFO) is refused as untrusted
and never opened.

Pure stdlib (and the store's layout rules: cache_layout, xet_store): unit-tested directly, importable on any host.
"""
from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ansible_collections.modelswap.vllm.plugins.module_utils.store import cache_layout, xet_store

ALGOS = ("sha256", "git-sha1")
MODES = ("full", "size")
BUFFER_SIZE = 1024 * 1024

_local = threading.local()


class Cancelled(Exception):
    """Hashing stopped because the caller asked it to."""


class Untrusted(OSError):
    """A file that is not read: a link that leaves where it may lead, or not a regular file."""


def default_workers() -> int:
    """Cores this process may use (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def expected_digest(entry: dict) -> tuple:
    """(algo, hex digest) a file must have, from a tree entry {size, blob_id, lfs_sha256?}."""
    if entry.get("lfs_sha256"):
        return "sha256", entry["lfs_sha256"]
    return "git-sha1", entry["blob_id"]


def _buffer() -> bytearray:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = bytearray(BUFFER_SIZE)
    return buf


def _resolve_link(link: str) -> str:
    """The target of the symlink ``link``, lexically normalised (no further link followed)."""
    return os.path.normpath(os.path.join(os.path.dirname(link), os.readlink(link)))


def cache_target(path: str, cache_dir: str) -> str:
    """The regular file to read for ``path``, an entry of a snapshot of the cache ``cache_dir``
    (a real path); raises Untrusted when it may not be read, FileNotFoundError when it is missing.

    A snapshot entry is a regular file (read as it is) or a link to ``<repo>/blobs/<name>`` of its
    own repo. That blob is a regular file, or (Xet) a link whose target is a payload of the marked
    shared store, ``<cache>/blobs/<xx>/<hash>``: resolved, it must be that very path (no symlink on
    the way) and a regular file.
    """
    cache_dir = os.path.normpath(cache_dir)
    rel = os.path.relpath(os.path.normpath(path), cache_dir).split(os.sep)
    if len(rel) < 4 or rel[0] in ("..", cache_layout.SHARED_STORE_DIR) or rel[1] != "snapshots":
        raise Untrusted("%s is not a snapshot entry of the cache %s" % (path, cache_dir))
    blobs_dir = os.path.join(cache_dir, rel[0], "blobs")
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        return path
    if not stat.S_ISLNK(st.st_mode):
        raise Untrusted("%s is not a regular file nor a link to a blob" % path)
    blob = _resolve_link(path)
    if os.path.dirname(blob) != blobs_dir:
        raise Untrusted("%s links to %s, outside its repo's blobs %s" % (path, blob, blobs_dir))
    st = os.lstat(blob)
    if stat.S_ISREG(st.st_mode):
        return blob
    if not stat.S_ISLNK(st.st_mode):
        raise Untrusted("blob %s is not a regular file" % blob)
    target = _resolve_link(blob)
    payload = xet_store.shared_payload_path(cache_dir, target)
    if payload is None or not xet_store.is_shared_store(cache_dir):
        raise Untrusted("blob %s links to %s, not to a payload of the shared store %s"
                        % (blob, target, xet_store.shared_store_dir(cache_dir)))
    real = os.path.realpath(payload)
    if real != payload:
        raise Untrusted("blob %s links to %s, which resolves to %s, outside the shared store"
                        % (blob, payload, real))
    if not stat.S_ISREG(os.lstat(payload).st_mode):
        raise Untrusted("blob %s links to %s, which is not a regular file" % (blob, payload))
    return payload


def open_regular(path: str, nofollow: bool = False) -> int:
    """A read-only fd of the regular file ``path`` (non-blocking open: a FIFO never hangs it);
    ``nofollow`` refuses a link at the last component. Untrusted for anything but a regular file."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if nofollow:
        flags |= os.O_NOFOLLOW
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Untrusted("%s is not a regular file" % path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hash_file(path: str, algo: str, *, progress=None, cancel=None, nofollow: bool = False) -> tuple:
    """(hex digest, bytes read) of the regular file at ``path`` (symlinks followed unless
    ``nofollow``; Untrusted for a FIFO, a device, a folder); hash_fd for the rest."""
    if algo not in ALGOS:
        raise ValueError("unknown digest algorithm %r" % (algo,))
    fd = open_regular(path, nofollow)
    try:
        return hash_fd(fd, algo, progress=progress, cancel=cancel, name=path)
    finally:
        os.close(fd)


def hash_fd(fd: int, algo: str, *, progress=None, cancel=None, name: str = "") -> tuple:
    """(hex digest, bytes read) of the open regular file ``fd``, read to its end; ``fd`` stays open.

    ``algo``: ``sha256`` (LFS files) or ``git-sha1`` (git's blob id). ``progress(n)`` is called
    after each buffer; ``cancel`` (a threading.Event) stops the read with ``Cancelled(name)``.
    """
    if algo not in ALGOS:
        raise ValueError("unknown digest algorithm %r" % (algo,))
    buf = _buffer()
    view = memoryview(buf)
    total = 0
    size = os.fstat(fd).st_size
    if algo == "sha256":
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1()
        digest.update(b"blob %d\0" % size)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError):  # pragma: no cover - not on every platform
        pass
    with os.fdopen(fd, "rb", buffering=0, closefd=False) as fh:
        readinto = fh.readinto
        update = digest.update
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled(name)
            n = readinto(buf)
            if not n:
                break
            update(view[:n] if n < BUFFER_SIZE else view)
            total += n
            if progress is not None:
                progress(n)
    return digest.hexdigest(), total


def git_blob_id(data: bytes) -> str:
    """Git's blob id of ``data`` (what the Hub lists as ``oid`` of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_file(path: str, entry: dict, mode: str = "full", *, progress=None, cancel=None,
               cache_dir: str = "") -> dict:
    """Verify one file against its tree entry; returns a result dict (never raises for content).

    ``{"ok", "path", "size", "algo", "digest", "expected", "reason", "seconds", "hashed"}``;
    ``reason`` says what is wrong (missing, size, digest, untrusted). ``mode``: ``full`` hashes
    the content, ``size`` only compares sizes. With ``cache_dir`` (a real path), ``path`` is a
    snapshot entry of that cache and only what cache_target() allows is read, with O_NOFOLLOW.
    """
    started = time.monotonic()
    algo, expected = expected_digest(entry)
    result = {"ok": False, "path": path, "size": None, "algo": algo, "expected": expected,
              "digest": None, "reason": "", "hashed": 0, "seconds": 0.0}
    read_path, nofollow = path, False
    try:
        if cache_dir:
            read_path, nofollow = cache_target(path, cache_dir), True
            st = os.lstat(read_path)
        else:
            st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted("%s is not a regular file" % read_path)
    except Untrusted as exc:
        result["reason"] = "untrusted: %s; it is not read" % exc
        return result
    except FileNotFoundError:
        result["reason"] = "missing"
        return result
    except OSError as exc:
        result["reason"] = "unreadable (%s)" % (exc.strerror or exc)
        return result
    result["size"] = st.st_size
    if st.st_size != int(entry["size"]):
        result["reason"] = "size %d, expected %d" % (st.st_size, int(entry["size"]))
        return result
    if mode == "size":
        result["ok"] = True
        result["seconds"] = time.monotonic() - started
        return result
    try:
        digest, read = hash_file(read_path, algo, progress=progress, cancel=cancel, nofollow=nofollow)
    except Cancelled:
        raise
    except Untrusted as exc:
        result["reason"] = "untrusted: %s; it is not read" % exc
        return result
    except OSError as exc:
        result["reason"] = "unreadable (%s)" % (exc.strerror or exc)
        return result
    result.update(digest=digest, hashed=read, seconds=time.monotonic() - started)
    if digest != expected:
        result["reason"] = "%s %s, expected %s" % (algo, digest, expected)
        return result
    if read != int(entry["size"]):  # the file changed while we read it
        result["reason"] = "size changed while hashing (%d bytes read)" % read
        return result
    result["ok"] = True
    return result


class Verifier:
    """A pool of ``workers`` hashing threads; ``submit`` returns a Future of check_file()'s dict."""

    def __init__(self, workers: int = 0, mode: str = "full", *, progress=None, cache_dir: str = ""):
        if mode not in MODES:
            raise ValueError("verification mode must be one of %s" % ", ".join(MODES))
        self.workers = workers or default_workers()
        self.mode = mode
        self.progress = progress
        self.cache_dir = cache_dir     # check_file's: paths are snapshot entries of this cache
        self.cancel = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hf-verify")

    def submit(self, path: str, entry: dict):
        return self._pool.submit(check_file, path, entry, self.mode, progress=self.progress,
                                 cancel=self.cancel, cache_dir=self.cache_dir)

    def run(self, fn, *args, **kwargs):
        """Run any callable on the hashing threads (e.g. a check with extra steps around it)."""
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, cancel: bool = False) -> None:
        if cancel:
            self.cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=cancel)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.shutdown(cancel=exc_type is not None)


def verify_all(items, workers: int = 0, mode: str = "full") -> list:
    """check_file() over ``[(path, entry), ...]`` in parallel; results in input order."""
    with Verifier(workers, mode) as verifier:
        futures = [verifier.submit(path, entry) for path, entry in items]
        return [f.result() for f in futures]
