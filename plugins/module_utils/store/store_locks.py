# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Download locks of a Hugging Face cache, taken the way huggingface_hub takes them.

A download of ``<etag>`` in repo folder ``F`` holds ``<cache>/.locks/F/<etag>.lock`` with
``flock`` (filelock's UnixFileLock, through huggingface_hub's WeakFileLock) while it writes
``F/blobs/<etag>.<random>.incomplete``. A partial file is an orphan only if nobody holds its lock.

``LockSet`` takes every lock of one repo non-blocking and keeps them while the caller deletes, so
no download can start or continue in that repo meanwhile (a new downloader blocks on the lock we
hold; filelock >= 3.13 re-opens a lock file we unlinked, see its ``st_nlink == 0`` check).
Never ``hf cache prune``: it deletes every ``*.incomplete`` without looking at locks.

Pure stdlib (fcntl); unit-tested against real filelock holders.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import files_with_suffix

_CONTENTION = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


def lock_dir(cache_dir: str, folder: str) -> str:
    return os.path.join(cache_dir, ".locks", folder)


def _lock_files(directory: str, recursive: bool = False) -> list:
    return files_with_suffix(directory, ".lock", recursive)


def probe(path: str):
    """Whether someone holds ``path``'s flock: True (held), False (free), None (cannot tell).

    Read-only: opens the existing file read-only, takes and drops the lock at once.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return True if exc.errno in _CONTENTION else None
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


def busy_locks(directory: str, recursive: bool = False) -> list:
    """Lock files under ``directory`` that a live process holds (or whose state is unknown)."""
    return [p for p in _lock_files(directory, recursive) if probe(p) is not False]


class LockSet:
    """Locks of one repo (or one local_dir download folder), held together until ``release``."""

    def __init__(self, directory: str, recursive: bool = False):
        self.directory = directory
        self.recursive = recursive
        self.held = {}          # path -> fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def _take(self, path: str, create: bool) -> bool:
        if path in self.held:
            return True
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK
        if create:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            flags |= os.O_CREAT
        try:
            fd = os.open(path, flags, 0o664)
        except FileNotFoundError:
            return True   # gone since listed: nobody holds it
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        if os.fstat(fd).st_nlink == 0:   # unlinked by its last user meanwhile: nothing to hold
            os.close(fd)
            return True
        self.held[path] = fd
        return True

    def acquire_all(self) -> list:
        """Take every existing lock; on any contention release all and return the busy ones."""
        busy = [p for p in _lock_files(self.directory, self.recursive) if not self._take(p, False)]
        if busy:
            self.release()
        return busy

    def acquire(self, name: str) -> bool:
        """Take (creating it if needed) the lock ``<directory>/<name>``; False if someone holds it."""
        return self._take(os.path.join(self.directory, name), True)

    def remove_held(self) -> list:
        """Unlink the lock files we hold (stale: nobody else holds them); returns their paths."""
        removed = []
        for path, fd in self.held.items():
            try:
                if os.path.samestat(os.lstat(path), os.fstat(fd)):
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                pass
        return removed

    def release(self) -> None:
        for fd in self.held.values():
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self.held = {}


def is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
