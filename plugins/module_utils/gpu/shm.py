# -*- coding: utf-8 -*-
"""Shared-memory leftovers in /dev/shm: which files to remove, and removing only those.

vLLM, NCCL and torch leave files in /dev/shm (`nccl-*`, `psm_*`, `sem.mp-*`, `vllm_*`) when their
processes die hard; they fill the tmpfs and confuse the next start. On a shared host only the
service user's files that no live process holds open or maps may go. This module plans that
(pure: directory listing + /proc scan), checks that every planned removal can succeed before
the first one (refusals), and applies the plan with a re-check before each unlink. The
shm_cleanup module removes; gpu_ready only reports (the same plan, nothing applied).
"""
from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import pwd
import stat
import struct

from ansible_collections.modelswap.vllm.plugins.module_utils.common import procfs

SHM_DIR = "/dev/shm"
DEFAULT_PATTERNS = ("nccl-*", "psm_*", "sem.mp-*", "vllm_*")
WILDCARDS = set("*?[]!")
# FS_IOC_GETFLAGS, _IOR('f', 1, long) in the generic Linux ioctl encoding, and the inode flags
# that make unlink(2) fail with EPERM even for root (chattr +i, chattr +a).
FS_IOC_GETFLAGS = (2 << 30) | (struct.calcsize("l") << 16) | (ord("f") << 8) | 1
FS_IMMUTABLE_FL = 0x10
FS_APPEND_FL = 0x20


class ShmError(Exception):
    """Bad input or a failure the caller must report (the message says what and how to fix)."""


def pattern_problem(pattern):
    """Why `pattern` is not an acceptable /dev/shm leftover pattern, or None when it is.

    A pattern is a glob on a file name directly inside the shm directory. "Unknown" (rejected):
    empty, absolute or containing '/' (it would name something outside the directory or a
    subdirectory), starting with '.' ('.', '..' and hidden entries), containing NUL, or made of
    wildcards only (it would match every file of the user: name a prefix such as 'sem.loky-*').
    """
    if not isinstance(pattern, str) or not pattern.strip():
        return "is empty"
    if "\0" in pattern:
        return "contains a NUL byte"
    if pattern.startswith("/"):
        return "is absolute; patterns match file names inside the shm directory"
    if "/" in pattern:
        return "contains '/'; patterns match file names directly inside the shm directory"
    if pattern.startswith("."):
        return "starts with '.' ('.', '..' and hidden entries are never leftovers)"
    # Drop bracket expressions and wildcards: what is left must say which files are meant.
    out = []
    depth = 0
    for ch in pattern:
        if ch == "[":
            depth += 1
        elif ch == "]" and depth:
            depth -= 1
        elif depth == 0 and ch not in WILDCARDS:
            out.append(ch)
    if len("".join(out).strip()) < 2:
        return "would match almost any file name; give a literal prefix such as 'sem.loky-*'"
    return None


def validate_dir(shm_dir):
    """Raise ShmError unless ``shm_dir`` is an absolute path to an existing directory."""
    if not os.path.isabs(shm_dir):
        raise ShmError("shm_dir %r is not an absolute path. Fix: name the shared-memory directory "
                       "itself, e.g. /dev/shm." % shm_dir)
    if not os.path.isdir(shm_dir):
        raise ShmError("shm_dir %s %s. Fix: point shm_dir at the shared-memory directory (/dev/shm)."
                       % (shm_dir, "is not a directory" if os.path.exists(shm_dir) else "does not exist"))


def validate_patterns(patterns):
    """Raise ShmError naming every unacceptable pattern in `patterns`."""
    bad = []
    for pattern in patterns:
        why = pattern_problem(pattern)
        if why:
            bad.append("%r %s" % (pattern, why))
    if bad:
        raise ShmError("Shared memory: unknown shm pattern(s): %s. Fix: use file-name "
                       "globs such as 'nccl-*' or 'sem.loky-*'." % "; ".join(bad))


def resolve_user(user):
    """(uid, name) of `user`; ShmError when the account does not exist on this host."""
    if not user or not str(user).strip():
        raise ShmError("Shared memory: service_user is empty. Fix: give the account "
                       "that runs the vLLM service (e.g. 'vllm').")
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ShmError("Shared memory: service user %r does not exist on this host "
                       "(no passwd entry). Fix: create the account first or name the user that "
                       "runs the service." % user)
    return entry.pw_uid, entry.pw_name


def with_defaults(extra):
    """The patterns a run uses: DEFAULT_PATTERNS, then the `extra` ones not among them."""
    return list(DEFAULT_PATTERNS) + [x for x in extra if x not in DEFAULT_PATTERNS]


def _match(name, patterns):
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None


def plan(shm_dir, uid, patterns=DEFAULT_PATTERNS, proc=procfs.PROC, exclude_pids=None):
    """What to remove from `shm_dir`: files matching `patterns`, owned by `uid`, unused.

    Returns a dict:
      remove:       [{path, name, size, pattern, dev, ino}] owned by uid and used by nobody
      in_use:       [{path, owner, size, holders: [{pid, user, cmdline, via}]}] kept
      other_owner:  [{path, owner, size}] matching files of other users, kept
      skipped:      [{path, reason}] matching entries that are not regular files, kept
      uninspectable: PIDs whose open files/maps could not be read
    Raises ShmError when the directory cannot be read.
    """
    if exclude_pids is None:
        exclude_pids = (os.getpid(),)
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError as exc:
        raise ShmError("Shared memory: cannot list %s: %s. Fix: check that the "
                       "directory exists and the module runs as root (become: true)."
                       % (shm_dir, exc.strerror or exc))
    result = {"remove": [], "in_use": [], "other_owner": [], "skipped": [], "uninspectable": []}
    candidates = {}
    for name in names:
        pattern = _match(name, patterns)
        if pattern is None:
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            result["skipped"].append({"path": path, "reason": "cannot stat: %s" % exc.strerror})
            continue
        if not stat.S_ISREG(st.st_mode):
            kind = "symlink" if stat.S_ISLNK(st.st_mode) else \
                "directory" if stat.S_ISDIR(st.st_mode) else "special file"
            result["skipped"].append({"path": path, "reason": "%s, not a regular file" % kind})
            continue
        entry = {"path": path, "name": name, "size": st.st_size, "pattern": pattern,
                 "owner": procfs.user_name(st.st_uid), "dev": st.st_dev, "ino": st.st_ino,
                 "uid": st.st_uid}
        if st.st_uid != uid:
            result["other_owner"].append({"path": path, "owner": entry["owner"],
                                          "size": st.st_size})
            continue
        candidates[(st.st_dev, st.st_ino)] = path
        result["remove"].append(entry)
    found, uninspectable = procfs.holders(candidates, proc=proc, exclude_pids=exclude_pids)
    result["uninspectable"] = uninspectable
    keep = []
    for entry in result["remove"]:
        users = found.get(entry["path"])
        if not users:
            keep.append(entry)
            continue
        holders = []
        for holder in users:
            info = procfs.process_info(holder["pid"], proc=proc) or {}
            holders.append({"pid": holder["pid"], "user": info.get("user"),
                            "cmdline": info.get("cmdline"), "via": holder["via"]})
        result["in_use"].append({"path": entry["path"], "owner": entry["owner"],
                                 "size": entry["size"], "holders": holders})
    result["remove"] = keep
    return result


def removable(planned):
    """Split the plan into (files to remove, files left unverified).

    "Unused" must be proven: when some process's open files or mappings could not be read
    (not root, hidepid, an LSM), any of them might hold a candidate, so nothing is removed.
    """
    if planned["uninspectable"]:
        return [], list(planned["remove"])
    return list(planned["remove"]), []


def _inode_flags(fd):
    """The inode flags of an open file (0 when the file system does not say)."""
    buf = bytearray(struct.calcsize("l"))
    try:
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
    except OSError:
        return 0
    return struct.unpack_from("i", bytes(buf))[0]


def _flag_problem(flags):
    if flags & FS_IMMUTABLE_FL:
        return "immutable (chattr +i)"
    if flags & FS_APPEND_FL:
        return "append-only (chattr +a)"
    return None


def _file_flags(name, dir_fd, entry):
    """The inode flags of the planned file `name`, or 0 when it cannot be opened as that file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return 0
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (entry["dev"], entry["ino"]):
            return 0
        return _inode_flags(fd)
    finally:
        os.close(fd)


def _recheck(entry, dir_fd, stat_prefix=""):
    """(stat, None) while ``entry`` is still the planned file (same inode and owner, a regular
    file); (None, None) when it is gone; (stat or None, reason) when it changed or cannot be
    stat'ed (``stat_prefix`` + the error)."""
    try:
        st = os.stat(entry["name"], dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, stat_prefix + str(exc.strerror or exc)
    if (st.st_dev, st.st_ino, st.st_uid) != (entry["dev"], entry["ino"], entry["uid"]) or not stat.S_ISREG(st.st_mode):
        return st, "changed since it was checked (replaced or re-owned)"
    return st, None


def refusals(planned, shm_dir, euid=None):
    """Check, before anything is removed, that every planned file can be removed.

    Predicts the refusals unlink(2) would give - a read-only mount, a directory the caller cannot
    write, the sticky bit of a directory such as /dev/shm (only the file's or the directory's
    owner or root may remove an entry), an immutable or append-only directory or file - and
    re-checks that each file is still the planned one (same inode and owner, a regular file).
    Returns (ready, refused): ready = the planned entries that can go, refused = [{path,
    reason}]; files already gone are in neither. The caller removes nothing when refused is not
    empty, so one refusal leaves every file in place.
    """
    if not planned:
        return [], []
    euid = os.geteuid() if euid is None else euid
    try:
        dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ShmError("Cannot clean shared memory: cannot open %s: %s. Fix: check that the "
                       "directory exists and the module runs as root (become: true)."
                       % (shm_dir, exc.strerror or exc))
    ready, refused = [], []
    try:
        dst = os.fstat(dir_fd)
        whole = None
        flag = _flag_problem(_inode_flags(dir_fd))
        if os.fstatvfs(dir_fd).f_flag & os.ST_RDONLY:
            whole = "%s is on a read-only file system" % shm_dir
        elif flag:
            whole = "%s is %s" % (shm_dir, flag)
        elif not os.access(shm_dir, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            whole = "%s is not writable by uid %d (mode %04o, owner %s)" % (
                shm_dir, euid, stat.S_IMODE(dst.st_mode), procfs.user_name(dst.st_uid))
        for entry in planned:
            name = entry["name"]
            st, reason = _recheck(entry, dir_fd, "cannot stat: ")
            if st is None and reason is None:
                continue  # gone already: nothing to do
            if reason is None and whole:
                reason = whole
            elif reason is None and dst.st_mode & stat.S_ISVTX and euid not in (0, st.st_uid, dst.st_uid):
                reason = ("%s has the sticky bit and the file belongs to %s: only its owner, the "
                          "directory's owner or root may remove it" % (shm_dir, entry["owner"]))
            elif reason is None:
                flag = _flag_problem(_file_flags(name, dir_fd, entry))
                reason = "the file is %s" % flag if flag else None
            if reason:
                refused.append({"path": entry["path"], "reason": reason})
            else:
                ready.append(entry)
    finally:
        os.close(dir_fd)
    return ready, refused


def apply(planned, shm_dir):
    """Remove the planned files; re-check each just before unlinking it.

    A file is unlinked by name relative to an open descriptor of `shm_dir`, never through a
    path that could be redirected, and only if it is still the same inode with the same owner.
    Returns (removed, errors): removed = [{path, size}], errors = [{path, reason}].
    """
    removed, errors = [], []
    if not planned:
        return removed, errors
    dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for entry in planned:
            name = entry["name"]
            st, reason = _recheck(entry, dir_fd)
            if reason:
                errors.append({"path": entry["path"], "reason": reason + ("; left" if st is not None else "")})
                continue
            if st is None:
                continue  # gone already: nothing to do
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    continue
                errors.append({"path": entry["path"], "reason": exc.strerror or str(exc)})
                continue
            removed.append({"path": entry["path"], "size": entry["size"]})
    finally:
        os.close(dir_fd)
    return removed, errors


def public(planned):
    """The plan's entries as they appear in module results (no inode numbers)."""
    return [{"path": e["path"], "size": e["size"], "pattern": e["pattern"]} for e in planned]
