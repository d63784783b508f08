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
This file holds the job (``PeerJob``: the checks, the plan, the copy under the lock, the manifest,
the record, the summary); the expected files and what is here are in fleet/peer_files.py, the
rsync transfer in fleet/peer_transfer.py, the check, the publication and the undo in
fleet/peer_verify.py.
"""
from __future__ import annotations

import os
import shutil
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_errors import FetchError
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_layout import CacheLayout, available_bytes, confine
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_locks import RepoLock
from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes
from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import COMMIT_RE, StoreError, validate_repo_id
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.peer_files import PeerError, expected_listing, inspect, units
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.peer_transfer import RSYNC_SOURCE_INCOMPLETE, stale_temps
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.peer_verify import discard, make_links, publish, share, verify

STATES = ("read", "copied", "verified")
MODULE = "modelswap.vllm.peer_snapshot"
SCOPE_SELECTED = "selected"
# Where a copy lands before it is checked: under the repository's lock folder, on the cache's file
# system (a checked file is published with a hard link, never a second copy of its bytes).
STAGING_NAME = "peer-incoming"


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
