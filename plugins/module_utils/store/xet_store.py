# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The cache-wide shared (Xet) blob store: recognise it, list and resolve its payloads, find the
links that reference them, remove an unreferenced payload and publish a repo blob into it.

The Xet layout (huggingface_hub >= 2.x downloading through hf_xet) adds a cache-wide shared store,
``<cache>/blobs`` (marked by ``.huggingface-shared-blobs``, content ``1``): each payload is a regular
read-only file ``blobs/<xx>/<xet hash>``, with ``<hash>.refs`` (the repo blob links that reference
it, a hint) and ``<hash>.lock``; a repo's ``blobs/<etag>`` is then a relative link into it. The
store folder is not a repo; a payload is freed only with its last link; ``shared_references`` and
``remove_shared_payload`` reconcile the store from the links really in the cache
(docs/architecture.md, "The Xet cache layout").

Pure stdlib: unit-tested directly, importable on any host.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat

from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import (
    IGNORED_NAMES,
    PREFIX_RE,
    SHARED_STORE_DIR,
    SHARED_STORE_LAYOUT,
    SHARED_STORE_MARKER,
    XET_HASH_RE,
    parse_repo_folder,
)


def shared_store_dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, SHARED_STORE_DIR)


def is_shared_store(cache_dir: str) -> bool:
    """Whether ``<cache_dir>/blobs`` is huggingface_hub's marked shared store (its
    ``is_shared_blobs_dir``: a real folder holding the marker, a regular file reading ``1``)."""
    if not cache_dir:
        return False
    folder = shared_store_dir(cache_dir)
    marker = os.path.join(folder, SHARED_STORE_MARKER)
    try:
        if not (stat.S_ISDIR(os.lstat(folder).st_mode) and stat.S_ISREG(os.lstat(marker).st_mode)):
            return False
        with open(marker, encoding="utf-8") as fh:
            return fh.read() == SHARED_STORE_LAYOUT
    except (OSError, UnicodeDecodeError):
        return False


def shared_payload_path(cache_dir: str, path: str):
    """``path`` (lexically normalised) when it names a payload of the store: exactly
    ``<cache>/blobs/<xx>/<64 hex>`` with ``xx`` the hash's first two digits; else None."""
    path = os.path.normpath(path)
    if os.path.dirname(os.path.dirname(path)) != shared_store_dir(cache_dir):
        return None
    name = os.path.basename(path)
    if XET_HASH_RE.match(name) and os.path.basename(os.path.dirname(path)) == name[:2]:
        return path
    return None


def store_payloads(cache_dir: str) -> list:
    """The payloads of a marked shared store (regular files, as huggingface_hub's
    shared_store_blob_paths lists them), sorted; [] when the store is not marked."""
    if not is_shared_store(cache_dir):
        return []
    out = []
    folder = shared_store_dir(cache_dir)
    for prefix in sorted(_listed(folder)):
        pdir = os.path.join(folder, prefix)
        if not PREFIX_RE.match(prefix) or not _is_dir(pdir):
            continue
        for name in sorted(_listed(pdir)):
            path = os.path.join(pdir, name)
            if XET_HASH_RE.match(name) and name.startswith(prefix) and _is_reg(path):
                out.append(path)
    return out


def _listed(folder: str) -> list:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_reg(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def link_payload(cache_dir: str, link: str):
    """The payload the symlink ``link`` points to (its target resolved lexically, as
    huggingface_hub's _shared_blob_target does), or None."""
    try:
        target = os.readlink(link)
    except OSError:
        return None
    return shared_payload_path(cache_dir, os.path.join(os.path.dirname(link), target))


def shared_references(cache_dir: str) -> tuple:
    """({payload: set of link paths}, complete) from the links really in the cache: every
    ``<cache>/<folder>/blobs/<name>`` that is a symlink into the store, whatever the folder's name
    (more references only keep more). ``complete`` is False when a folder's blobs could not be
    listed: a payload may then be referenced by a link that was not seen."""
    refs = {}
    complete = True
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return refs, False
    for name in entries:
        if name in (".locks", SHARED_STORE_DIR) or name in IGNORED_NAMES:
            continue
        blobs = os.path.join(cache_dir, name, "blobs")
        try:
            it = os.scandir(blobs)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            complete = False
            continue
        with it:
            for entry in it:
                try:
                    if not entry.is_symlink():
                        continue
                except OSError:
                    continue
                payload = link_payload(cache_dir, entry.path)
                if payload:
                    refs.setdefault(payload, set()).add(entry.path)
    return refs, complete


def manifest_references(cache_dir: str, payload: str):
    """The links the payload's ``.refs`` names that still point to it (validated against the file
    system, as huggingface_hub's _read_valid_manifest_references does); an empty set when there is
    no manifest, None when one exists but cannot be read."""
    manifest = payload + ".refs"
    try:
        st = os.lstat(manifest)
    except FileNotFoundError:
        return set()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        with open(manifest, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    out = set()
    for line in lines:
        if not line or os.path.isabs(line) or ".." in line.split("/"):
            continue
        link = os.path.join(cache_dir, *line.split("/"))
        if os.path.islink(link) and link_payload(cache_dir, link) == payload:
            out.add(link)
    return out


def _payload_lock(payload: str):
    """The payload's ``.lock`` (the file huggingface_hub's _shared_blob_lock flocks for a publish,
    a link and a sweep of that hash) opened without following a link and flocked non-blocking:
    the fd, or None when someone holds it."""
    fd = os.open(payload + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", payload + ".lock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return fd


def _unlink_held(path: str, fd: int) -> None:
    """Unlink the lock file ``path`` we hold as ``fd`` (only if it is still that file)."""
    try:
        if os.path.samestat(os.lstat(path), os.fstat(fd)):
            os.unlink(path)
    except FileNotFoundError:
        pass


def remove_shared_payload(cache_dir: str, payload: str, links=()) -> tuple:
    """Remove one payload of the shared store, with its ``.refs`` and ``.lock``, only if no link
    in the cache references it. ``links`` are the links shared_references() found to it (made
    before: each is checked again); the manifest's are read under the payload's lock, which every
    publish and link of huggingface_hub holds while it adds a reference. Returns (removed bytes,
    why it stays: '' when removed or already gone). Raises OSError when an unlink fails.

    The payload must be exactly ``<cache>/blobs/<xx>/<hash>`` of a marked store, reached through no
    symlink (its folder's real path is its folder) and a regular file: nothing else is unlinked.
    """
    cache_dir = os.path.normpath(cache_dir)
    if shared_payload_path(cache_dir, payload) != os.path.normpath(payload):
        return 0, "it is not a payload path of the shared store %s" % shared_store_dir(cache_dir)
    if not is_shared_store(cache_dir):
        return 0, "%s is not a marked shared store" % shared_store_dir(cache_dir)
    folder = os.path.dirname(payload)
    if os.path.realpath(folder) != folder:
        return 0, "its folder is reached through a symlink (it resolves to %s)" % os.path.realpath(folder)
    if not os.path.lexists(payload) and not os.path.lexists(payload + ".lock"):
        return 0, ""
    fd = _payload_lock(payload)
    if fd is None:
        return 0, "huggingface_hub holds its lock (a download publishes or links it)"
    try:
        try:
            st = os.lstat(payload)
        except FileNotFoundError:
            # swept already (huggingface_hub's sweep keeps the .lock): the lock goes once the
            # manifest is gone too
            if not os.path.lexists(payload + ".refs"):
                _unlink_held(payload + ".lock", fd)
            return 0, ""
        if not stat.S_ISREG(st.st_mode):
            return 0, "it is not a regular file"
        live = sorted(link for link in links if link_payload(cache_dir, link) == payload)
        if live:
            return 0, "%s still links to it" % live[0]
        manifest = manifest_references(cache_dir, payload)
        if manifest is None:
            return 0, "its manifest %s.refs cannot be read" % payload
        if manifest:
            return 0, "%s still links to it" % sorted(manifest)[0]
        os.unlink(payload)
        try:
            os.unlink(payload + ".refs")
        except FileNotFoundError:
            pass
        _unlink_held(payload + ".lock", fd)
        return st.st_size, ""
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _shared_modes(cache_dir: str) -> tuple:
    """(payload mode, folder mode) as huggingface_hub's _shared_blob_mode and
    _shared_directory_mode give them: read-only payloads, readable by whoever may traverse the
    cache root; folders with the cache root's own bits."""
    cache_mode = stat.S_IMODE(os.stat(cache_dir).st_mode)
    payload = 0o400 | (0o040 if cache_mode & stat.S_IXGRP else 0) | (0o004 if cache_mode & stat.S_IXOTH else 0)
    return payload, cache_mode & (0o777 | stat.S_ISGID | stat.S_ISVTX)


def _ensure_shared_store(cache_dir: str, modes: tuple) -> str:
    """Make ``<cache>/blobs`` the marked shared store if it does not exist yet ('' when it is one
    now), as huggingface_hub's first Xet download does; a folder that exists unmarked is not
    adopted (the reason). ``modes``: _shared_modes(cache_dir)."""
    if is_shared_store(cache_dir):
        return ""
    folder = shared_store_dir(cache_dir)
    try:
        os.mkdir(folder, modes[1])
    except FileExistsError:
        return "%s exists and is not a marked shared store" % folder
    marker = os.path.join(folder, SHARED_STORE_MARKER)
    tmp = "%s.%08x.tmp" % (marker, os.getpid() & 0xFFFFFFFF)
    with open(tmp, "x", encoding="utf-8") as fh:
        fh.write(SHARED_STORE_LAYOUT)
    os.chmod(tmp, modes[0])
    os.replace(tmp, marker)
    return "" if is_shared_store(cache_dir) else "%s could not be marked" % folder


def publish_shared_payload(cache_dir: str, blob: str, xet_hash: str) -> tuple:
    """Move the verified regular repo blob ``blob`` (``<cache>/<repo folder>/blobs/<name>``) into
    the cache-wide shared store as ``blobs/<xx>/<xet_hash>`` and leave a relative link in its
    place, the layout huggingface_hub's Xet downloads make (its publish_blob_to_shared_store:
    the reference appended to ``<hash>.refs`` before the link shows, under ``<hash>.lock``). The
    file keeps its inode (a rename), so what vouched for it still does.

    Returns (payload path, '') when published, (None, why) when the blob stays this repo's own
    regular file, which huggingface_hub reads as well: the store cannot be made, someone holds the
    payload's lock, or the store already has that payload (another repo's, whose links and
    manifests vouch for that inode: it is neither replaced nor trusted for this one)."""
    cache_dir = os.path.normpath(cache_dir)
    if not XET_HASH_RE.match(xet_hash or ""):
        return None, "%r is not a xet hash" % (xet_hash,)
    relative = os.path.relpath(blob, cache_dir).replace(os.sep, "/")
    parts = relative.split("/")
    if len(parts) != 3 or parse_repo_folder(parts[0]) is None or parts[1] != "blobs" or not _is_reg(blob):
        return None, "%s is not a regular repo blob of the cache %s" % (blob, cache_dir)
    payload_mode, folder_mode = modes = _shared_modes(cache_dir)
    why = _ensure_shared_store(cache_dir, modes)
    if why:
        return None, why
    prefix = os.path.join(shared_store_dir(cache_dir), xet_hash[:2])
    try:
        os.mkdir(prefix, folder_mode)
    except FileExistsError:
        pass
    if not _is_dir(prefix):
        return None, "%s is not a folder" % prefix
    payload = os.path.join(prefix, xet_hash)
    fd = _payload_lock(payload)
    if fd is None:
        return None, "huggingface_hub holds the lock of %s (a download publishes or links it)" % payload
    link = None
    try:
        if os.path.lexists(payload):
            return None, "the shared store already has %s (another repo's)" % payload
        manifest = os.open(payload + ".refs", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            if not stat.S_ISREG(os.fstat(manifest).st_mode):
                return None, "%s.refs is not a regular file" % payload
            line = (relative + "\n").encode()
            if os.write(manifest, line) != len(line):
                return None, "%s.refs could not be written" % payload
            os.fsync(manifest)
        finally:
            os.close(manifest)
        link = os.path.join(os.path.dirname(blob), ".%s.%s.shared" % (os.path.basename(blob), secrets.token_hex(4)))
        os.symlink(os.path.relpath(payload, os.path.dirname(blob)), link)
        os.chmod(blob, payload_mode)
        os.replace(blob, payload)
        try:
            os.replace(link, blob)
        except OSError:
            os.replace(payload, blob)       # back as it was: the blob is never lost
            raise
        link = None
        return payload, ""
    finally:
        if link is not None and os.path.lexists(link):
            os.unlink(link)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
