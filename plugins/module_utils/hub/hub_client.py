# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Hub access, in one place: revision -> commit, the commit's file list, its cache, its errors.

- ``HubClient``: ``resolve(revision)`` (one ``repo_info`` request, nothing for a 40-hex commit)
  and ``listing(commit, tree_roots)`` (huggingface_hub's tree cache first, else one recursive
  ``list_repo_tree`` request). Every file list, from the Hub or from a cache file, is checked by
  hub_trust before anything uses it, and comes back as ``{path: {"size", "blob_id",
  "lfs_sha256"?, "xet_hash"?}}``.
- ``HubError``: every failure of the Hub or of a listing, with a ``kind`` (``gated``,
  ``repo_not_found``, ``revision_not_found``, ``unauthorized``, ``forbidden``,
  ``hub_unavailable``, ``unreachable``, ``offline``, ``bad_listing``, ``no_match``, ...), whether
  a retry may help (``transient``), and a final message (what, where, why, what to do).
  ``classify`` turns an exception of huggingface_hub (or of the HTTP stack under it) into one.
- the tree cache ``<repo folder>/trees/<commit>.json`` (``read_tree``, ``write_tree``), in the
  format huggingface_hub's ``snapshot_download`` writes and reads.
- ``filter_paths`` / ``select``: allow/ignore globs exactly as ``snapshot_download`` applies them.

hf_snapshot (through hf_download) and disk_plan (through disk_planning) use it; huggingface_hub
is imported only by ``connect`` (or given by the caller, after its environment is set), so the
pure parts are unit-tested without it.
"""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import socket

from ansible_collections.modelswap.vllm.plugins.module_utils.common import hub_trust
from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import atomic_write_text
from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import COMMIT_RE, repo_folder_name

try:
    HAS_HF = importlib.util.find_spec("huggingface_hub") is not None
except (ImportError, ValueError):  # pragma: no cover
    HAS_HF = False

DEFAULT_ENDPOINT = "https://huggingface.co"
TREE_FORMAT_VERSION = 1          # huggingface_hub's trees/<commit>.json format
TRANSIENT_STATUS = (408, 425, 429, 500, 502, 503, 504)
TREE_FIX = "remove that file (it was tampered with or damaged) and run again"
HUB_LISTING_FIX = ("a real Hub never lists such a file: check the endpoint (a broken or malicious "
                   "mirror, or a man in the middle on a plain http:// endpoint)")


class HubError(Exception):
    """A failure of the Hub, of a file list or of its patterns; the message is final."""

    def __init__(self, msg: str, kind: str = "error", transient: bool = False):
        super().__init__(msg)
        self.kind = kind
        self.transient = transient


def endpoint_of(endpoint) -> str:
    """The endpoint huggingface_hub will use: the option, else HF_ENDPOINT, else huggingface.co."""
    return endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT


def where_of(endpoint) -> str:
    return "the Hub at %s" % endpoint_of(endpoint).rstrip("/")


def refuse_insecure(endpoint, token_given: bool, trusted: bool, action: str) -> None:
    """HubError(kind=insecure_endpoint) when the token must not go to ``endpoint``."""
    problem = hub_trust.token_endpoint_problem(endpoint_of(endpoint), token_given, trusted)
    if problem:
        raise HubError("refusing to %s: %s" % (action, problem), "insecure_endpoint")


def is_commit(value) -> bool:
    return isinstance(value, str) and bool(COMMIT_RE.match(value))


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
def chain(exc) -> list:
    """``exc`` and the exceptions it was raised from (huggingface_hub wraps the ones that matter)."""
    seen = []
    while exc is not None and exc not in seen and len(seen) < 8:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def status_of(exc):
    return getattr(getattr(exc, "response", None), "status_code", None)


def short(exc) -> str:
    return " ".join(str(exc).split())[:300]


def hub_error(e, errors, *, repo_id: str, revision: str, where: str, token_given: bool,
              what: str, fetching: bool = True):
    """The HubError for one exception ``e`` (not its chain), or None when it is not the Hub's.

    ``errors`` is ``huggingface_hub.errors`` (None: only the HTTP stack's errors are known).
    ``fetching``: the words for a download (hf_snapshot's option and role variable, completed
    files kept); without it the message leaves them out (disk_plan adds its own way out).
    """
    kept = " (completed files are kept)" if fetching else ""
    token_where = " (option token; in the role model_fetch_token)" if fetching else ""

    def isa(name):
        cls = getattr(errors, name, None) if errors is not None else None
        return cls is not None and isinstance(e, cls)

    if isa("GatedRepoError"):
        who = "the token given has no access to it" if token_given else "no token was given"
        return HubError(
            "%s: %s is a gated repository on %s and %s; accept its access conditions on the Hub "
            "with an account and pass that account's token%s" % (what, repo_id, where, who, token_where),
            "gated")
    if isa("RevisionNotFoundError"):
        return HubError(
            "%s: revision %r of %s was not found on %s; pin an existing commit, branch or tag "
            "(the catalog's revision)" % (what, revision, repo_id, where), "revision_not_found")
    if isa("RepositoryNotFoundError"):
        return HubError(
            "%s: repository %s was not found on %s (HTTP %s); fix the repo id (the catalog's "
            "repo_id) or the endpoint, or, for a private repository, pass a token with access"
            % (what, repo_id, where, status_of(e) or "404"), "repo_not_found")
    if isa("RemoteEntryNotFoundError"):
        return HubError(
            "%s: the Hub %s lists the file but answered 404 for it; retry later (the listing "
            "and the storage disagree)" % (what, where), "entry_not_found", transient=True)
    if isa("OfflineModeIsEnabled"):
        return HubError(
            "%s: the host is in offline mode (HF_HUB_OFFLINE=1 or offline=true) and the files "
            "are not all on disk; run once with network access" % what, "offline")
    if isa("HfHubHTTPError"):
        status = status_of(e)
        if status == 401:
            return HubError(
                "%s: %s refused the credentials (HTTP 401)%s; fix or renew the token"
                % (what, where, "" if token_given else ": the repository may be private"),
                "unauthorized")
        if status == 403:
            return HubError(
                "%s: %s denied access to %s (HTTP 403); use a token with access to it"
                % (what, where, repo_id), "forbidden")
        if status in TRANSIENT_STATUS:
            return HubError(
                "%s: %s answered HTTP %d; the Hub is unavailable or overloaded: retry later%s"
                % (what, where, status, kept), "hub_unavailable",
                transient=True)
        return HubError("%s: %s answered HTTP %s (%s)" % (what, where, status, short(e)), "http_error")
    if isinstance(e, OSError) and "Consistency check failed" in str(e):
        return HubError("%s: the transfer from %s ended short (%s); retrying"
                        % (what, where, short(e)), "short_transfer", transient=True)
    module = type(e).__module__ or ""
    if module.startswith(("httpx", "httpcore", "requests", "urllib3")) or isinstance(
            e, (ConnectionError, TimeoutError, socket.timeout)):
        return HubError(
            "%s: cannot reach %s (%s: %s); check the endpoint, the network and proxies%s"
            % (what, where, type(e).__name__, short(e), kept),
            "unreachable", transient=True)
    if isinstance(e, ValueError) and "too large to be downloaded" in str(e):
        return HubError("%s: the file is over 50 GB, which the Hub serves only through xet; "
                        "set use_xet=true and install hf_xet" % what, "needs_xet")
    return None


def classify(exc, errors, *, repo_id: str, revision: str, where: str, token_given: bool,
             what: str, local=None, fetching: bool = True) -> HubError:
    """The HubError for ``exc`` raised while doing ``what`` (its chain searched, nearest first).

    ``local(e)`` may name a failure of this host (a full disk) for one exception of the chain;
    what it returns is returned as is.
    """
    if isinstance(exc, HubError):
        return exc
    for e in chain(exc):
        err = hub_error(e, errors, repo_id=repo_id, revision=revision, where=where,
                        token_given=token_given, what=what, fetching=fetching)
        if err is None and local is not None:
            err = local(e)
        if err is not None:
            return err
    return HubError("%s failed: %s: %s" % (what, type(exc).__name__, short(exc)), "error")


# --------------------------------------------------------------------------------------------
# file lists: checks, the tree cache, patterns
# --------------------------------------------------------------------------------------------
def trusted(listing, what: str, fix: str) -> dict:
    """``listing`` once every path and blob id in it is safe (hub_trust); HubError otherwise."""
    try:
        return hub_trust.check_listing(listing, what, fix)
    except hub_trust.ListingError as exc:
        raise HubError(str(exc), "bad_listing")


def tree_root(cache_dir: str, repo_id: str, repo_type: str = "model") -> str:
    """The folder whose ``trees/`` holds a cache repo's tree listings (the repo folder)."""
    return os.path.join(cache_dir, repo_folder_name(repo_id, repo_type))


def tree_path(root: str, commit: str) -> str:
    return os.path.join(root, "trees", commit + ".json")


def read_tree(root: str, commit: str):
    """{path: {"size", "blob_id", "lfs_sha256"?, "xet_hash"?}} from huggingface_hub's tree cache
    under ``root`` (a repo folder, or a local_dir's ``.cache/huggingface``); None when it is
    absent, of another format or damaged. Not checked: ``cached_listing`` checks it."""
    if not is_commit(commit):
        return None
    try:
        with open(tree_path(root, commit), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format_version") != TREE_FORMAT_VERSION:
        return None
    files = data.get("files")
    if not isinstance(files, dict):
        return None
    out = {}
    try:
        for path, info in files.items():
            entry = {"size": int(info["size"]), "blob_id": str(info["blob_id"])}
            if info.get("lfs_sha256"):
                entry["lfs_sha256"] = str(info["lfs_sha256"])
            if info.get("xet_hash"):
                entry["xet_hash"] = str(info["xet_hash"])
            out[path] = entry
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return out


def write_tree(root: str, commit: str, listing: dict) -> bool:
    """Write huggingface_hub's tree cache for ``commit`` if it is missing; True when written."""
    if read_tree(root, commit) is not None:
        return False
    files = {}
    for name, entry in listing.items():
        info = {"size": int(entry["size"]), "blob_id": entry["blob_id"]}
        if entry.get("lfs_sha256"):
            info["lfs_sha256"] = entry["lfs_sha256"]
            info["lfs_size"] = int(entry["size"])
        if entry.get("xet_hash"):
            info["xet_hash"] = entry["xet_hash"]
        files[name] = info
    text = json.dumps({"format_version": TREE_FORMAT_VERSION, "files": files}, indent=1, sort_keys=True) + "\n"
    atomic_write_text(tree_path(root, commit), text, 0o644, makedirs=True)
    return True


def cached_listing(roots, repo_id: str, commit: str):
    """(listing, path) from the first tree cache under ``roots`` that has ``commit``, or None.

    A cache file with an unsafe entry is a HubError(kind=bad_listing), not a miss.
    """
    for root in roots:
        tree = read_tree(root, commit)
        if tree is not None:
            path = tree_path(root, commit)
            return trusted(tree, "huggingface_hub's tree cache %s for %s@%s" % (path, repo_id, commit[:12]),
                           TREE_FIX), path
    return None


def listing_from_hub(files, repo_file_class) -> dict:
    """{path: entry} from ``list_repo_tree``'s items (folders, of another class, are skipped)."""
    out = {}
    for f in files:
        if not isinstance(f, repo_file_class):
            continue
        entry = {"size": int(f.size), "blob_id": f.blob_id}
        lfs = getattr(f, "lfs", None)
        if lfs is not None:
            sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
            if sha:
                entry["lfs_sha256"] = sha
        if getattr(f, "xet_hash", None):
            entry["xet_hash"] = f.xet_hash
        out[f.path] = entry
    return out


def _norm_patterns(patterns):
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for p in patterns:
        p = p.replace("\\", "/")
        out.append(p + "*" if p.endswith("/") else p)
    return out


def filter_paths(paths, allow_patterns=None, ignore_patterns=None) -> list:
    """Paths kept by allow/ignore globs, exactly as snapshot_download filters them
    (huggingface_hub.utils.filter_repo_objects)."""
    allow = _norm_patterns(allow_patterns)
    ignore = _norm_patterns(ignore_patterns)
    kept = []
    for path in paths:
        p = path.replace("\\", "/")
        if allow is not None and not any(fnmatch.fnmatchcase(p, a) for a in allow):
            continue
        if ignore is not None and any(fnmatch.fnmatchcase(p, i) for i in ignore):
            continue
        kept.append(path)
    return kept


def target_files(listing: dict) -> list:
    """A listing as the expected file list that peer_snapshot and the disk plan take:
    ``[{"path", "size", "etag", "xet_hash"?}]`` sorted by path (``etag``: the LFS sha256, else
    the git blob id; ``xet_hash`` where the Hub stores the file with Xet)."""
    out = []
    for path, e in sorted(listing.items()):
        row = {"path": path, "size": int(e["size"]), "etag": e.get("lfs_sha256") or e["blob_id"]}
        if e.get("xet_hash"):
            row["xet_hash"] = e["xet_hash"]
        out.append(row)
    return out


def select(listing: dict, allow_patterns, ignore_patterns, repo_id: str, commit: str) -> dict:
    """{path: entry} kept by the patterns; HubError (empty_repo, no_match) when nothing is kept."""
    if not listing:
        raise HubError("%s@%s has no files; check the repo id and the revision" % (repo_id, commit),
                       "empty_repo")
    kept = filter_paths(sorted(listing), allow_patterns or None, ignore_patterns or None)
    if not kept:
        raise HubError(
            "the patterns (allow_patterns=%s, ignore_patterns=%s) match none of the %d files of %s@%s "
            "(e.g. %s); fix the patterns" % (
                json.dumps(allow_patterns or None), json.dumps(ignore_patterns or None), len(listing),
                repo_id, commit[:12], ", ".join(sorted(listing)[:5])), "no_match")
    return {p: listing[p] for p in kept}


# --------------------------------------------------------------------------------------------
# the client
# --------------------------------------------------------------------------------------------
class Library:
    """The parts of huggingface_hub the client uses: ``HfApi``, ``errors``, ``RepoFile``."""

    def __init__(self):
        from huggingface_hub import HfApi, errors
        from huggingface_hub.hf_api import RepoFile
        self.HfApi = HfApi
        self.errors = errors
        self.RepoFile = RepoFile


class HubClient:
    """One repository on one Hub: resolve a revision, list a commit (tree cache first).

    ``lib`` has ``HfApi``, ``errors`` and ``RepoFile`` (``Library()``, or hf_download's HF, which
    imports huggingface_hub after setting its environment). ``call(fn, what)`` runs each request:
    by default once, an exception classified into a HubError; hf_snapshot passes its retrying
    call. ``requests`` counts the requests sent (``resolve`` and ``list``).
    """

    def __init__(self, repo_id: str, lib, *, endpoint=None, token=None, repo_type: str = "model",
                 call=None, api=None, fetching: bool = True):
        self.repo_id = repo_id
        self.lib = lib
        self.endpoint = endpoint or None
        self.token = token or None
        self.repo_type = repo_type
        self.where = where_of(endpoint)
        self._call = call
        self.fetching = fetching
        self.requests = {"resolve": 0, "list": 0}
        self.api = api
        if self.api is None and lib is not None:
            self.api = lib.HfApi(endpoint=self.endpoint, token=self.token or False, library_name="modelswap")

    def classify(self, exc, what: str, revision: str = "", local=None) -> HubError:
        return classify(exc, getattr(self.lib, "errors", None), repo_id=self.repo_id, revision=revision,
                        where=self.where, token_given=bool(self.token), what=what, local=local,
                        fetching=self.fetching)

    def call(self, fn, what: str, revision: str = ""):
        if self._call is not None:
            return self._call(fn, what)
        try:
            return fn()
        except Exception as exc:  # classified: nothing is swallowed
            raise self.classify(exc, what, revision) from None

    def resolve(self, revision: str) -> str:
        """The commit ``revision`` names now (a 40-hex revision is its own commit: no request)."""
        if is_commit(revision):
            return revision
        self.requests["resolve"] += 1
        info = self.call(lambda: self.api.repo_info(self.repo_id, revision=revision, repo_type=self.repo_type),
                         "resolving %s@%s" % (self.repo_id, revision), revision)
        sha = getattr(info, "sha", None)
        if not is_commit(sha):
            raise HubError("resolving %s@%s: %s returned no commit" % (self.repo_id, revision, self.where),
                           "http_error")
        return sha

    def list_tree(self, commit: str) -> dict:
        """The commit's files as the Hub lists them (checked): one recursive request."""
        self.requests["list"] += 1
        files = self.call(
            lambda: list(self.api.list_repo_tree(self.repo_id, revision=commit, recursive=True,
                                                 repo_type=self.repo_type)),
            "listing the files of %s@%s" % (self.repo_id, commit[:12]), commit)
        try:
            listing = listing_from_hub(files, self.lib.RepoFile)
        except (TypeError, ValueError, AttributeError) as exc:
            raise HubError("the file list of %s@%s from %s is malformed (%s); nothing was written or "
                           "deleted; check the endpoint" % (self.repo_id, commit[:12], self.where, exc),
                           "bad_listing")
        return trusted(listing, "the file list %s served for %s@%s" % (self.where, self.repo_id, commit[:12]),
                       HUB_LISTING_FIX)

    def listing(self, commit: str, roots=()) -> tuple:
        """(listing, source): from the first tree cache under ``roots`` holding ``commit``
        (source ``tree_cache``, no request), else from the Hub (source ``hub``)."""
        cached = cached_listing(roots, self.repo_id, commit)
        if cached is not None:
            return cached[0], "tree_cache"
        return self.list_tree(commit), "hub"


def connect(repo_id: str, *, endpoint=None, token=None, repo_type: str = "model",
            fetching: bool = True) -> HubClient:
    """A HubClient with huggingface_hub imported now (HAS_HF says whether it can be)."""
    return HubClient(repo_id, Library(), endpoint=endpoint, token=token, repo_type=repo_type,
                     fetching=fetching)
