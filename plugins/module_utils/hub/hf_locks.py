# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The repository lock of a snapshot download and what killed runs leave behind: ``RepoLock``
(one flock for the whole download, its file naming the holder, its run and progress file), who
holds it now (``lock_in_flight``, read-only), and the removal of orphaned partial files, each
only when no live download holds its per-file lock.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import files_with_suffix
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_snapshot_progress import (
    process_start, read_json_object)
from ansible_collections.modelswap.vllm.plugins.module_utils.store.store_locks import LockSet
from ansible_collections.modelswap.vllm.plugins.module_utils.store.store_locks import probe as probe_lock

_CONTENTION = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


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
