# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The transfer of a peer copy: rsync over SSH, by name, bytes only, into a staging folder.

``rsync_argv`` is the command line (COPY_FLAGS: no links, devices, FIFOs, owners or modes of the
peer's choosing; host key checking on; never over an existing file). ``rsync_copier`` runs,
through a ``HostCommands``, a dry run that lists the names first (``resolve_listing``: a regular
file is pulled, huggingface_hub's link into the peer's Xet store is pulled by its target's name,
anything else is refused), then the copy. ``source_dir`` names the peer's cache as its rrsync
forced command (``source_root``) sees it; ``stale_temps`` finds what a killed rsync left.
"""
from __future__ import annotations

import os
import posixpath
import re
import shlex
import tempfile

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.peer_files import PeerError, shared_entry

# rsync's exit codes: the peer lacks files (23: partial transfer, 24: vanished), or the
# connection / the remote side failed (the rest).
RSYNC_SOURCE_INCOMPLETE = (23, 24)


# --------------------------------------------------------------------------------------------
# the copy: the flags, the command line, the dry run's listing, the copier
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
            # user, source and port come in **settings (pylint cannot see them)
            argv = rsync_argv(rsync, ssh=ssh, source_path=source_dir(source_cache_dir, serve_root), dest=dest,  # pylint: disable=missing-kwoa
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
