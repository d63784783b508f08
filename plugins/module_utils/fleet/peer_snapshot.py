# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""A snapshot copied from a peer host, verified against the Hub's file list (peer_snapshot's logic).

The expected files come from the Hub's listing of the commit, made once per run on the
controller: ``[{"path", "size", "etag"}]`` (``etag``: the sha256 of an LFS file, which is also its
blob name in the cache, or the git blob sha1 of any other file; store/disk_plan.py's
``list_target`` gives that shape). Nothing a peer sends is trusted: a copy counts only once every
expected file hashes to its etag here (hf_verify, the same code hf_snapshot verifies with).

In the Hugging Face cache layout (``blobs/<etag>``, ``snapshots/<commit>/<path>`` as relative
links to ``../../blobs/<etag>``, ``refs/<revision>``) a copy is:

1. under the repository lock hf_snapshot takes (``.locks/<repo>/modelswap.lock``), the blobs the
   host lacks are pulled from the peer with rsync over SSH, by name (``--files-from``), bytes only
   (COPY_FLAGS: no links, devices, FIFOs, owners or modes of the peer's choosing), into a staging
   folder (``.locks/<repo>/peer-incoming``). A dry run lists them first: a blob that is
   huggingface_hub 2.4's relative link into the peer's cache-wide Xet store
   (``blobs/<xx>/<xet hash>``) is pulled by that entry's name; any other link, a folder or a special
   file is refused (``bad_copy``). The peer may serve through ``rrsync -ro <its cache>`` (its
   authorized_keys' forced command, ``source_root``): the names are then relative to that folder;
2. every blob, the received ones and those already here, is opened with O_NOFOLLOW (each folder
   on the way too) and fstat'd: only a regular file is hashed, from that descriptor (already here,
   huggingface_hub's own link into this cache's marked shared store is followed, the same way);
3. only when every blob matches are the received ones published (a hard link of the checked file
   at ``blobs/<sha256>``, a regular blob as huggingface_hub writes without the shared store, never
   over an existing entry), the snapshot's links made here from the expected list (not copied), and
   the manifest written (format ``modelswap.hf_snapshot/1``, as hf_snapshot writes it: the next
   run, vllm_service and hf_snapshot itself see the snapshot verified), and the ref and the
   deployment record's ``fetched.<name>`` too;
4. a copy that does not verify publishes nothing (the staging folder is removed); a bad blob that
   was already here is deleted, except a blob that another snapshot links to or another commit's
   verified manifest lists, and the cause says whom to blame:
   ``bad_copy`` (a blob the peer sent does not match or is not a regular file: the peer's copy is bad),
   ``source_incomplete`` (the peer lacks files), ``copy_failed`` (rsync or SSH failed), or
   ``local_bad`` (a blob that was already here does not match; it is deleted when nothing else
   uses it, so the next copy fetches it).

A manifest written here keeps, as its ``listing``, only the expected files (``listing_scope:
selected``, with the patterns they were selected by): hf_snapshot uses such a listing only for the
same patterns. With ``store`` (hosts that mount the same store), the manifest says so and the
cheap check (one ``stat`` per file) ignores the device number, which differs between the hosts
that mount one NFS export.

Pure logic over plain values: a ``HostCommands`` runs rsync (tests pass a copier of their own).
"""
from __future__ import annotations

import os
import posixpath
import re
import shlex
import shutil
import stat
import tempfile
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_verify
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.common import hub_trust
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_snapshot import (
    CacheLayout, FetchError, RepoLock, available_bytes, confine)
from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_store
from ansible_collections.modelswap.vllm.plugins.module_utils.store.model_store import (
    COMMIT_RE, StoreError, validate_repo_id)

STATES = ("read", "copied", "verified")
MODULE = "modelswap.vllm.peer_snapshot"
SCOPE_SELECTED = "selected"
# rsync's exit codes: the peer lacks files (23: partial transfer, 24: vanished), or the
# connection / the remote side failed (the rest).
RSYNC_SOURCE_INCOMPLETE = (23, 24)
FILES_FIX = ("pass the controller's listing of the target ({commit, files: [{path, size, etag}]}, "
             "store/disk_plan.py list_target or the role's own listing)")


class PeerError(Exception):
    """A failure with a ``cause`` the role acts on (the message is final)."""

    def __init__(self, msg: str, cause: str, result=None):
        super().__init__(msg)
        self.cause = cause
        self.result = result or {}


# --------------------------------------------------------------------------------------------
# the expected files
# --------------------------------------------------------------------------------------------
def lfs_pointer_oid(sha256: str, size: int) -> str:
    """The git blob id the Hub lists for an LFS file: that of its pointer file."""
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n" % (sha256, size)
    return hf_verify.git_blob_id(pointer.encode())


def expected_listing(files) -> dict:
    """``{path: {"size", "blob_id", "lfs_sha256"?, "xet_hash"?}}`` (hf_snapshot's tree entries) from ``files``.

    An etag of 64 hex digits is an LFS file's sha256; one of 40 is a git blob sha1. Every path and
    id is checked (hub_trust) before it becomes a path on disk; PeerError names a bad entry.
    """
    if not isinstance(files, list) or not files:
        raise PeerError("the expected file list is empty or not a list; %s" % FILES_FIX, "bad_files")
    listing = {}
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            raise PeerError("files[%d] is not a mapping of path, size, etag; %s" % (i, FILES_FIX), "bad_files")
        path, size, etag = f.get("path"), f.get("size"), f.get("etag")
        if path in listing:
            raise PeerError("files lists %r twice; %s" % (path, FILES_FIX), "bad_files")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PeerError("files[%d] (%r) has size %r, not a byte count; %s" % (i, path, size, FILES_FIX),
                            "bad_files")
        if not isinstance(etag, str) or hub_trust.id_problem(etag):
            raise PeerError("files[%d] (%r) has etag %r, which is neither a sha256 nor a git blob id; %s"
                            % (i, path, etag, FILES_FIX), "bad_files")
        if len(etag) == 64:
            listing[path] = {"size": size, "blob_id": lfs_pointer_oid(etag, size), "lfs_sha256": etag}
        else:
            listing[path] = {"size": size, "blob_id": etag}
        if f.get("xet_hash") is not None:
            listing[path]["xet_hash"] = f["xet_hash"]       # checked by listing_problems below
    problems = hub_trust.listing_problems(listing)
    if problems:
        raise PeerError("the expected file list has an unsafe entry: %s; nothing was written or deleted; %s"
                        % ("; ".join(problems), FILES_FIX), "bad_files")
    return listing


def blob_of(entry: dict) -> str:
    return entry.get("lfs_sha256") or entry["blob_id"]


def units(wanted: dict) -> dict:
    """{etag: [paths]}: files that share a blob are copied and hashed once."""
    out = {}
    for path in sorted(wanted):
        out.setdefault(blob_of(wanted[path]), []).append(path)
    return out


# --------------------------------------------------------------------------------------------
# what is here
# --------------------------------------------------------------------------------------------
def link_target(layout, commit: str, path: str, entry: dict) -> str:
    """The relative link huggingface_hub makes: snapshots/<commit>/<path> -> ../../blobs/<etag>."""
    link = layout.locate(commit, path)
    return os.path.relpath(layout.blob(entry), os.path.dirname(link))


def inspect(layout, commit: str, wanted: dict, shared: bool) -> dict:
    """Read-only: does a manifest vouch for ``wanted`` (one stat per file), which blobs are missing."""
    manifest_file = hf_manifest.manifest_path(layout.meta_root, commit)
    manifest = hf_manifest.read_manifest(manifest_file, layout.repo_id, commit)
    ok, stale = hf_manifest.covers(manifest, wanted, lambda p: layout.locate(commit, p), "full",
                                   same_device=not shared)
    missing = {}
    for etag, paths in units(wanted).items():
        if not os.path.lexists(os.path.join(layout.repo_path, "blobs", etag)):
            missing[etag] = int(wanted[paths[0]]["size"])
    reason = None
    if not ok:
        reason = ("no verified manifest of %s@%s at %s" % (layout.repo_id, commit[:12], manifest_file)
                  if manifest is None else
                  "%d file(s) not vouched for by %s (e.g. %s)" % (len(stale), manifest_file, ", ".join(stale[:3])))
    return {"manifest": manifest, "manifest_file": manifest_file, "verified": ok, "stale": stale,
            "missing": missing, "missing_bytes": sum(missing.values()), "reason": reason}


# --------------------------------------------------------------------------------------------
# the copy
# --------------------------------------------------------------------------------------------
# The flags of the copy: bytes only. No --archive: it keeps symlinks (-l), devices and FIFOs (-D),
# owners, groups and modes (-ogp) as the peer chooses. Without them rsync skips a symlink, device,
# FIFO or socket ("skipping non-regular file"), owns what it writes as the receiving user and
# gives it the receiver's umask; --times only keeps the peer's mtimes. No --recursive: the names
# are files (--files-from implies --relative and --dirs), so a name that is a folder on the peer
# arrives as an empty folder that the receiver refuses, never as a tree of the peer's choosing.
# No --copy-links either: rrsync, the forced command a peer serves through (rrsync(1)), refuses
# -L under a restricted folder ("option -L has been disabled on this server"), since a link
# could lead out of it; the one kind of link a copy needs, huggingface_hub's Xet layout
# (models--o--n/blobs/<sha256> -> ../../blobs/<xx>/<xet hash>, a cache-wide store), is resolved
# here from a dry run's listing (``resolve_listing``), only when it leads into that store, and
# its target is pulled by its own name.
COPY_FLAGS = ("--times", "--no-links", "--no-devices", "--no-specials", "--ignore-existing")
# The dry run that lists what the peer has under the names: links are listed with their target
# (%L), nothing is written (--dry-run creates no file, folder or link).
LIST_FLAGS = ("--dry-run", "--links", "--no-devices", "--no-specials", "--itemize-changes",
              "--out-format=%i|%n|%L")
# huggingface_hub 2.4's cache-wide store of Xet payloads (utils/_shared_blobs.py): regular files
# <cache>/blobs/<first 2 hex>/<xet hash>, in a store model_store.is_shared_store recognises.
SHARED_ENTRY_RE = re.compile(r"^blobs/([0-9a-f]{2})/([0-9a-f]{64})$")
# Where a copy lands before it is checked: under the repository's lock folder, on the cache's file
# system (a checked file is published with a hard link, never a second copy of its bytes).
STAGING_NAME = "peer-incoming"
KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
         (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    for test, word in KINDS:
        if test(mode):
            return word
    return "of an unknown kind"


def source_dir(source_cache_dir: str, serve_root: str = "") -> str:
    """The peer's cache folder as rsync names it on the peer: absolute, or, when the peer serves
    through ``rrsync -ro <serve_root>`` (``serve_root`` set), relative to that folder ("" = it)."""
    cache = posixpath.normpath(source_cache_dir or "/")
    if not serve_root:
        return cache.rstrip("/") + "/"
    if not posixpath.isabs(cache) or not posixpath.isabs(serve_root):
        raise PeerError("source_root %r and source_cache_dir %r must be absolute paths on the peer"
                        % (serve_root, source_cache_dir), "bad_option")
    rel = posixpath.relpath(cache, posixpath.normpath(serve_root))
    if rel == ".":
        return ""
    if rel == ".." or rel.startswith("../"):
        raise PeerError("the peer's cache %s is outside the folder its rrsync serves (source_root %s); "
                        "root the peer's forced command at its cache folder or above it"
                        % (source_cache_dir, serve_root), "bad_option")
    return rel + "/"


def rsync_argv(rsync: str, *, source: str, user: str, port: int, source_path: str, dest: str,
               list_file: str, ssh_key: str = "", known_hosts: str = "", connect_timeout: int = 10,
               io_timeout: int = 300, bwlimit: int = 0, ssh: str = "ssh", list_only: bool = False) -> list:
    """rsync pulling the files named in ``list_file`` (relative to ``source_path``, the peer's cache,
    ``source_dir``) from ``user@source`` over SSH into ``dest``, bytes only (COPY_FLAGS), with host
    key checking on, never over an existing file; ``list_only``: the dry run that lists them."""
    shell = [ssh, "-p", str(port), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
             "-o", "ConnectTimeout=%d" % connect_timeout]
    if ssh_key:
        shell += ["-i", ssh_key, "-o", "IdentitiesOnly=yes"]
    if known_hosts:
        shell += ["-o", "UserKnownHostsFile=%s" % known_hosts]
    host = "[%s]" % source if ":" in source else source
    argv = [rsync] + list(LIST_FLAGS if list_only else COPY_FLAGS) + [
        "--files-from=%s" % list_file, "--timeout=%d" % io_timeout,
        "--rsh=%s" % " ".join(shlex.quote(a) for a in shell)]
    if bwlimit and not list_only:
        argv.append("--bwlimit=%d" % bwlimit)
    return argv + ["%s@%s:%s" % (user, host, source_path), dest.rstrip("/") + "/"]


def shared_entry(folder: str, target: str):
    """``blobs/<xx>/<xet hash>`` (relative to the cache) when ``target``, the value of the link
    ``<folder>/blobs/<name>``, is huggingface_hub's link into the cache-wide Xet store; else None."""
    if not target or target.startswith("/"):
        return None
    rel = posixpath.normpath(posixpath.join(folder, "blobs", target))
    m = SHARED_ENTRY_RE.match(rel)
    return rel if m and m.group(2).startswith(m.group(1)) else None


def resolve_listing(folder: str, names, stdout: str, stderr: str = "") -> tuple:
    """From the dry run's itemized listing (LIST_FLAGS): ({name: path to pull, relative to the
    peer's cache}, {name: why the peer's entry is refused}). A name in neither is absent there."""
    expected = {"%s/blobs/%s" % (folder, n): n for n in names}
    pull, refused = {}, {}
    for line in (stdout or "").splitlines():
        parts = line.split("|", 2)
        rel = parts[1].rstrip("/") if len(parts) == 3 else ""      # a folder is listed as "name/"
        if rel not in expected or len(parts[0]) < 2:
            continue
        name, kind, tail = expected[rel], parts[0][1], parts[2]
        if kind == "f":
            pull[name] = rel
        elif kind == "L":
            target = tail[4:] if tail.startswith(" -> ") else ""
            entry = shared_entry(folder, target)
            if entry:
                pull[name] = entry
            else:
                refused[name] = ("a symbolic link to %r, which is not huggingface_hub's link into the peer's "
                                 "shared Xet store (../../blobs/<xx>/<xet hash>)" % target)
        elif kind == "d":
            refused[name] = "a directory"
        else:
            refused[name] = "not a regular file (rsync item type %r)" % kind
    for m in re.finditer(r'skipping non-regular file "([^"]+)"', "%s\n%s" % (stdout or "", stderr or "")):   # info: stdout
        name = expected.get(m.group(1))
        if name and name not in pull:
            refused[name] = "not a regular file (a device, FIFO or socket)"
    return pull, refused


def rsync_copier(commands, *, source_cache_dir: str = "", serve_root: str = "", **settings):
    """A copier for ``PeerJob.copy``: rsync through ``commands`` (a HostCommands); ``ssh`` (in
    ``settings``) replaces the SSH client (tests: a local transport)."""
    rsync = commands.which("rsync")
    ssh = settings.pop("ssh", None) or commands.which("ssh")
    if not rsync or not ssh:
        raise PeerError("copying from a peer needs rsync and an SSH client on this host (%s missing); "
                        "install them (apt-get install rsync openssh-client)"
                        % " and ".join(n for n, p in (("rsync", rsync), ("ssh", ssh)) if not p), "no_rsync")

    def run(lines, dest, lock_dir, list_only):
        fd, list_file = tempfile.mkstemp(prefix="peer-files.", suffix=".txt", dir=lock_dir)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write("".join("%s\n" % line for line in lines))
            argv = rsync_argv(rsync, ssh=ssh, source_path=source_dir(source_cache_dir, serve_root), dest=dest,
                              list_file=list_file, list_only=list_only, **settings)
            return commands.run(argv)
        finally:
            os.unlink(list_file)

    def copy(names, folder, staging, lock_dir):
        rc, stdout, stderr = run(["%s/blobs/%s" % (folder, n) for n in names], staging, lock_dir, True)
        if rc != 0:
            return {"rc": rc, "stderr": stderr, "files": {}, "refused": {}}
        pull, refused = resolve_listing(folder, names, stdout, stderr)
        if refused or not pull:
            return {"rc": 0, "stderr": stderr, "files": pull, "refused": refused}
        rc, _stdout, stderr = run(sorted(set(pull.values())), staging, lock_dir, False)
        return {"rc": rc, "stderr": stderr, "files": pull, "refused": refused}
    return copy


def stale_temps(blobs_dir: str, names) -> list:
    """rsync's temporary files of ``names`` (``.<name>.XXXXXX``) that a killed copy left."""
    out = []
    try:
        present = os.listdir(blobs_dir)
    except OSError:
        return out
    wanted = set(names)
    for entry in present:
        if entry.startswith(".") and entry.count(".") >= 2:
            name = entry[1:].rsplit(".", 1)[0]
            if name in wanted and len(entry) == len(name) + 8:
                out.append(os.path.join(blobs_dir, entry))
    return sorted(out)


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


# --------------------------------------------------------------------------------------------
# a regular file, opened without following a link, hashed from its descriptor
# --------------------------------------------------------------------------------------------
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


def shared_link(layout, name: str):
    """``blobs/<xx>/<xet hash>`` when ``<repo>/blobs/<name>`` is huggingface_hub's link into this
    cache's marked shared Xet store (a link this host's own downloads made); else None."""
    try:
        target = os.readlink(os.path.join(layout.repo_path, "blobs", name))
    except OSError:
        return None
    return shared_entry(layout.folder, target) if model_store.is_shared_store(layout.root) else None


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
    (model_store.publish_shared_payload). The hash comes from the controller's listing, never
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
            payload, why = model_store.publish_shared_payload(layout.root, blob, hashes[name])
        except OSError as exc:
            payload, why = None, str(exc)
        if payload:
            out["published"] += 1
        else:
            out["kept"].append({"blob": name, "because": why})
    return out


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


# --------------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------------
DEFAULTS = dict(
    state="read", revision="", cache_dir=None, files=None, allow_patterns=None, ignore_patterns=None,
    source="", source_name="", source_cache_dir="", source_root="", source_user="root", source_port=22, ssh_key="",
    known_hosts="", connect_timeout=10, io_timeout=300, bwlimit=0, store="", endpoint="",
    verify_workers=0, rehash=False, lock_timeout=3600, record="", record_name="", use_xet=True,
)


class PeerJob:
    """One peer_snapshot run over plain option values; ``run(check_mode)`` returns the result."""

    def __init__(self, repo_id: str, commit: str, copier=None, **opts):
        unknown = set(opts) - set(DEFAULTS)
        if unknown:
            raise TypeError("unknown options: %s" % ", ".join(sorted(unknown)))
        self.o = dict(DEFAULTS, **opts)
        self.repo_id = repo_id
        self.commit = commit
        self.copier = copier
        self.state = self.o["state"]
        self.source_name = self.o["source_name"] or self.o["source"]
        self.timings = {}

    # ------------------------------------------------------------------ checks, then the plan
    def setup(self) -> None:
        if self.state not in STATES:
            raise PeerError("state must be one of %s" % ", ".join(STATES), "bad_option")
        try:
            validate_repo_id(self.repo_id)
        except StoreError as exc:
            raise PeerError("%s; fix repo_id (the catalog's repo_id)" % exc, "bad_option")
        if not isinstance(self.commit, str) or not COMMIT_RE.match(self.commit):
            raise PeerError("commit %r is not a commit: give the 40 lowercase hex digits the controller's "
                            "listing resolved" % (self.commit,), "bad_option")
        if self.state == "copied" and not self.o["source"]:
            raise PeerError("state=copied needs source (the address of a host that has %s@%s verified)"
                            % (self.repo_id, self.commit[:12]), "bad_option")
        if not self.o["cache_dir"]:
            raise PeerError("cache_dir is required (the Hugging Face hub cache on this host)", "bad_option")
        self.wanted = expected_listing(self.o["files"])
        self.layout = CacheLayout(os.path.realpath(os.path.expanduser(self.o["cache_dir"])), self.repo_id)
        self.shared = bool(self.o["store"])

    def base(self, look: dict) -> dict:
        return {
            "state": self.state, "repo_id": self.repo_id, "commit": self.commit,
            "snapshot_path": self.layout.snapshot(self.commit), "manifest": look["manifest_file"],
            "files": len(self.wanted), "bytes_total": sum(int(e["size"]) for e in self.wanted.values()),
            "store": self.o["store"] or None, "source": self.source_name or None,
            "missing": {"blobs": len(look["missing"]), "bytes": look["missing_bytes"]},
            "verified": look["verified"], "reason": look["reason"],
            "copied": {"from": None, "blobs": 0, "bytes": 0, "seconds": 0.0},
            "verification": {"mode": "manifest" if look["verified"] else None, "ok": look["verified"],
                             "files": 0, "hashed_bytes": 0, "seconds": 0.0, "failures": []},
            "removed": [], "kept_blobs": [], "links": {"created": 0, "replaced": 0},
            "shared_store": {"published": 0, "kept": []},
            "recorded": False, "changed": False,
        }

    def run(self, check_mode: bool) -> dict:
        self.setup()
        look = inspect(self.layout, self.commit, self.wanted, self.shared)
        out = self.base(look)
        if self.state == "read":
            out["summary"] = self.summary(out)
            return out
        needs_work = not look["verified"] or (self.state == "verified" and self.o["rehash"])
        if self.state == "verified" and not self.o["rehash"] and not look["verified"]:
            raise PeerError("%s@%s is not verified at %s: %s; fetch it (model_fetch) or copy it from a peer "
                            "(state=copied)" % (self.repo_id, self.commit[:12], self.layout.snapshot(self.commit),
                                                look["reason"]), "not_verified", out)
        if check_mode:
            if needs_work and self.state == "copied":
                out["copied"].update(**{"from": self.source_name, "blobs": len(look["missing"]),
                                        "bytes": look["missing_bytes"]})
            out["changed"] = needs_work or self._record_changes(out)
            out["summary"] = self.summary(out, check_mode=True, needs_work=needs_work)
            return out
        if needs_work:
            needs_work = self.work(look, out)
        out["recorded"] = self.record(out)
        out["changed"] = needs_work or out["recorded"]
        out["summary"] = self.summary(out, needs_work=needs_work)
        return out

    # ------------------------------------------------------------------ the work, under the lock
    def work(self, look: dict, out: dict) -> bool:
        """Copy or rehash under the repository lock; False when another run did it meanwhile."""
        layout = self.layout
        lock = RepoLock(layout.lock_path)
        started = time.monotonic()
        if not lock.acquire(float(self.o["lock_timeout"])):
            raise PeerError("another download of %s into %s holds %s (%s) for more than %ds; wait for it "
                            "to end, then run again" % (self.repo_id, layout.root, layout.lock_path,
                                                        lock.holder(), int(self.o["lock_timeout"])),
                            "locked", out)
        self.timings["lock_s"] = time.monotonic() - started
        try:
            look = inspect(layout, self.commit, self.wanted, self.shared)   # it may be done by now
            out.update(verified=look["verified"], reason=look["reason"],
                       missing={"blobs": len(look["missing"]), "bytes": look["missing_bytes"]})
            if look["verified"] and not (self.state == "verified" and self.o["rehash"]):
                return False
            if self.state == "copied":
                self.copy(look, out)
            else:
                self.rehash(look, out)
            return True
        finally:
            lock.release()

    def copy(self, look: dict, out: dict) -> None:
        layout = self.layout
        blobs_dir = os.path.join(layout.repo_path, "blobs")
        names = sorted(look["missing"])
        for temp in stale_temps(blobs_dir, names):
            confine(temp, layout.repo_path, self.repo_id)
            os.unlink(temp)
            out["removed"].append(temp)
        staging = os.path.join(layout.lock_dir, STAGING_NAME)
        if os.path.lexists(staging):            # a killed copy's leftovers: nothing of it is trusted
            shutil.rmtree(staging)
            out["removed"].append(staging)
        free = available_bytes(layout.root)
        if look["missing_bytes"] > free:
            raise PeerError("not enough space for %s@%s under %s: %s to copy, %s available; free space "
                            "(model_purge) and run again; nothing was copied"
                            % (self.repo_id, self.commit[:12], layout.root, human_bytes(look["missing_bytes"]),
                               human_bytes(free)), "disk_full", out)
        os.makedirs(blobs_dir, exist_ok=True)
        try:
            self.copy_staged(look, out, names, staging)
        finally:
            if os.path.lexists(staging):        # a checked copy is published by now, the rest is scrap
                shutil.rmtree(staging, ignore_errors=True)

    def copy_staged(self, look: dict, out: dict, names: list, staging: str) -> None:
        layout = self.layout
        os.makedirs(staging)
        started = time.monotonic()
        got = {"rc": 0, "stderr": "", "files": {}, "refused": {}}
        if names:
            got = self.copier(names, layout.folder, staging, layout.lock_dir)
        rc, stderr = got["rc"], got["stderr"]
        received = {n: rel for n, rel in got["files"].items() if n in look["missing"]}
        arrived = [n for n, rel in received.items() if os.path.lexists(os.path.join(staging, *rel.split("/")))]
        out["copied"].update(**{"from": self.source_name, "blobs": len(arrived),
                                "bytes": sum(look["missing"][n] for n in arrived),
                                "seconds": round(time.monotonic() - started, 3)})
        absent = [n for n in names if n not in received and n not in got["refused"]]
        if rc == 0 and absent and not got["refused"]:
            rc = 23
            stderr = stderr or "the peer has no file %s/blobs/%s" % (layout.folder, absent[0])
        if rc != 0:
            cause = "source_incomplete" if rc in RSYNC_SOURCE_INCOMPLETE else "copy_failed"
            hint = ("the peer lacks files of the snapshot it claims verified" if cause == "source_incomplete"
                    else "check SSH from this host to the peer (key, known host key, address)")
            if self.o["source_root"]:
                hint += ("; the peer must serve through its forced command rrsync -ro %s (source_root; "
                         "roles/model_fetch/README.md, Peer access)" % self.o["source_root"])
            raise PeerError("copying %d blob(s) of %s@%s from %s failed (rsync exit %d: %s); %s; nothing of the "
                            "copy was published" % (len(names), self.repo_id, self.commit[:12], self.source_name,
                                                    rc, tail(stderr), hint), cause, out)
        if got["refused"]:
            failures = [{"path": units(self.wanted)[n][0], "blob": n, "kind": why,
                         "reason": "the peer has %s/blobs/%s as %s" % (layout.folder, n, why), "hashed": 0}
                        for n, why in sorted(got["refused"].items())]
            out["verification"] = {"mode": "full", "ok": False, "files": 0, "hashed_bytes": 0, "seconds": 0.0,
                                   "failures": failures}
            look = inspect(layout, self.commit, self.wanted, self.shared)
            out.update(verified=False, missing={"blobs": len(look["missing"]), "bytes": look["missing_bytes"]})
            raise PeerError("%d file(s) of %s@%s at %s are not regular files there (e.g. %s: %s): %s's copy is "
                            "damaged although it claims it verified; nothing was copied or published"
                            % (len(failures), self.repo_id, self.commit[:12], self.source_name,
                               failures[0]["path"], failures[0]["reason"], self.source_name), "bad_copy", out)
        self.check_and_record(out, received, staging, blame=self.source_name)

    def rehash(self, look: dict, out: dict) -> None:
        """state=verified with rehash: hash what is here; a mismatch drops the manifest and the bad
        blobs nothing else uses, so the host no longer claims the snapshot."""
        self.check_and_record(out, {}, "", blame=None)

    def check_and_record(self, out: dict, received: dict, staging: str, blame) -> None:
        """Check every blob (``received``: {blob: path under ``staging``}, the peer's, not yet
        published; the others already here); only when all match, publish the received ones, make
        the snapshot's links and write the manifest."""
        layout = self.layout
        started = time.monotonic()
        verified, failures, hashed = verify(layout, self.commit, self.wanted, int(self.o["verify_workers"]),
                                            received=received, staging=staging, check_links=blame is None)
        seconds = round(time.monotonic() - started, 3)
        out["verification"] = {"mode": "full", "ok": not failures, "files": len(verified),
                               "hashed_bytes": hashed, "seconds": seconds, "failures": failures}
        if not failures:
            groups = units(self.wanted)
            checked = {n: verified[groups[n][0]] for n in received}
            published = publish(layout, received, staging, checked)
            if self.o["use_xet"]:
                out["shared_store"] = share(layout, self.wanted, published)
            if blame is not None:
                links, replaced = make_links(layout, self.commit, self.wanted)
                out["links"] = {"created": len(links), "replaced": len(replaced)}
            self.write_manifest(verified)
            out.update(verified=True, reason=None, missing={"blobs": 0, "bytes": 0})
            return
        bad_here = [f["blob"] for f in failures if f["blob"] not in received]
        if blame is None:     # a rehash: the host must stop claiming the snapshot
            manifest_file = hf_manifest.manifest_path(layout.meta_root, self.commit)
            if os.path.lexists(manifest_file):
                os.unlink(manifest_file)
                out["removed"].append(manifest_file)
        removed, kept = discard(layout, self.commit, [], bad_here)
        out["removed"] += removed
        out["kept_blobs"] += kept
        look = inspect(layout, self.commit, self.wanted, self.shared)
        out.update(verified=False, missing={"blobs": len(look["missing"]), "bytes": look["missing_bytes"]})
        first = failures[0]
        from_peer = [f for f in failures if f["blob"] in received]
        if blame and from_peer:
            cause = "bad_copy"
            why = ("%d file(s) copied from %s do not match the Hub's listing or are not regular files (e.g. %s: "
                   "%s): %s's copy is damaged although it claims it verified; nothing of the copy was published; "
                   % (len(from_peer), blame, from_peer[0]["path"], from_peer[0]["reason"], blame))
        else:
            cause = "local_bad" if blame else "bad_content"
            why = ("%d file(s) already on this host do not match the Hub's listing or are not regular files "
                   "(e.g. %s: %s); " % (len(failures), first["path"], first["reason"]))
        raise PeerError("verifying %s@%s at %s failed: %sremoved %d file(s)%s; nothing was recorded as "
                        "verified" % (self.repo_id, self.commit[:12], layout.snapshot(self.commit), why,
                                      len(removed), " (kept %d blob(s) other revisions use)" % len(kept)
                                      if kept else ""), cause, out)

    def write_manifest(self, verified: dict) -> None:
        layout = self.layout
        manifest = hf_manifest.build_manifest(
            repo_id=self.repo_id, revision=self.o["revision"] or self.commit, commit=self.commit,
            endpoint=self.o["endpoint"] or "", layout=layout.kind, snapshot=layout.snapshot(self.commit),
            listing=self.wanted, verified=verified, mode="full",
            patterns={"allow": self.o["allow_patterns"] or None, "ignore": self.o["ignore_patterns"] or None},
            tool={"module": MODULE, "copied_from": self.source_name or None})
        manifest["listing_scope"] = SCOPE_SELECTED
        if self.o["store"]:
            manifest["store"] = self.o["store"]
        hf_manifest.atomic_write_json(hf_manifest.manifest_path(layout.meta_root, self.commit), manifest)
        revision = self.o["revision"]
        if revision and revision != self.commit:
            hf_manifest.write_ref(layout.repo_path, revision, self.commit)

    # ------------------------------------------------------------------ the deployment record
    def _entry(self, out: dict):
        manifest = hf_manifest.read_manifest(out["manifest"], self.repo_id, self.commit)
        if manifest is None:
            return None
        return {"repo_id": self.repo_id, "revision": self.o["revision"] or self.commit, "commit": self.commit,
                "path": out["snapshot_path"], "files": out["files"], "bytes": out["bytes_total"],
                "verified": manifest.get("verify"), "verified_at": manifest.get("verified_at"),
                "manifest": out["manifest"]}

    def _record_changes(self, out: dict) -> bool:
        if not (self.o["record"] and self.o["record_name"]) or not out["verified"]:
            return False
        entry = self._entry(out)
        try:
            return entry is not None and hf_manifest.plan_record(self.o["record"], self.o["record_name"], entry)[0]
        except hf_manifest.ManifestError as exc:
            raise PeerError(str(exc), "bad_record", out)

    def record(self, out: dict) -> bool:
        if not (self.o["record"] and self.o["record_name"]) or not out["verified"]:
            return False
        entry = self._entry(out)
        if entry is None:
            return False
        try:
            return hf_manifest.update_record(self.o["record"], self.o["record_name"], entry)
        except hf_manifest.ManifestError as exc:
            raise PeerError(str(exc), "bad_record", out)

    # ------------------------------------------------------------------ words
    def summary(self, out: dict, check_mode: bool = False, needs_work: bool = False) -> str:
        head = "%s@%s: %d files, %s" % (self.repo_id, self.commit[:12], out["files"], human_bytes(out["bytes_total"]))
        where = " in the shared store %s" % self.o["store"] if self.o["store"] else ""
        if self.state == "read" or not needs_work:
            if out["verified"]:
                return "%s; verified%s (manifest)" % (head, where)
            return "%s; not verified%s: %s; %d blob(s) missing (%s)" % (
                head, where, out["reason"], out["missing"]["blobs"], human_bytes(out["missing"]["bytes"]))
        if check_mode:
            if self.state == "copied":
                return "%s; would copy %d blob(s) (%s) from %s%s and verify every file (check mode)" % (
                    head, out["copied"]["blobs"], human_bytes(out["copied"]["bytes"]), self.source_name, where)
            return "%s; would hash every file%s (check mode)" % (head, where)
        v = out["verification"]
        if self.state == "copied":
            c = out["copied"]
            return "%s; copied %d blob(s) (%s) from %s in %.1f s%s; verified %d files (%s hashed in %.1f s)" % (
                head, c["blobs"], human_bytes(c["bytes"]), c["from"], c["seconds"], where, v["files"],
                human_bytes(v["hashed_bytes"]), v["seconds"])
        return "%s; hashed again%s: %d files verified (%s in %.1f s)" % (
            head, where, v["files"], human_bytes(v["hashed_bytes"]), v["seconds"])


def tail(text: str, limit: int = 400) -> str:
    text = " ".join((text or "").split())
    return text[-limit:] if text else "no message"


def run(params: dict, copier=None, check_mode: bool = False) -> dict:
    """peer_snapshot's run from the module's options (unknown keys ignored)."""
    opts = {k: params[k] for k in DEFAULTS if k in params and params[k] is not None}
    job = PeerJob(params["repo_id"], params["commit"], copier=copier, **opts)
    try:
        return job.run(check_mode)
    except FetchError as exc:    # confine(): a path that resolves outside the repository folder
        raise PeerError(str(exc), exc.cause)
