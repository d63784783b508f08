# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The per-file download machinery of a snapshot: huggingface_hub imported late (``load_hf``,
after the environment it reads at import time is set; ``HAS_HF`` says whether it is installed),
its warnings kept for the result (``LibraryLog``), and ``Transfer``: ``hf_hub_download`` per unit
(the paths that share a blob) on a thread pool, each unit verified as soon as it lands while others
still download, a mismatch deleted and fetched once more.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_verify
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_errors import Cancelled, FetchError
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest

try:
    HAS_HF = importlib.util.find_spec("huggingface_hub") is not None
except (ImportError, ValueError):  # pragma: no cover
    HAS_HF = False

CHUNK_SIZE = 1024 * 1024


class HF:
    """The parts of huggingface_hub the job uses (one import, after the environment is set)."""

    def __init__(self):
        import huggingface_hub
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub import constants
        from huggingface_hub import errors
        from huggingface_hub.hf_api import RepoFile

        self.version = huggingface_hub.__version__
        self.HfApi = HfApi
        self.hf_hub_download = hf_hub_download
        self.constants = constants
        self.errors = errors
        self.RepoFile = RepoFile
        try:
            from huggingface_hub.file_download import get_hf_file_metadata
        except ImportError:  # pragma: no cover
            get_hf_file_metadata = None
        self.get_hf_file_metadata = get_hf_file_metadata
        try:
            from huggingface_hub import hf_hub_url
        except ImportError:  # pragma: no cover
            hf_hub_url = None
        self.hf_hub_url = hf_hub_url


def hf_environment(*, use_xet: bool, offline: bool, timeout: float) -> dict:
    """The variables huggingface_hub reads at import time, for this job."""
    env = {
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_ETAG_TIMEOUT": str(int(timeout)),
        "HF_HUB_DOWNLOAD_TIMEOUT": str(int(timeout)),
        "HF_HUB_OFFLINE": "1" if offline else "0",
    }
    if not use_xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    return env


def load_hf(*, use_xet: bool, offline: bool, timeout: float) -> HF:
    os.environ.update(hf_environment(use_xet=use_xet, offline=offline, timeout=timeout))
    hf = HF()
    # huggingface_hub reads HTTP bodies in DOWNLOAD_CHUNK_SIZE pieces (10 MiB): progress moves and a
    # dropped connection resumes only at that granularity. 1 MiB gives ten times finer progress and
    # resumes, and costs no throughput (it copies less; tests/bench/bench_hf_snapshot.py).
    if getattr(hf.constants, "DOWNLOAD_CHUNK_SIZE", 0) > CHUNK_SIZE:
        hf.constants.DOWNLOAD_CHUNK_SIZE = CHUNK_SIZE
    return hf


class LibraryLog(logging.Handler):
    """Keeps huggingface_hub's warnings (retries, resumes) for the result instead of stderr."""

    def __init__(self, limit: int = 30):
        super().__init__(logging.WARNING)
        self.limit = limit
        self.lines = []
        self.dropped = 0

    def emit(self, record):
        try:
            line = record.getMessage()
        except Exception:  # pragma: no cover
            return
        self.note(line)

    def note(self, line: str) -> None:
        line = " ".join(str(line).split())[:300]
        if len(self.lines) < self.limit:
            self.lines.append(line)
        else:
            self.dropped += 1


# --------------------------------------------------------------------------------------------
# the transfer
# --------------------------------------------------------------------------------------------
class Transfer:
    """The download and verification of one plan's files, for a planned ``SnapshotJob`` whose
    repository lock is held: it reads the job's layout, commit, selected files, options and
    progress, stops on the job's ``stop`` event, and retries and classifies failures with the
    job's own rules (``_retrying``, ``_fail``), so every failure reads the same as the plan's."""

    def __init__(self, job):
        self.job = job

    def fetch_unit(self, paths: list, again: bool = False) -> int:
        """hf_hub_download of each path (one unit: the paths that share a blob); returns count.

        ``again``: the unit failed verification and its repo blob (a link into the shared Xet store)
        was removed; its first file is downloaded with ``force_download``, so a bad payload of the
        store, which huggingface_hub would otherwise link again, is replaced for every link to it.
        Never for a repo blob still there (one another revision links): that would overwrite it."""
        job = self.job
        args = job.layout.download_args()
        job.requests_made = True
        bar_class = job.progress.bar_class() if job.progress is not None else None
        for index, path in enumerate(paths):
            what = "downloading %s of %s@%s" % (path, job.repo_id, job.commit[:12])
            force = {"force_download": True} if again and index == 0 else {}
            job._retrying(lambda: job.hf.hf_hub_download(
                job.repo_id, path, revision=job.commit, endpoint=job.o["endpoint"] or None,
                token=job.token or False, etag_timeout=float(job.o["timeout"]), tqdm_class=bar_class,
                library_name="modelswap", **args, **force), what)
            if job.progress is not None:
                job.progress.add(files_done=1)
        return len(paths)

    def verify_unit(self, paths: list, verifier) -> dict:
        job = self.job
        path0 = paths[0]
        entry = job.wanted[path0]
        for path in paths:
            problem = job.layout.name_problem(job.commit, path, entry)
            if problem:
                return {"ok": False, "reason": problem, "hashed": 0, "size": entry["size"],
                        "algo": hf_verify.expected_digest(entry)[0], "digest": None, "seconds": 0.0}
        # in a cache, a blob that links into the shared (Xet) store is read only when it leads to
        # a regular file of that store (hf_verify.cache_target)
        return hf_verify.check_file(job.layout.locate(job.commit, path0), entry, verifier.mode,
                                    cancel=verifier.cancel,
                                    cache_dir=job.layout.root if job.layout.kind == "cache" else "")

    def run(self, plan: dict, out: dict) -> None:
        """Fetch ``plan["fetch"]`` and verify each unit as it lands (and ``plan["verify"]`` at once),
        filling ``out``; the first failure stops the rest and is raised with ``partial = out``."""
        job = self.job
        layout = job.layout
        units = {}
        for path in plan["fetch"] + plan["verify"]:
            units.setdefault(layout.unit(path, job.wanted[path]), []).append(path)
        fetch_units = {}
        for path in plan["fetch"]:
            fetch_units.setdefault(layout.unit(path, job.wanted[path]), []).append(path)
        verify_units = [u for u in units if u not in fetch_units]
        job._p(state="downloading" if fetch_units else "verifying", files_total=len(plan["fetch"]),
               bytes_total=plan["bytes_to_fetch"], files_done=0, bytes_done=0)
        workers = max(1, int(job.o["workers"]))
        verifier = hf_verify.Verifier(int(job.o["verify_workers"]) or 0, job.o["verify"])
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf-download")
        pending = {}
        refetched = set()
        shared_units = set()     # units whose bad repo blob was a link (the Xet store's)
        failures = []
        first_fetch = last_fetch = first_verify = last_verify = None
        started = time.monotonic()

        def submit_fetch(unit):
            nonlocal first_fetch
            first_fetch = first_fetch or time.monotonic()
            again = (unit in refetched and unit in shared_units
                     and not os.path.lexists(layout.blob(job.wanted[units[unit][0]])))
            pending[pool.submit(self.fetch_unit, units[unit], again)] = ("fetch", unit)

        def submit_verify(unit):
            nonlocal first_verify
            first_verify = first_verify or time.monotonic()
            pending[verifier.run(self.verify_unit, units[unit], verifier)] = ("verify", unit)

        for unit in fetch_units:
            submit_fetch(unit)
        for unit in verify_units:
            submit_verify(unit)
        try:
            while pending:
                done, _unused = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in done:
                    kind, unit = pending.pop(fut)
                    paths = units[unit]
                    if fut.cancelled():
                        continue
                    try:
                        res = fut.result()
                    except (Cancelled, hf_verify.Cancelled):
                        continue
                    except FetchError as exc:
                        failures.append(exc)
                        self.stop_all(pending, verifier)
                        continue
                    except Exception as exc:  # a bug or an unexpected library error: report it
                        failures.append(job._fail(exc, "%s of %s" % (kind, paths[0])))
                        self.stop_all(pending, verifier)
                        continue
                    if kind == "fetch":
                        last_fetch = time.monotonic()
                        out["files_downloaded"] += res
                        if not job.stop.is_set():
                            submit_verify(unit)
                        continue
                    last_verify = time.monotonic()
                    out["hashed_bytes"] += res.get("hashed", 0)
                    if res["ok"]:
                        entry = job.wanted[paths[0]]
                        st = os.stat(layout.locate(job.commit, paths[0]))
                        for path in paths:
                            out["verified"][path] = dict(hf_manifest.fingerprint(st), algo=res["algo"],
                                                         digest=res["digest"] or hf_verify.expected_digest(entry)[1])
                        out["verified_bytes"] += int(entry["size"]) * len(paths)
                        if job.progress is not None:
                            job.progress.add(verified_files=len(paths), verified_bytes=int(entry["size"]))
                        continue
                    # a mismatch: delete the bad file(s); fetch once more, or give up
                    if layout.kind == "cache" and os.path.islink(layout.blob(job.wanted[paths[0]])):
                        shared_units.add(unit)
                    for path in paths:
                        layout.remove(job.commit, path, job.wanted[path])
                    if unit in refetched or job.stop.is_set():
                        out["verify_failures"].append({"path": paths[0], "reason": res["reason"]})
                        failures.append(FetchError(
                            "verifying %s of %s@%s failed after a fresh download: %s; the file was "
                            "deleted and nothing was recorded as verified; %s serves content that does not "
                            "match its own metadata: report it to the repository's owner or the mirror's "
                            "operator, then run again"
                            % (paths[0], job.repo_id, job.commit[:12], res["reason"], job.where),
                            "corrupt"))
                        self.stop_all(pending, verifier)
                        continue
                    if job.o["offline"]:
                        out["verify_failures"].append({"path": paths[0], "reason": res["reason"]})
                        failures.append(FetchError(
                            "verifying %s of %s@%s failed: %s; the file was deleted and must be downloaded "
                            "again, which offline mode forbids: run with network access"
                            % (paths[0], job.repo_id, job.commit[:12], res["reason"]), "offline"))
                        self.stop_all(pending, verifier)
                        continue
                    refetched.add(unit)
                    out["refetched"].append({"path": paths[0], "reason": res["reason"]})
                    job.library_log.note("re-fetching %s: %s" % (paths[0], res["reason"]))
                    if job.progress is not None:
                        job.progress.add(bytes_total=int(job.wanted[paths[0]]["size"]),
                                         files_total=len(paths))
                    submit_fetch(unit)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            verifier.shutdown(cancel=bool(failures))
        if job.progress is not None:
            out["bytes_downloaded"] = job.progress.data.get("bytes_written", 0)
            out["bytes_received"] = job.progress.data.get("bytes_received", 0)
        out["download_seconds"] = (last_fetch - first_fetch) if first_fetch and last_fetch else 0.0
        out["verify_seconds"] = (last_verify - first_verify) if first_verify and last_verify else 0.0
        out["pipeline_seconds"] = time.monotonic() - started
        if failures:
            first = failures[0]
            others = len(failures) - 1
            if others:
                first = FetchError("%s (and %d more failure%s)" % (first, others, "s" if others > 1 else ""),
                                   first.cause)
            first.partial = out
            raise first

    def stop_all(self, pending: dict, verifier) -> None:
        job = self.job
        job.stop.set()
        for fut in list(pending):
            if fut.cancel():
                pending.pop(fut, None)
