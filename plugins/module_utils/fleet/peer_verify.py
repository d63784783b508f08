# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""A peer copy checked, then published or undone, in this host's cache.

Every blob, the received ones (in the staging folder) and those already here, is opened with
O_NOFOLLOW (each folder on the way too) and fstat'd: only a regular file is hashed, from that
descriptor (hf_verify; already here, huggingface_hub's own link into this cache's marked shared
store is followed, the same way). Only when every blob matches are the received ones published
(``publish``: a hard link of the checked file at ``blobs/<sha256>``, never over an existing entry;
``share``: into this cache's shared Xet store when the listing gives a xet hash) and the
snapshot's links made from the expected list (``make_links``). ``discard`` undoes a bad copy: its
links and its blobs, except a blob that another snapshot links to or another commit's verified
manifest lists.
"""
from __future__ import annotations

import os
import stat

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_verify
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.store import xet_store
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_layout import confine
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.peer_files import PeerError, link_target, shared_link, units

# --------------------------------------------------------------------------------------------
# a regular file, opened without following a link, hashed from its descriptor
# --------------------------------------------------------------------------------------------
KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
         (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    for test, word in KINDS:
        if test(mode):
            return word
    return "of an unknown kind"


class NotRegular(Exception):
    """The entry at a path is not a regular file (the message says what it is)."""


def open_regular(root: str, rel: str) -> tuple:
    """(fd, stat) of the regular file ``root/rel``, every component opened with O_NOFOLLOW.

    NotRegular names what is there instead - a symbolic link (anywhere on the way), a directory, a
    FIFO, a socket, a device - before it is opened (a device or a FIFO is never opened); OSError
    (FileNotFoundError) when nothing is there. ``root`` itself is the operator's folder, trusted.
    """
    parts = [p for p in rel.split("/") if p]
    if not parts or ".." in parts:
        raise NotRegular("not a path under %s" % root)
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    dfd = os.open(root, dir_flags)
    try:
        for i, part in enumerate(parts[:-1]):
            st = os.stat(part, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                raise NotRegular("%s is %s" % ("/".join(parts[:i + 1]), kind_of(st.st_mode)))
            nfd = os.open(part, dir_flags | os.O_NOFOLLOW, dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
        st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            what = kind_of(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                what += " to %r" % os.readlink(parts[-1], dir_fd=dfd)
            raise NotRegular(what)
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                     dir_fd=dfd)
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            raise NotRegular("replaced while it was checked (now %s)" % kind_of(fst.st_mode))
        return fd, fst
    finally:
        os.close(dfd)


def check_blob(layout, name: str, entry: dict, staged: str = "", staging: str = "") -> dict:
    """Check one blob from a regular file's descriptor: ``staging/staged`` (a file the peer sent:
    nothing but a regular file passes), else ``<repo>/blobs/<name>`` already here (a regular
    file, or huggingface_hub's link into this cache's own shared Xet store, whose entry is then
    opened the same way). Never raises for content: {"ok", "reason", "kind", "algo", "digest",
    "hashed", "stat"}; ``kind`` is set when the entry is not a regular file."""
    algo, expected = hf_verify.expected_digest(entry)
    res = {"ok": False, "reason": "", "kind": None, "algo": algo, "digest": None, "hashed": 0, "stat": None}
    if staged:
        root, rel = staging, staged
    else:
        root, rel = layout.root, "%s/blobs/%s" % (layout.folder, name)
        shared = shared_link(layout, name)
        if shared:
            rel = shared
    try:
        fd, st = open_regular(root, rel)
    except NotRegular as exc:
        res.update(kind=str(exc), reason="%s is %s, not a regular file" % (rel, exc))
        return res
    except FileNotFoundError:
        res["reason"] = "missing"
        return res
    except OSError as exc:
        res["reason"] = "unreadable (%s)" % (exc.strerror or exc)
        return res
    try:
        res["stat"] = st
        if st.st_size != int(entry["size"]):
            res["reason"] = "size %d, expected %d" % (st.st_size, int(entry["size"]))
            return res
        digest, read = hf_verify.hash_fd(fd, algo, name=rel)
        res.update(digest=digest, hashed=read)
        if digest != expected:
            res["reason"] = "%s %s, expected %s" % (algo, digest, expected)
        elif read != int(entry["size"]):
            res["reason"] = "size changed while hashing (%d bytes read)" % read
        else:
            if staged:     # what huggingface_hub gives its blobs: 0666 less the umask, no peer's mode
                os.fchmod(fd, 0o666 & ~current_umask())
                res["stat"] = os.fstat(fd)
            res["ok"] = True
    except OSError as exc:
        res["reason"] = "unreadable (%s)" % (exc.strerror or exc)
    finally:
        os.close(fd)
    return res


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def verify(layout, commit: str, wanted: dict, workers: int = 0, received=None, staging: str = "",
           check_links: bool = True) -> tuple:
    """Hash every expected blob from a regular file's descriptor, one hash per blob: (verified
    records, failures, bytes hashed). ``received``: {blob: path under ``staging``} for the blobs a
    peer just sent (not yet published); the others are those here. ``check_links``: the
    snapshot's links must lead to their blobs (a rehash; a copy makes them after this check)."""
    received = received or {}
    verified, failures, hashed = {}, [], 0
    groups = units(wanted)
    with hf_verify.Verifier(workers, "full") as verifier:
        futures = {etag: verifier.run(check_blob, layout, etag, wanted[paths[0]], received.get(etag, ""), staging)
                   for etag, paths in groups.items()}
        for etag, fut in futures.items():
            res = fut.result()
            hashed += res.get("hashed", 0)
            paths = groups[etag]
            bad_link = []
            if res["ok"] and check_links:
                for p in paths:
                    link = layout.locate(commit, p)
                    if not os.path.islink(link) or os.readlink(link) != link_target(layout, commit, p, wanted[p]):
                        bad_link.append(p)
            if not res["ok"] or bad_link:
                failures.append({"path": paths[0], "blob": etag, "kind": res["kind"],
                                 "reason": res["reason"] or "link %s leads elsewhere" % bad_link[0],
                                 "hashed": res.get("hashed", 0)})
                continue
            for p in paths:
                verified[p] = dict(hf_manifest.fingerprint(res["stat"]), algo=res["algo"], digest=res["digest"])
    return verified, failures, hashed


# --------------------------------------------------------------------------------------------
# only a copy that verified: publish it, share it, link it; or undo it
# --------------------------------------------------------------------------------------------
def publish(layout, received: dict, staging: str, verified_stat: dict) -> list:
    """Hard-link each checked file into ``<repo>/blobs/<name>``, never over an existing entry; the
    published blob must be the very file that was checked (same inode). Returns the names."""
    done = []
    for name in sorted(received):
        src = os.path.join(staging, *received[name].split("/"))
        dest = os.path.join(layout.repo_path, "blobs", name)
        confine(dest, layout.repo_path, layout.repo_id)
        try:
            os.link(src, dest, follow_symlinks=False)
        except FileExistsError:
            raise PeerError("%s appeared while the copy was checked (another program writes this cache); "
                            "nothing of the copy was published over it; run again" % dest, "bad_layout")
        done.append(name)
        st = os.lstat(dest)
        want = verified_stat.get(name)
        if not stat.S_ISREG(st.st_mode) or (want and (st.st_dev, st.st_ino) != (want["dev"], want["ino"])):
            raise PeerError("%s is not the file that was checked; run again" % dest, "bad_layout")
    return done


def share(layout, wanted: dict, names) -> dict:
    """Move each published blob of ``names`` that the Hub's listing gives a xet hash into this
    cache's shared Xet store, leaving the link huggingface_hub's own Xet downloads leave
    (xet_store.publish_shared_payload). The hash comes from the controller's listing, never
    from the peer: a wrong one would name another file in the store. Best effort, as
    huggingface_hub's own publish: a blob that cannot be shared stays a regular repo blob."""
    out = {"published": 0, "kept": []}
    hashes = {}
    for etag, paths in units(wanted).items():
        xet_hash = wanted[paths[0]].get("xet_hash")
        if xet_hash:
            hashes[etag] = xet_hash
    for name in sorted(names):
        if name not in hashes:
            continue
        blob = os.path.join(layout.repo_path, "blobs", name)
        try:
            payload, why = xet_store.publish_shared_payload(layout.root, blob, hashes[name])
        except OSError as exc:
            payload, why = None, str(exc)
        if payload:
            out["published"] += 1
        else:
            out["kept"].append({"blob": name, "because": why})
    return out


def make_links(layout, commit: str, wanted: dict) -> tuple:
    """The snapshot's links as huggingface_hub makes them: (created, replaced)."""
    created, replaced = [], []
    for path in sorted(wanted):
        link = layout.locate(commit, path)
        target = link_target(layout, commit, path, wanted[path])
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        confine(link, layout.repo_path, layout.repo_id)
        if os.path.lexists(link):
            if os.path.isdir(link) and not os.path.islink(link):
                raise PeerError("%s is a folder where the snapshot needs the file %s; remove it and run again"
                                % (link, path), "bad_layout")
            os.unlink(link)
            replaced.append(link)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(target, link)
        created.append(link)
    return created, replaced


def discard(layout, commit: str, links: list, blobs: list) -> tuple:
    """Undo a copy: the links it made and this commit's links to ``blobs``, then those blobs
    unless something else uses them.

    Returns (removed paths, kept [{blob, because}]). A blob that another snapshot links to, or
    that another commit's verified manifest lists, stays.
    """
    removed, kept = [], []
    doomed = set(blobs)
    snapshot = layout.snapshot(commit)
    for dirpath, dirs, files in os.walk(snapshot):
        for name in files + dirs:
            link = os.path.join(dirpath, name)
            if os.path.islink(link) and os.path.basename(os.readlink(link)) in doomed and link not in links:
                links = list(links) + [link]
    for link in links:
        confine(link, layout.repo_path, layout.repo_id)
        if os.path.lexists(link):
            os.unlink(link)
            removed.append(link)
    users = layout.blob_users(commit)
    for name in blobs:
        path = os.path.join(layout.repo_path, "blobs", name)
        if name in users:
            kept.append({"blob": name, "because": users[name]})
            continue
        confine(path, layout.repo_path, layout.repo_id)
        if os.path.lexists(path):
            os.unlink(path)
            removed.append(path)
    return removed, kept
