# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""File-system helpers the modules share: atomic writes, folder listings, suffix scans, the nearest
folder."""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile


def _atomic_replace(path: str, write, mode: int, makedirs: bool, dir_mode: int, fsync: bool) -> None:
    """Replace ``path`` with what ``write(binary file)`` writes: a temp file in the same folder
    (created with ``mode`` before any byte is in it), optionally fsync'd, renamed over ``path``.
    A reader sees the old file or the new one, never half of one; a failure leaves no temp file."""
    directory = os.path.dirname(path) or "."
    if makedirs:
        os.makedirs(directory, mode=dir_mode, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str, data: bytes, mode: int = 0o644, makedirs: bool = False,
                       dir_mode: int = 0o755, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically (see _atomic_replace). ``fsync=False`` for files
    rewritten every second whose loss in a crash costs nothing (a progress file)."""
    _atomic_replace(path, lambda fh: fh.write(data), mode, makedirs, dir_mode, fsync)


def atomic_write_text(path: str, text: str, mode: int = 0o644, makedirs: bool = False,
                      fsync: bool = True) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically."""
    atomic_write_bytes(path, text.encode("utf-8"), mode, makedirs, fsync=fsync)


def write_text_if_changed(path: str, text: str, mode: int = 0o644, makedirs: bool = False) -> bool:
    """Replace ``path`` with ``text`` atomically unless it already holds it; True when written."""
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return False
    except OSError:
        pass
    atomic_write_text(path, text, mode, makedirs)
    return True


def atomic_copy(src: str, dest: str, mode: int, makedirs: bool = False, dir_mode: int = 0o755) -> None:
    """Copy ``src`` over ``dest`` atomically with ``mode``, in 1 MiB chunks (a large file never sits
    in memory whole)."""
    def write(out):
        with open(src, "rb") as inp:
            for chunk in iter(lambda: inp.read(1 << 20), b""):
                out.write(chunk)
    _atomic_replace(dest, write, mode, makedirs, dir_mode, True)


def allocated_under(path: str) -> int:
    """Allocated bytes of the distinct inodes under ``path`` (what du counts), links not followed."""
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


def listed(directory: str) -> list:
    """The names in ``directory``, sorted; a missing or unreadable folder lists nothing (the
    callers read optional metadata folders, whose absence is normal)."""
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def files_with_suffix(directory: str, suffix: str, recursive: bool = False) -> list:
    """Regular files (not symlinks) under ``directory`` whose names end in ``suffix``, sorted;
    an unreadable or missing folder contributes nothing."""
    found = []
    stack = [directory]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    if recursive:
                        stack.append(entry.path)
                elif entry.name.endswith(suffix) and entry.is_file(follow_symlinks=False):
                    found.append(entry.path)
    return sorted(found)


def nearest_existing(path: str) -> str:
    """``path`` or its closest existing parent: where a folder not yet created would live."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


@contextlib.contextmanager
def locked(path: str, mode: int = 0o600):
    """An exclusive flock on ``<path>.lock`` (created with ``mode``), shared by every writer of
    ``path`` (the deployment record and the manifests beside it, the host's lease); the folder is
    created (0755) when missing."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
