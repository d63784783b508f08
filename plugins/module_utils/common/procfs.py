# -*- coding: utf-8 -*-
"""Reading processes from /proc: owner, command line, open files and memory mappings.

Pure stdlib, shared by gpu_ready (who holds a GPU) and the /dev/shm cleanup (who still uses a
file). Every function takes `proc` (the procfs root) so tests can point it elsewhere; a process
that exits while it is being read is simply skipped.
"""
from __future__ import annotations

import os
import pwd

PROC = "/proc"
CMDLINE_MAX = 1024


def user_name(uid):
    """The account name of `uid`, or the number as text when the account is unknown."""
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def pids(proc=PROC):
    """PIDs of the processes visible in `proc`, ascending."""
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def process_info(pid, proc=PROC):
    """Owner, name and command line of `pid` from /proc, or None when it is not visible.

    The owner is the real UID from /proc/PID/status (who started it), the command line is
    /proc/PID/cmdline with NULs as spaces, cut at CMDLINE_MAX characters. A PID that /proc does
    not show (it exited, or it lives in another PID namespace, as NVML's PIDs do inside a
    container) gives None.
    """
    base = os.path.join(proc, str(pid))
    uid = None
    name = None
    try:
        with open(os.path.join(base, "status"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Name:"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        return None
    cmdline = ""
    try:
        with open(os.path.join(base, "cmdline"), "rb") as fh:
            raw = fh.read(CMDLINE_MAX * 4)
        cmdline = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        pass
    if len(cmdline) > CMDLINE_MAX:
        cmdline = cmdline[:CMDLINE_MAX - 3] + "..."
    return {"pid": pid, "uid": uid, "user": user_name(uid), "name": name,
            "cmdline": cmdline or ("[%s]" % name if name else "")}


def process_argv(pid, proc=PROC):
    """The argv of `pid`: its NUL-separated /proc/PID/cmdline, whole. None when it is gone."""
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    return [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")] if raw else []


def process_cwd(pid, proc=PROC):
    """The working folder of `pid`; None when it cannot be read (another user's process without
    privileges, or gone)."""
    try:
        return os.readlink(os.path.join(proc, str(pid), "cwd"))
    except OSError:
        return None


def other_mount_namespace(pid, proc=PROC) -> bool:
    """Whether `pid` sees another file system tree than this process (a container's): its paths
    mean something else here. False when that cannot be read."""
    try:
        return os.readlink(os.path.join(proc, str(pid), "ns", "mnt")) != os.readlink(
            os.path.join(proc, "self", "ns", "mnt"))
    except OSError:
        return False


def _maps_device(field):
    """/proc/PID/maps' device field "MM:mm" (hex) as (major, minor)."""
    major, _unused, minor = field.partition(":")
    return int(major, 16), int(minor, 16)


def holders(targets, proc=PROC, exclude_pids=()):
    """Which processes hold open or map the files in `targets`.

    `targets` maps (st_dev, st_ino) to a key (usually the path). Files are matched by device and
    inode, not by path, so a process in another mount namespace whose /dev/shm has a file of the
    same name does not count, and a renamed file still does.

    A mapping or descriptor whose path text equals a key also counts: overlayfs shows the
    underlying inode in /proc/PID/maps, and a false "in use" only keeps a file, never loses one.

    Returns (found, uninspectable): `found` maps each key to a list of
    {"pid": int, "via": ["fd"|"mmap", ...]}; `uninspectable` lists PIDs whose fd table or maps
    could not be read (permission), so a caller can refuse to act on an unproven "unused".
    """
    found = {}
    uninspectable = []
    if not targets:
        return found, uninspectable
    by_devnum = {}
    for (dev, ino), key in targets.items():
        by_devnum[((os.major(dev), os.minor(dev)), ino)] = key
    names = set()
    by_path = {}
    for key in targets.values():
        names.add(os.path.basename(str(key)))
        by_path[str(key)] = key
    skip = set(exclude_pids)

    def note(key, pid, via):
        entries = found.setdefault(key, [])
        for entry in entries:
            if entry["pid"] == pid:
                if via not in entry["via"]:
                    entry["via"].append(via)
                return
        entries.append({"pid": pid, "via": [via]})

    for pid in pids(proc):
        if pid in skip:
            continue
        base = os.path.join(proc, str(pid))
        denied = False
        # Open file descriptors: readlink first (cheap), stat only the plausible ones.
        fd_dir = os.path.join(base, "fd")
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            denied = True
            fds = []
        except OSError:
            fds = []
        for fd in fds:
            link = os.path.join(fd_dir, fd)
            try:
                text = os.readlink(link)
            except PermissionError:
                denied = True
                break
            except OSError:
                continue
            if text.endswith(" (deleted)"):
                text = text[:-len(" (deleted)")]
            if os.path.basename(text) not in names:
                continue
            key = by_path.get(text)
            try:
                st = os.stat(link)
                key = targets.get((st.st_dev, st.st_ino), key)
            except OSError:
                pass
            if key is not None:
                note(key, pid, "fd")
        # Memory mappings: "addr perms offset dev inode path"; dev and inode identify the file.
        try:
            with open(os.path.join(base, "maps"), encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    parts = line.rstrip("\n").split(None, 5)
                    if len(parts) < 5 or parts[4] == "0":
                        continue
                    try:
                        ident = (_maps_device(parts[3]), int(parts[4]))
                    except ValueError:
                        continue
                    key = by_devnum.get(ident)
                    if key is None and len(parts) == 6:
                        key = by_path.get(parts[5])
                    if key is not None:
                        note(key, pid, "mmap")
        except PermissionError:
            denied = True
        except OSError:
            pass
        if denied and os.path.isdir(base):
            uninspectable.append(pid)
    return found, uninspectable
