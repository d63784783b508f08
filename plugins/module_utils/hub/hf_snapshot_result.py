# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""hf_snapshot's run around a ``SnapshotJob``: its options, the plan, the one guarded apply, the result.

``run`` sets the job up and plans; in check mode it previews, otherwise it applies (download,
verify, write the manifest) only when the plan is not a no-op; then it records the download and
builds the result the module returns. Every failure the module reports is a ``Failed`` (message,
cause, result keys), so the module is a shell: options, the import check, ``run``, exit or fail.
The result's pieces (the verification, the speeds, the diff, the summary, the warnings) are pure
functions of plain values, table-tested.
"""
from __future__ import annotations

import time

from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_errors
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_verify
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_snapshot_progress import Progress

ACTION = "hf_snapshot"
LIBRARY_MESSAGES = 30       # huggingface_hub's last log lines returned (the cause of a failure is near the end)


class Failed(Exception):
    """hf_snapshot fails: ``msg`` (without the module's name), its ``cause`` and the result keys
    ``extra`` to return with it."""

    def __init__(self, msg: str, cause: str = "error", **extra):
        Exception.__init__(self, msg)
        self.msg = msg
        self.cause = cause
        self.extra = extra


# --------------------------------------------------------------------------------------------
# options and the failure of a fetch
# --------------------------------------------------------------------------------------------
MINIMUMS = (("workers", 1), ("verify_workers", 0), ("retries", 0), ("timeout", 1), ("lock_timeout", 0))


def options_problem(params: dict):
    """What is wrong with the numeric options (the message the module fails with), or None."""
    for key, low in MINIMUMS:
        if params[key] < low:
            return "%s must be %d or more, not %d" % (key, low, params[key])
    if params["retry_delay"] < 0 or params["progress_interval"] <= 0:
        return "retry_delay must be >= 0 and progress_interval > 0"
    return None


def fetch_failure(exc, commit, library_messages, token=None) -> Failed:
    """The module's failure for a FetchError: the commit, the library's last messages, what a
    partial run did, and the message without the token."""
    partial = getattr(exc, "partial", None) or {}
    extra = {"commit": commit, "library_messages": library_messages[-LIBRARY_MESSAGES:]}
    if partial:
        extra.update(files_downloaded=partial.get("files_downloaded", 0),
                     bytes_downloaded=partial.get("bytes_downloaded", 0),
                     bytes_received=partial.get("bytes_received", 0),
                     kept_blobs=partial.get("kept_blobs", []),
                     refetched=partial.get("refetched", []),
                     verify_failures=partial.get("verify_failures", []),
                     orphans_removed=partial.get("orphans_removed", []))
    msg = str(exc)
    if token:
        msg = msg.replace(token, "********")
    return Failed(msg, exc.cause, **extra)


def start_progress(params: dict) -> Progress:
    """The run's counters, and the progress file when one is asked for (written from now on)."""
    progress = Progress(params["progress_file"] or "", run_id=params["progress_id"],
                        interval=params["progress_interval"])
    progress.set(repo_id=params["repo_id"], revision=params["revision"])
    try:
        progress.start()
    except OSError as exc:
        raise Failed("cannot write the progress file %s: %s; fix progress_file"
                     % (params["progress_file"], exc.strerror), "not_writable")
    return progress


# --------------------------------------------------------------------------------------------
# the result's pieces
# --------------------------------------------------------------------------------------------
def manifest_lines(manifest, wanted=None) -> str:
    """A manifest as diff lines: the header, then ``name size algo:digest`` per (wanted) file."""
    if not manifest:
        return ""
    files = manifest["files"]
    names = sorted(wanted) if wanted is not None else sorted(files)
    lines = ["%s@%s verify=%s" % (manifest["repo_id"], manifest["commit"], manifest["verify"])]
    for name in names:
        rec = files.get(name)
        if rec:
            lines.append("%s %d %s:%s" % (name, int(rec["size"]), rec.get("algo"), (rec.get("digest") or "")[:16]))
    return "\n".join(lines) + "\n"


def planned_lines(job, plan) -> str:
    """The manifest the plan would write, as diff lines (the Hub's digests of the wanted files)."""
    lines = ["%s@%s verify=%s" % (job.repo_id, job.commit, job.o["verify"])]
    for name in sorted(job.wanted):
        algo, digest = hf_verify.expected_digest(job.wanted[name])
        lines.append("%s %d %s:%s" % (name, int(job.wanted[name]["size"]), algo, digest[:16]))
    return "\n".join(lines) + "\n"


def manifest_diff(manifest_file: str, before: str, after: str) -> dict:
    return {"before_header": manifest_file, "after_header": manifest_file, "before": before, "after": after}


def reverify_confirmed(job, out: dict, before, mode: str) -> bool:
    """A re-verification that found every file as the manifest says: keep the manifest as it is."""
    return (job.o["reverify"] and before is not None and before.get("verify") == mode
            and not out["files_downloaded"] and not out["refetched"] and not job.stale_files())


def planned_result(job, repo_id: str, revision: str) -> dict:
    """The result once the job is planned: where the snapshot is and what it holds, nothing done yet."""
    layout, wanted = job.layout, job.wanted
    return dict(repo_id=repo_id, revision=revision, commit=job.commit, snapshot_path=layout.snapshot(job.commit),
                layout=layout.kind, files=len(wanted), bytes_total=sum(int(e["size"]) for e in wanted.values()),
                files_downloaded=0, bytes_downloaded=0, bytes_received=0, kept_blobs=[],
                manifest=job.manifest_file, orphans_removed=[],
                listing_source=job.listing_source, resolved_by=job.resolved_by,
                target_files=hub_client.target_files(wanted))


def manifest_verification(manifest: dict) -> dict:
    """The verification of a no-op run: the manifest's, nothing hashed."""
    return {"mode": manifest["verify"], "ok": True, "source": "manifest", "files": 0, "hashed_bytes": 0,
            "seconds": 0.0, "workers": 0, "refetched": [], "verified_at": manifest["verified_at"]}


def offline_message(repo_id: str, commit: str, root: str, fetch: list) -> str:
    return ("offline: %d files of %s@%s are missing or bad under %s (e.g. %s) and must be downloaded; run "
            "with network access" % (len(fetch), repo_id, commit[:12], root, fetch[0]))


def transfer_fields(out: dict) -> dict:
    """What an apply transferred and removed, from ``SnapshotJob.execute``'s answer."""
    return dict(files_downloaded=out["files_downloaded"], bytes_downloaded=out["bytes_downloaded"],
                bytes_received=out.get("bytes_received", 0), kept_blobs=out.get("kept_blobs", []),
                orphans_removed=out["orphans_removed"])


def leftover_warnings(root: str, repo_id: str, commit: str, extra_files: list, orphans_busy: list) -> list:
    """Warnings about files an apply left alone: another revision's, another download's partials."""
    warnings = []
    if extra_files:
        warnings.append("%s: %s holds files that %s@%s does not have (e.g. %s); they were left alone, remove "
                        "them if they are stale" % (ACTION, root, repo_id, commit[:12], ", ".join(extra_files[:3])))
    if orphans_busy:
        warnings.append("%s: %d partial files under %s belong to a download that is still running (their lock "
                        "is held); left alone" % (ACTION, len(orphans_busy), root))
    return warnings


def applied_verification(out: dict, manifest: dict, workers: int) -> dict:
    """``mb_per_s`` and ``verification`` of an apply (speeds of the download and of the hashing)."""
    download_s = out["download_seconds"] or 0.0
    verify_s = out["verify_seconds"]
    hashed = out["hashed_bytes"]
    return {
        "mb_per_s": round(out["bytes_downloaded"] / download_s / 1e6, 1) if download_s > 0 else 0.0,
        "verification": {
            "mode": manifest["verify"], "ok": True, "source": "manifest" if out.get("noop") else "this run",
            "files": len(out["verified"]),
            "hashed_bytes": hashed, "seconds": round(verify_s, 3),
            "gb_per_s": round(hashed / verify_s / 1e9, 3) if verify_s > 0 and hashed else None,
            "workers": workers, "refetched": out["refetched"],
            "verified_at": manifest["verified_at"]},
    }


def summary_line(r: dict, check_mode: bool) -> str:
    """One line for humans (the model_fetch role prints it per host)."""
    head = "%s@%s: %d files, %s" % (r["repo_id"], r["commit"], r["files"], human_bytes(r["bytes_total"]))
    v = r.get("verification") or {}
    if check_mode:
        wf = r["would_fetch"]
        if not wf["files"] and not wf["verify"]:
            return "%s; verified %s (manifest), nothing to do" % (head, v.get("mode"))
        return "%s; would fetch %d files (%s) and verify %d present ones (check mode)" % (
            head, len(wf["files"]), human_bytes(wf["bytes"]), len(wf["verify"]))
    if v.get("source") == "manifest":
        return "%s; verified %s at %s, nothing to do; %s" % (head, v.get("mode"), v.get("verified_at"),
                                                             r["snapshot_path"])
    return "%s; downloaded %d files (%s) in %.1f s (%s MB/s); verified %s (%d files%s); %s" % (
        head, r["files_downloaded"], human_bytes(r["bytes_downloaded"]), r["seconds"], r["mb_per_s"],
        v.get("mode"), v.get("files", 0),
        ", %d fetched again" % len(v["refetched"]) if v.get("refetched") else "", r["snapshot_path"])


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------
def run(job, params: dict, progress, *, check_mode: bool, diff: bool, warn, started: float,
        clock=time.monotonic):
    """Plan, then preview (check mode) or apply unless the plan is a no-op, record, and build the
    result: (changed, result). ``Failed`` for every failure the module reports."""
    try:
        changed, result = _plan_and_apply(job, params, progress, check_mode, diff, warn)
    except hf_errors.FetchError as exc:
        failure = fetch_failure(exc, job.commit, job.library_log.lines, params["token"])
        if progress is not None:
            progress.finish("failed", failure.msg)
        raise failure
    if params["record"]:
        record_changed = _record(job, params, result, progress, check_mode)
        changed = changed or record_changed
    result.setdefault("mb_per_s", 0.0)
    result["seconds"] = round(clock() - started, 3)
    result["summary"] = summary_line(result, check_mode)
    result["library_messages"] = job.library_log.lines[-LIBRARY_MESSAGES:]
    result["timings"] = {k: round(v, 3) for k, v in job.timings.items()}
    result["requests_made"] = job.requests_made
    if progress is not None:
        progress.finish("done")
    return changed, result


def _plan_and_apply(job, params, progress, check_mode, diff, warn):
    job.setup()
    if progress is not None:
        progress.set(commit=None)
    plan = job.plan()
    if progress is not None:
        progress.set(commit=job.commit)
    result = planned_result(job, params["repo_id"], params["revision"])
    if params.get("return_listing"):
        result["listing"] = {"commit": job.commit, "files": job.wanted}
    before_manifest = job.manifest
    changed = not plan["noop"]
    if check_mode:
        result.update(job.preview(plan))
        if changed and diff:
            result["diff"] = manifest_diff(job.manifest_file, manifest_lines(before_manifest, job.wanted),
                                           planned_lines(job, plan))
    elif plan["noop"]:
        result["verification"] = manifest_verification(before_manifest)
    else:
        changed = _apply(job, params, plan, result, before_manifest, diff, warn)
    return changed, result


def _apply(job, params, plan, result, before_manifest, diff, warn) -> bool:
    """The one guarded apply: download and verify what the plan says, write the manifest."""
    layout = job.layout
    if params["offline"] and plan["fetch"]:
        raise hf_errors.FetchError(offline_message(params["repo_id"], job.commit, layout.root, plan["fetch"]),
                                   "offline")

    def settle(out):
        """(manifest, changed), under the repository lock."""
        if out.get("noop"):    # another run completed it while this one waited for the lock
            return job.manifest, False
        if reverify_confirmed(job, out, before_manifest, params["verify"]):
            return before_manifest, bool(out["orphans_removed"])
        return job.write_manifest(out["verified"]), True

    try:
        out = job.execute(plan, settle)
        manifest, changed = out.pop("settled")
    except OSError as exc:
        raise job._fail(exc, "writing the snapshot of %s" % params["repo_id"])
    result.update(transfer_fields(out))
    extra = layout.extra_files(job.wanted)
    if extra:
        result["extra_files"] = extra
    for message in leftover_warnings(layout.root, params["repo_id"], job.commit, extra, out["orphans_busy"]):
        warn(message)
    result.update(applied_verification(out, manifest, params["verify_workers"] or hf_verify.default_workers()))
    if changed and diff:
        result["diff"] = manifest_diff(job.manifest_file, manifest_lines(before_manifest, job.wanted),
                                       manifest_lines(manifest))
    return changed


def _record(job, params, result, progress, check_mode) -> bool:
    """Write (or, in check mode, plan) the download's entry in the record; whether it changes."""
    try:
        if result.get("verification", {}).get("verified_at") is None:
            changed, after = True, None
        else:
            entry = hf_manifest.fetched_entry(result)
            if check_mode:
                changed, _before, after = hf_manifest.plan_record(params["record"], params["record_name"], entry)
            else:
                changed = hf_manifest.update_record(params["record"], params["record_name"], entry)
                after = entry
    except (hf_manifest.ManifestError, OSError) as exc:
        if progress is not None:
            progress.finish("failed", str(exc))
        raise Failed("the download succeeded but recording it failed: %s" % exc, "record", commit=job.commit,
                     snapshot_path=result["snapshot_path"])
    result["record"] = {"path": params["record"], "name": params["record_name"], "changed": changed, "entry": after}
    return changed
