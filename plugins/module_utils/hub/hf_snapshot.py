# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""A pinned, verified, repeatable snapshot download with huggingface_hub (the logic of hf_snapshot).

huggingface_hub does every transfer (``HfApi`` for the revision and the file list,
``hf_hub_download`` per file, so its locks, Range resumes within a process, xet and cache layout
apply). Around it, ``SnapshotJob`` adds what an operator needs after hours of transfer
(docs/huggingface.md says why each is needed):

- the revision is resolved once to a commit and every file is fetched at that commit;
- allow/ignore patterns that select nothing are an error, not a silent success;
- one repository-wide lock (``RepoLock``) for the whole download; under it, partial files that
  killed runs left behind are removed, each only when nobody holds its per-file lock; a run that
  finds the lock held follows the holder while its progress moves (a download a killed
  controller left running is followed to its end, then only verified);
- each file is verified as soon as it lands, while others still download: sha256 for LFS files,
  git blob sha1 for the rest (hf_verify); a mismatch deletes the file and fetches it once more,
  then fails naming it;
- transient failures (connection errors, 408/429/5xx, short bodies) are retried per file with
  backoff; permanent ones (not found, gated, disk full, permissions) fail at once with a message
  that names the cause and the fix;
- a manifest of what was verified (hf_manifest) makes the next run an offline no-op.

The pieces live beside it, one concern each: hf_errors (FetchError, classification, retries),
hf_layout (cache or local_dir on disk), hf_locks (the repository lock, orphans) and hf_download
(huggingface_hub imported late by ``load_hf``, the per-file transfer and verification).
"""
from __future__ import annotations

import logging
import os
import threading
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.common.catalog import DEFAULT_REVISION
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_download import LibraryLog, Transfer
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_errors import FetchError, classify, retrying
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_layout import (
    CacheLayout, LocalDirLayout, available_bytes, writable_problem)
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_locks import RepoLock, clean_orphans, describe_holder
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_snapshot_progress import HolderWatch
from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import (
    COMMIT_RE,
    StoreError,
    validate_repo_id,
)

DEFAULT_ENDPOINT = hub_client.DEFAULT_ENDPOINT


def select(listing: dict, allow_patterns, ignore_patterns, repo_id: str, commit: str) -> dict:
    """{path: entry} kept by the patterns; FetchError when nothing is kept."""
    try:
        return hub_client.select(listing, allow_patterns, ignore_patterns, repo_id, commit)
    except hub_client.HubError as exc:
        raise FetchError.from_hub(exc)


# --------------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------------
DEFAULTS = dict(
    revision=DEFAULT_REVISION, cache_dir=None, local_dir=None, allow_patterns=None, ignore_patterns=None,
    token=None, endpoint=None, workers=8, verify_workers=0, verify="full", reverify=False,
    use_xet=True, offline=False, retries=5, retry_delay=2.0, timeout=30, lock_timeout=600, follow_timeout=86400,
    progress=None, http_endpoint_trusted=False, resolved_commit=None, listing=None, store="",
)


class SnapshotJob:
    """One hf_snapshot run. ``plan()`` reads only; ``execute()`` writes (and needs ``plan()``)."""

    def __init__(self, repo_id: str, *, hf=None, **opts):
        unknown = set(opts) - set(DEFAULTS)
        if unknown:
            raise TypeError("unknown options: %s" % ", ".join(sorted(unknown)))
        self.o = dict(DEFAULTS, **opts)
        self.repo_id = repo_id
        self.revision = self.o["revision"] or DEFAULT_REVISION
        self.hf = hf
        self.progress = self.o["progress"]
        self.token = self.o["token"] or None
        self.stop = threading.Event()
        self.library_log = LibraryLog()
        self.timings = {}
        self.api = None
        self.client = None
        self.layout = None
        self.commit = None
        self.listing = None
        self.listing_source = None
        self.wanted = None
        self.manifest = None
        self.manifest_file = None
        self.resolved_by = None
        self.requests_made = False

    # ---------------------------------------------------------------- helpers
    @property
    def where(self) -> str:
        return hub_client.where_of(self.o["endpoint"])

    def _p(self, **fields):
        if self.progress is not None:
            self.progress.set(**fields)

    def _fail(self, exc, what: str) -> FetchError:
        return classify(exc, self.hf, repo_id=self.repo_id, revision=self.revision, where=self.where,
                        token_given=bool(self.token), what=what, dest=self.layout.root if self.layout else "")

    def _retrying(self, fn, what: str):
        """``fn()`` under hf_errors' retry rules with this job's retries, stop event and log (HubClient's calls too)."""
        return retrying(fn, what, retries=self.o["retries"], retry_delay=self.o["retry_delay"], stop=self.stop,
                        fail=self._fail, note=self.library_log.note)

    # ---------------------------------------------------------------- read-only steps
    def setup(self) -> None:
        """Validate the options and build the layout (no network, no writes)."""
        try:
            validate_repo_id(self.repo_id)
        except StoreError as exc:
            raise FetchError("%s; fix repo_id (the catalog's repo_id)" % exc, "bad_repo_id")
        if not self.revision.strip() or ".." in self.revision.split("/") or self.revision.startswith("/"):
            raise FetchError("revision %r is malformed; use a commit hash, a branch or a tag" % self.revision,
                             "bad_revision")
        if int(self.o["follow_timeout"]) < 0:
            raise FetchError("follow_timeout must be 0 or more seconds, not %s" % self.o["follow_timeout"], "bad_option")
        given = self.o["resolved_commit"] or None
        if given is not None and not hub_client.is_commit(given):
            raise FetchError("resolved_commit %r is not a commit: give the 40 lowercase hex digits the revision "
                             "was resolved to (disk_plan's target.commit), or leave it empty"
                             % (given,), "bad_option")
        if given is not None and hub_client.is_commit(self.revision) and given != self.revision:
            raise FetchError("resolved_commit %s contradicts revision %s, itself a commit; pass one of them"
                             % (given, self.revision), "bad_option")
        listing = self.o["listing"]
        if listing is not None:
            commit = listing.get("commit") if isinstance(listing, dict) else None
            if not (isinstance(commit, str) and hub_client.is_commit(commit)
                    and isinstance(listing.get("files"), dict)):
                raise FetchError("listing must be hf_snapshot's returned listing ({commit: <40 hex>, files: "
                                 "{path: entry}}), got %s; pass that result or leave it unset"
                                 % type(listing).__name__, "bad_option")
            if commit != (given or (self.revision if hub_client.is_commit(self.revision) else commit)):
                raise FetchError("listing is of commit %s, not of the revision %s to fetch (resolved_commit %s); "
                                 "list the same commit" % (commit, self.revision, given), "bad_option")
        try:
            hub_client.refuse_insecure(self.o["endpoint"], bool(self.token) and not self.o["offline"],
                                       bool(self.o["http_endpoint_trusted"]), "fetch %s" % self.repo_id)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        # resolved as huggingface_hub resolves them, so paths and locks agree with the library's
        if self.o["local_dir"]:
            self.layout = LocalDirLayout(os.path.realpath(os.path.expanduser(self.o["local_dir"])), self.repo_id)
        else:
            cache = self.o["cache_dir"] or self.hf.constants.HF_HUB_CACHE
            self.layout = CacheLayout(os.path.realpath(os.path.expanduser(cache)), self.repo_id)
        if self.client is None and self.hf is not None:
            self.client = hub_client.HubClient(self.repo_id, self.hf, endpoint=self.o["endpoint"], token=self.token,
                                               call=self._retrying, api=self.api)
            self.api = self.client.api
        logger = logging.getLogger("huggingface_hub")
        if self.library_log not in logger.handlers:
            logger.addHandler(self.library_log)
            logger.propagate = False

    def resolve(self) -> str:
        """The commit of the revision: the revision itself (a commit), resolved_commit (the caller
        resolved it already), the cache's ref (offline), else one request to the Hub."""
        self._p(state="resolving")
        if COMMIT_RE.match(self.revision):
            self.commit, self.resolved_by = self.revision, "pinned"
            return self.commit
        if self.o["resolved_commit"]:
            self.commit, self.resolved_by = self.o["resolved_commit"], "given"
            return self.commit
        if self.o["offline"]:
            ref = self.layout.read_ref(self.revision)
            if ref is None:
                ref = self._manifest_revision(self.revision)
            if ref is None:
                raise FetchError(
                    "offline: revision %r of %s is not a commit and no cached ref or manifest names its "
                    "commit under %s; pin the commit or run with network access"
                    % (self.revision, self.repo_id, self.layout.root), "offline")
            self.commit, self.resolved_by = ref, "cache"
            return ref
        self.requests_made = True
        try:
            self.commit = self.client.resolve(self.revision)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        self.resolved_by = "hub"
        return self.commit

    def _manifest_revision(self, revision: str):
        directory = os.path.join(self.layout.meta_root, "modelswap")
        best = None
        try:
            names = os.listdir(directory)
        except OSError:
            return None
        for name in names:
            if not (name.endswith(".json") and COMMIT_RE.match(name[:-5])):
                continue
            data = hf_manifest.read_manifest(os.path.join(directory, name), self.repo_id, name[:-5])
            if data and data.get("revision") == revision:
                if best is None or data.get("verified_at", "") > best.get("verified_at", ""):
                    best = data
        return best["commit"] if best else None

    def load_manifest(self) -> None:
        self.manifest_file = hf_manifest.manifest_path(self.layout.meta_root, self.commit)
        self.manifest = hf_manifest.read_manifest(self.manifest_file, self.repo_id, self.commit)

    def load_listing(self) -> dict:
        """The commit's files: from the manifest, the caller (the ``listing`` option: the controller
        listed them once for a fleet), huggingface_hub's tree cache, or the Hub.

        The one place where a file list enters the job: every path and blob id in it is checked
        (hub_trust) before anything uses it to build a path, and a bad one stops the run here,
        before anything is written or deleted.
        """
        if self.manifest is not None and not self._partial_listing(self.manifest):
            return self._trusted(self.manifest["listing"], "manifest",
                                 "the manifest %s" % self.manifest_file,
                                 "remove that manifest and run again (the files are verified again)")
        given = self.o["listing"]
        if given is not None and given["commit"] == self.commit:
            return self._trusted(given["files"], "given", "the given listing",
                                 "list the commit again (hf_snapshot in check mode with return_listing)")
        try:
            cached = hub_client.cached_listing(self.layout.tree_roots, self.repo_id, self.commit)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        if cached is not None:
            self.listing, self.listing_source = cached[0], "tree_cache"
            return self.listing
        if self.o["offline"]:
            raise FetchError(
                "offline: no manifest and no cached file list of %s@%s under %s; run once with network "
                "access" % (self.repo_id, self.commit, self.layout.root), "offline")
        self.requests_made = True
        self._p(state="resolving")
        try:
            self.listing = self.client.list_tree(self.commit)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        self.listing_source = "hub"
        return self.listing

    def _partial_listing(self, manifest) -> bool:
        """A manifest written after a copy from a peer (peer_snapshot) lists only the files its
        patterns selected: it is this run's listing only for the same patterns."""
        if manifest.get("listing_scope") != "selected":
            return False
        mine = {"allow": self.o["allow_patterns"] or None, "ignore": self.o["ignore_patterns"] or None}
        return manifest.get("patterns") != mine

    def _trusted(self, listing, source: str, what: str, fix: str) -> dict:
        try:
            hub_client.trusted(listing, "%s for %s@%s" % (what, self.repo_id, self.commit[:12]), fix)
        except hub_client.HubError as exc:
            raise FetchError.from_hub(exc)
        self.listing, self.listing_source = listing, source
        return listing

    def plan(self) -> dict:
        """What a run would do: {"noop", "fetch": [paths], "verify": [paths], "bytes_to_fetch", ...}."""
        started = time.monotonic()
        self.resolve()
        self.load_manifest()
        self.load_listing()
        self.wanted = select(self.listing, self.o["allow_patterns"], self.o["ignore_patterns"],
                             self.repo_id, self.commit)
        plan = self._plan_files()
        self.timings["plan_s"] = time.monotonic() - started
        return plan

    def _locate(self, path: str):
        """Where `path` of the pinned commit lies in the layout."""
        return self.layout.locate(self.commit, path)

    def _plan_files(self) -> dict:
        mode = self.o["verify"]
        ok, stale = hf_manifest.covers(self.manifest, self.wanted, self._locate, mode)
        todo = sorted(self.wanted) if self.o["reverify"] else stale
        fetch, verify = [], []
        for path in todo:
            entry = self.wanted[path]
            if self.layout.present(self.commit, path, entry):
                verify.append(path)
            else:
                fetch.append(path)
        units = {}
        for path in fetch:
            entry = self.wanted[path]
            if self.layout.needs_transfer(self.commit, path, entry):
                units[self.layout.unit(path, entry)] = int(entry["size"])
        return {
            "noop": ok and not self.o["reverify"],
            "manifest_ok": ok,
            "fetch": fetch,
            "verify": verify,
            "bytes_to_fetch": sum(units.values()),
            "stale": stale,
        }

    def stale_files(self) -> list:
        """Selected files the current manifest does not vouch for (one stat each)."""
        return self._plan_files()["stale"]

    def preview(self, plan: dict) -> dict:
        """Check mode: ``would_fetch`` and ``verification`` of ``plan``, once the checks a run would
        fail on first have passed (a writable destination, access to the files, network when needed):
        one HEAD for the smallest file to fetch, no body, nothing written."""
        layout = self.layout
        problem = writable_problem(layout.root, probe=False) if not plan["noop"] else ""
        if problem:
            raise FetchError("cannot download %s into %s: %s; choose a writable destination or run with become"
                             % (self.repo_id, layout.root, problem), "not_writable")
        if plan["fetch"] and self.o["offline"]:
            raise FetchError("offline: %d files of %s@%s are missing under %s and would have to be downloaded; "
                             "run with network access" % (len(plan["fetch"]), self.repo_id, self.commit[:12],
                                                          layout.root), "offline")
        if plan["fetch"]:
            self.probe_access(min(plan["fetch"], key=lambda f: int(self.wanted[f]["size"])))
        return {
            "would_fetch": {"files": plan["fetch"], "bytes": plan["bytes_to_fetch"], "verify": plan["verify"]},
            "verification": {"mode": self.o["verify"], "ok": plan["noop"],
                             "source": "manifest" if plan["manifest_ok"] else "pending", "files": 0,
                             "hashed_bytes": 0, "seconds": 0.0, "workers": 0, "refetched": [],
                             "verified_at": (self.manifest or {}).get("verified_at")},
        }

    def probe_access(self, path: str) -> None:
        """One HEAD for ``path`` (check mode): access, gating and availability, no body."""
        if self.hf.get_hf_file_metadata is None or self.hf.hf_hub_url is None:
            return
        url = self.hf.hf_hub_url(self.repo_id, path, revision=self.commit,
                                 endpoint=self.o["endpoint"] or None)
        self.requests_made = True
        self._retrying(lambda: self.hf.get_hf_file_metadata(url, token=self.token or False,
                                                            timeout=float(self.o["timeout"])),
                       "checking access to %s of %s@%s" % (path, self.repo_id, self.commit[:12]))

    # ---------------------------------------------------------------- the work
    def execute(self, plan: dict, settle=None) -> dict:
        """Download and verify under the repository lock; returns what happened. ``settle(out)``
        runs before the lock is released (the manifest is written there): a run waiting for the
        lock must find this one's manifest, not its files without one."""
        layout = self.layout
        problem = writable_problem(layout.root, probe=True)
        if problem:
            raise FetchError("cannot download %s into %s: %s; choose a writable %s or run the task "
                             "with become" % (self.repo_id, layout.root,
                                              problem, "local_dir" if layout.kind == "local_dir" else "cache_dir"),
                             "not_writable")
        try:
            os.makedirs(layout.root, exist_ok=True)
        except OSError as exc:
            raise FetchError("cannot create %s: %s; create it or choose another destination"
                             % (layout.root, exc.strerror or exc), "not_writable")
        started = time.monotonic()
        lock = self.lock_repository()
        self.timings["lock_s"] = time.monotonic() - started
        try:
            out = self._execute_locked(plan)
            if settle is not None:
                out["settled"] = settle(out)
            return out
        finally:
            lock.release()

    def lock_repository(self) -> RepoLock:
        """The repository lock, taken. Another run's download that holds it is followed while its
        progress moves (a download a killed controller left running goes on to its end, and this
        run then finds its manifest); one that shows no progress for ``lock_timeout`` seconds, or
        still runs after ``follow_timeout``, fails this run as ``locked``."""
        layout, progress = self.layout, self.progress
        lock = RepoLock(layout.lock_path, run=(progress.data.get("id") or "") if progress else "",
                        progress_file=progress.path if progress else "")
        watch = HolderWatch(float(self.o["lock_timeout"]), float(self.o["follow_timeout"]))

        def follow(info) -> bool:
            if progress is not None:
                # one file, two writers: each run's poller would read the other's lines
                shared = bool(progress.path and (info or {}).get("progress_file")) and \
                    os.path.realpath(info["progress_file"]) == os.path.realpath(progress.path)
                if shared:
                    progress.mute(True)
                self._p(state="waiting", error=None, lock_holder=describe_holder(info),
                        following=(info or {}).get("run"))
            return watch.keep_waiting(info)

        if lock.acquire(float(self.o["lock_timeout"]), keep_waiting=follow):
            if progress is not None:
                progress.mute(False)
                progress.set(following=None)
            return lock
        who = lock.holder()
        if watch.reason == "limit":
            why = "still makes progress after this run followed it for %ds (follow_timeout)" % int(watch.limit_s)
        elif watch.progress is not None:
            why = "has shown no progress for %ds (lock_timeout)" % int(watch.stall_s)
        else:
            why = "has held it for more than %ds (lock_timeout) and writes no progress this run can follow" \
                % int(watch.stall_s)
        raise FetchError(
            "another download of %s into %s holds %s (%s) and %s; wait for it to end, or stop it, then run again"
            % (self.repo_id, layout.root, layout.lock_path, who, why), "locked")

    def _execute_locked(self, plan: dict) -> dict:
        layout = self.layout
        out = {"orphans_removed": [], "orphans_busy": [], "files_downloaded": 0, "bytes_downloaded": 0,
               "bytes_received": 0, "kept_blobs": layout.kept,
               "refetched": [], "verified": {}, "verify_failures": [], "verified_bytes": 0,
               "hashed_bytes": 0, "verify_seconds": 0.0, "download_seconds": 0.0}
        # another run may have finished while we waited for the lock
        self.load_manifest()
        if self.manifest is not None:
            plan = self._plan_files()
            if plan["noop"]:
                out["noop"] = True
                return out
        self._p(state="cleaning")
        started = time.monotonic()
        removed, busy = clean_orphans(layout)
        out["orphans_removed"] = [{"path": p, "bytes": b} for p, b in removed]
        out["orphans_busy"] = busy
        if layout.kind == "cache":
            hub_client.write_tree(layout.repo_path, self.commit, self.listing)
            if self.resolved_by == "hub":
                hf_manifest.write_ref(layout.repo_path, self.revision, self.commit)
        needed = plan["bytes_to_fetch"]
        free = available_bytes(layout.root)
        if needed > free:
            raise FetchError(
                "not enough space for %s@%s under %s: %d bytes to download, %d available; free space "
                "(disk_plan proposes what to purge, model_purge removes it) or choose another %s; "
                "nothing was downloaded" % (self.repo_id, self.commit[:12], layout.root, needed, free,
                                            "local_dir" if layout.kind == "local_dir" else "cache_dir"),
                "disk_full")
        self.timings["prepare_s"] = time.monotonic() - started
        started = time.monotonic()
        try:
            Transfer(self).run(plan, out)
        finally:
            self.timings["transfer_s"] = time.monotonic() - started
        return out

    # ---------------------------------------------------------------- manifest
    def write_manifest(self, verified: dict) -> dict:
        """The new manifest: still-valid records of the old one plus what was verified now."""
        files = {}
        if self.manifest is not None:   # records that still hold, also of files other patterns chose
            for path, rec in self.manifest["files"].items():
                if path in self.listing and path not in verified:
                    ok, _unused = hf_manifest.covers(self.manifest, {path: self.listing[path]}, self._locate, self.o["verify"])
                    if ok:
                        files[path] = rec
        files.update(verified)
        missing = sorted(set(self.wanted) - set(files))
        if missing:
            raise FetchError("internal: %d selected files were neither verified nor vouched for (e.g. %s); "
                             "run again" % (len(missing), missing[0]), "error")
        manifest = hf_manifest.build_manifest(
            repo_id=self.repo_id, revision=self.revision, commit=self.commit,
            endpoint=hub_client.endpoint_of(self.o["endpoint"]),
            layout=self.layout.kind, snapshot=self.layout.snapshot(self.commit), listing=self.listing,
            verified=files, mode=self.o["verify"],
            patterns={"allow": self.o["allow_patterns"] or None, "ignore": self.o["ignore_patterns"] or None},
            tool={"huggingface_hub": getattr(self.hf, "version", None), "module": "modelswap.vllm.hf_snapshot"})
        if self.o["store"]:   # a store other hosts mount: they see other device numbers (hf_manifest.covers)
            manifest["store"] = self.o["store"]
        started = time.monotonic()
        hf_manifest.atomic_write_json(self.manifest_file, manifest)
        self.timings["manifest_s"] = time.monotonic() - started
        if self.layout.kind == "local_dir":
            hf_manifest.remove_other_manifests(self.layout.meta_root, self.commit)
        self.manifest = manifest
        return manifest


def job_for(params: dict, hf, progress=None) -> SnapshotJob:
    """The SnapshotJob for hf_snapshot's options (``params``: the module's, unknown keys ignored)."""
    opts = {k: params[k] for k in DEFAULTS if k in params and k != "progress"}
    return SnapshotJob(params["repo_id"], hf=hf, progress=progress, **opts)
