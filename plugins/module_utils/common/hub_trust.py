# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""What modelswap does not take on trust from a Hub, a mirror or a file on disk.

- ``path_problem`` / ``id_problem`` / ``listing_problem``: a file list (the Hub's tree listing,
  huggingface_hub's tree cache ``trees/<commit>.json``, a manifest's copy of it) names files and
  blobs that become paths on disk. Every path must be a normalized relative POSIX path (no ``..``,
  ``.`` or empty segment, not absolute, no control character) and every blob id 40 or 64
  lowercase hex digits, or nothing of the listing is used.
- ``inside``: whether a path (its folder resolved, symlinks followed) lies inside a folder; every
  unlink of hf_snapshot asks it first.
- ``token_endpoint_problem``: a Hub token goes to a plain ``http://`` endpoint only when the
  operator said that endpoint is trusted (``http_endpoint_trusted``).

Pure stdlib, no I/O except ``inside`` (realpath): unit-tested directly.
"""
from __future__ import annotations

import os
import posixpath
import re

HEX_ID_RE = re.compile(r"\A(?:[0-9a-f]{40}|[0-9a-f]{64})\Z")
SHA256_RE = re.compile(r"\A[0-9a-f]{64}\Z")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
MAX_PATH_CHARS = 4096
TRUST_OPTION = "http_endpoint_trusted"


class ListingError(ValueError):
    """A file list with an entry that must not become a path (message names the entry)."""


def path_problem(path) -> str:
    """Why ``path`` cannot be a file of a repository ('' when it can)."""
    if not isinstance(path, str):
        return "is not a string"
    if not path:
        return "is empty"
    if len(path) > MAX_PATH_CHARS:
        return "is longer than %d characters" % MAX_PATH_CHARS
    if _CONTROL_RE.search(path):
        return "holds a control character (NUL, newline, ...)"
    if path.startswith("/"):
        return "is absolute"
    segments = path.split("/")
    if ".." in segments:
        return "has a '..' segment"
    if "." in segments:
        return "has a '.' segment"
    if "" in segments:
        return "has an empty segment ('//' or a trailing '/')"
    if posixpath.normpath(path) != path:   # pragma: no cover - the rules above cover normpath
        return "is not normalized"
    return ""


def id_problem(value, lfs: bool = False) -> str:
    """Why ``value`` cannot name a blob ('' when it can): 40 or 64 lowercase hex (LFS: 64)."""
    if not isinstance(value, str):
        return "is not a string"
    if lfs:
        return "" if SHA256_RE.match(value) else "is not a sha256 (64 lowercase hex digits)"
    return "" if HEX_ID_RE.match(value) else "is not a blob id (40 or 64 lowercase hex digits)"


def entry_problem(path, entry) -> str:
    """Why one listing entry ``{path: {"size", "blob_id", "lfs_sha256"?, "xet_hash"?}}`` is unusable ('' if fine)."""
    problem = path_problem(path)
    if problem:
        return "path %r %s" % (path, problem)
    if not isinstance(entry, dict):
        return "the entry of %r is not a mapping" % path
    size = entry.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return "%r has size %r, not a byte count" % (path, size)
    problem = id_problem(entry.get("blob_id"))
    if problem:
        return "%r has blob id %r, which %s" % (path, entry.get("blob_id"), problem)
    if entry.get("lfs_sha256") is not None:
        problem = id_problem(entry["lfs_sha256"], lfs=True)
        if problem:
            return "%r has LFS sha256 %r, which %s" % (path, entry["lfs_sha256"], problem)
    if entry.get("xet_hash") is not None and not SHA256_RE.match(str(entry["xet_hash"])):
        # it names a file of the cache-wide shared store: the same shape as a sha256
        return "%r has xet hash %r, which is not 64 lowercase hex digits" % (path, entry["xet_hash"])
    return ""


def listing_problems(listing, limit: int = 3) -> list:
    """Up to ``limit`` reasons why ``listing`` ({path: entry}) must not be used; [] when it is safe."""
    if not isinstance(listing, dict):
        return ["the file list is not a mapping of paths"]
    out = []
    for path in sorted(listing, key=str):
        problem = entry_problem(path, listing[path])
        if problem:
            out.append(problem)
            if len(out) >= limit:
                break
    return out


def check_listing(listing, what: str, fix: str) -> dict:
    """``listing`` when every entry is safe; else ListingError naming the bad entries and ``fix``."""
    problems = listing_problems(listing)
    if problems:
        raise ListingError("%s has an unsafe entry: %s; nothing was written or deleted; %s"
                           % (what, "; ".join(problems), fix))
    return listing


def inside(path: str, folder: str) -> bool:
    """Whether ``path`` lies strictly inside ``folder`` once both are resolved.

    The last component of ``path`` is not followed (a symlink is judged by where it is, not by
    where it points: unlinking it removes the link), every folder above it is.
    """
    base = os.path.realpath(folder)
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    name = os.path.basename(path)
    if not name or name in (".", ".."):
        return False
    where = os.path.join(parent, name)
    return where.startswith(base.rstrip(os.sep) + os.sep)


def token_endpoint_problem(endpoint: str, token_given: bool, trusted: bool) -> str:
    """Why the token must not be sent to ``endpoint`` ('' when it may, or when there is no token)."""
    if not token_given or trusted:
        return ""
    if (endpoint or "").strip().lower().startswith("http://"):
        return ("a Hub token would be sent in clear text to the plain http:// endpoint %s, where "
                "anyone on the path can read it (and a man in the middle can serve a forged file "
                "list); use an https:// endpoint, or set %s=true when that endpoint is on a network "
                "you trust (the lab's own bridge); nothing was sent"
                % (endpoint.strip(), TRUST_OPTION))
    return ""
