# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""File-system helpers the modules share: atomic writes, folder listings, suffix scans, the nearest
folder."""
from __future__ import annotations

import contextlib
import os
import tempfile


def atomic_write_text(path: str, text: str, mode: int = 0o644, makedirs: bool = False) -> None:
    """Replace ``path`` with ``text`` atomically: a temp file in the same folder, fsync, rename.
    A reader sees the old file or the new one, never half of one."""
    directory = os.path.dirname(path) or "."
    if makedirs:
        os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
