"""A file system of its own for tests that measure freed space with statvfs.

As root (CI, the lab machine) a small ext4 image is loop-mounted: nobody else writes to it, so
`statvfs` before/after a deletion measures exactly what the deletion freed, and ext4 allocates
blocks to directories and long symlinks like a real model disk. Without root the tests fall back
to a plain temporary folder and measure with a du-style walk of the tree (`isolated` is False).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ScratchFS:
    root: Path
    isolated: bool

    def free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bfree * st.f_frsize


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mkfs.ext4") and shutil.which("mount")


@contextlib.contextmanager
def scratch_fs(size_mb: int = 96):
    base = Path(tempfile.mkdtemp(prefix="modelswap-fs-"))
    mnt = base / "mnt"
    mnt.mkdir()
    mounted = False
    if _can_mount():
        image = base / "fs.img"
        with open(image, "wb") as fh:
            fh.truncate(size_mb * 1024 * 1024)
        made = subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-m", "0", str(image)],
                              capture_output=True)
        if made.returncode == 0:
            mounted = subprocess.run(["mount", "-o", "loop,noatime", str(image), str(mnt)],
                                     capture_output=True).returncode == 0
    try:
        yield ScratchFS(mnt, mounted)
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)
        shutil.rmtree(base, ignore_errors=True)


def tree_usage(*roots) -> int:
    """Allocated bytes of the distinct inodes under ``roots`` (what du counts)."""
    seen, total = set(), 0
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                st = os.lstat(name)
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def tree_fingerprint(*roots) -> str:
    """A hash of every path's name, type, mode, size, link target and content (not times)."""
    h = hashlib.sha256()
    for root in roots:
        root = Path(root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                h.update(("%s|%o|%d|" % (os.path.relpath(path, root), st.st_mode, st.st_size)).encode())
                if os.path.islink(path):
                    h.update(os.readlink(path).encode())
                elif os.path.isfile(path):
                    with open(path, "rb") as fh:
                        for chunk in iter(lambda: fh.read(1 << 20), b""):
                            h.update(chunk)
    return h.hexdigest()
