"""hf_snapshot's run without the module or a Hub: its options, the failure of a fetch, the result's
pieces (diff lines, verification, speeds, warnings, summary), and ``run`` over a fake SnapshotJob
for a no-op, a check-mode preview, an apply and the record."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_errors
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot_result

pytestmark = pytest.mark.unit

COMMIT = "8976b4498976b4498976b4498976b4498976b449"
SHA = "ab" * 32
WANTED = {"config.json": {"size": 39, "blob_id": "c0" * 20},
          "model.safetensors": {"size": 4096, "blob_id": "d1" * 20, "lfs_sha256": SHA}}
MANIFEST = {"repo_id": "lab/tiny-a", "commit": COMMIT, "verify": "full", "verified_at": "2026-01-02T10:00:00Z",
            "files": {"config.json": {"size": 39, "algo": "git-sha1", "digest": "c0" * 20},
                      "model.safetensors": {"size": 4096, "algo": "sha256", "digest": SHA},
                      "old.bin": {"size": 1, "algo": "sha256", "digest": "ee" * 32}}}


def options(**overrides):
    base = dict(repo_id="lab/tiny-a", revision="main", token=None, workers=8, verify="full", verify_workers=0,
                reverify=False, offline=False, retries=5, retry_delay=2.0, timeout=30, lock_timeout=600,
                progress_file=None, progress_id="", progress_interval=5.0, record=None, record_name=None)
    base.update(overrides)
    return base


@pytest.mark.parametrize("overrides, problem", [
    ({}, None),
    ({"workers": 0}, "workers must be 1 or more, not 0"),
    ({"verify_workers": -1}, "verify_workers must be 0 or more, not -1"),
    ({"retries": -2}, "retries must be 0 or more, not -2"),
    ({"timeout": 0}, "timeout must be 1 or more, not 0"),
    ({"lock_timeout": -1}, "lock_timeout must be 0 or more, not -1"),
    ({"retry_delay": -0.5}, "retry_delay must be >= 0 and progress_interval > 0"),
    ({"progress_interval": 0.0}, "retry_delay must be >= 0 and progress_interval > 0"),
])
def test_options_problem(overrides, problem):
    assert hf_snapshot_result.options_problem(options(**overrides)) == problem


def test_fetch_failure_hides_the_token_and_returns_what_a_partial_run_did():
    exc = hf_errors.FetchError("401 for https://hub/api?token=hf_secret: token hf_secret rejected", "auth")
    exc.partial = {"files_downloaded": 2, "bytes_downloaded": 10, "refetched": ["a"]}
    failure = hf_snapshot_result.fetch_failure(exc, COMMIT, ["line %d" % i for i in range(40)], "hf_secret")
    assert failure.msg == "401 for https://hub/api?token=********: token ******** rejected"
    assert failure.cause == "auth"
    assert failure.extra == {"commit": COMMIT, "library_messages": ["line %d" % i for i in range(10, 40)],
                             "files_downloaded": 2, "bytes_downloaded": 10, "bytes_received": 0, "kept_blobs": [],
                             "refetched": ["a"], "verify_failures": [], "orphans_removed": []}
    plain = hf_snapshot_result.fetch_failure(hf_errors.FetchError("no such repo", "not_found"), None, [])
    assert (plain.msg, plain.cause, plain.extra) == ("no such repo", "not_found",
                                                     {"commit": None, "library_messages": []})


def test_start_progress_that_cannot_write_its_file(tmp_path):
    (tmp_path / "a-file").write_text("")
    path = tmp_path / "a-file" / "progress.json"      # its folder is a file: even root cannot write it
    with pytest.raises(hf_snapshot_result.Failed) as err:
        hf_snapshot_result.start_progress(options(progress_file=str(path)))
    assert err.value.cause == "not_writable"
    assert err.value.msg == "cannot write the progress file %s: File exists; fix progress_file" % path


def test_start_progress_without_a_file_only_counts():
    progress = hf_snapshot_result.start_progress(options())
    assert progress.path == "" and progress.finish("done")["state"] == "done"


def job(**overrides):
    layout = SimpleNamespace(kind="cache", root="/hub/models--lab--tiny-a",
                             snapshot=lambda commit: "/hub/models--lab--tiny-a/snapshots/" + commit,
                             extra_files=lambda wanted: [])
    base = dict(repo_id="lab/tiny-a", commit=COMMIT, wanted=WANTED, layout=layout,
                o={"verify": "full", "reverify": False},
                manifest=None, manifest_file="/hub/models--lab--tiny-a/manifest.json", listing_source="hub",
                resolved_by="hub", library_log=SimpleNamespace(lines=["resolved main"]), timings={"plan_s": 0.12345},
                requests_made=3, stale_files=lambda: [])
    base.update(overrides)
    return SimpleNamespace(**base)


def test_manifest_and_planned_lines():
    assert hf_snapshot_result.manifest_lines(None) == ""
    assert hf_snapshot_result.manifest_lines(MANIFEST, WANTED) == (
        "lab/tiny-a@%s verify=full\nconfig.json 39 git-sha1:%s\nmodel.safetensors 4096 sha256:%s\n"
        % (COMMIT, "c0" * 8, "ab" * 8))
    assert "old.bin 1 sha256:" in hf_snapshot_result.manifest_lines(MANIFEST)
    assert hf_snapshot_result.planned_lines(job(), {}) == hf_snapshot_result.manifest_lines(MANIFEST, WANTED)


@pytest.mark.parametrize("reverify, before, out, stale, confirmed", [
    (True, MANIFEST, {"files_downloaded": 0, "refetched": []}, [], True),
    (False, MANIFEST, {"files_downloaded": 0, "refetched": []}, [], False),
    (True, None, {"files_downloaded": 0, "refetched": []}, [], False),
    (True, dict(MANIFEST, verify="size"), {"files_downloaded": 0, "refetched": []}, [], False),
    (True, MANIFEST, {"files_downloaded": 1, "refetched": []}, [], False),
    (True, MANIFEST, {"files_downloaded": 0, "refetched": ["a"]}, [], False),
    (True, MANIFEST, {"files_downloaded": 0, "refetched": []}, ["a"], False),
])
def test_reverify_confirmed(reverify, before, out, stale, confirmed):
    the_job = job(o={"verify": "full", "reverify": reverify}, stale_files=lambda: stale)
    assert bool(hf_snapshot_result.reverify_confirmed(the_job, out, before, "full")) is confirmed


def test_planned_result_and_manifest_verification():
    result = hf_snapshot_result.planned_result(job(), "lab/tiny-a", "main")
    assert result == {"repo_id": "lab/tiny-a", "revision": "main", "commit": COMMIT,
                      "snapshot_path": "/hub/models--lab--tiny-a/snapshots/" + COMMIT, "layout": "cache", "files": 2,
                      "bytes_total": 4135, "files_downloaded": 0, "bytes_downloaded": 0, "bytes_received": 0,
                      "kept_blobs": [], "manifest": "/hub/models--lab--tiny-a/manifest.json", "orphans_removed": [],
                      "listing_source": "hub", "resolved_by": "hub",
                      "target_files": [{"path": "config.json", "size": 39, "etag": "c0" * 20},
                                       {"path": "model.safetensors", "size": 4096, "etag": SHA}]}
    assert hf_snapshot_result.manifest_verification(MANIFEST) == {
        "mode": "full", "ok": True, "source": "manifest", "files": 0, "hashed_bytes": 0, "seconds": 0.0,
        "workers": 0, "refetched": [], "verified_at": "2026-01-02T10:00:00Z"}


def test_leftover_warnings():
    assert hf_snapshot_result.leftover_warnings("/r", "lab/tiny-a", COMMIT, [], []) == []
    assert hf_snapshot_result.leftover_warnings("/r", "lab/tiny-a", COMMIT, ["a", "b", "c", "d"], ["x.incomplete"]) == [
        "hf_snapshot: /r holds files that lab/tiny-a@8976b4498976 does not have (e.g. a, b, c); they were left "
        "alone, remove them if they are stale",
        "hf_snapshot: 1 partial files under /r belong to a download that is still running (their lock is held); "
        "left alone"]


OUT = {"files_downloaded": 2, "bytes_downloaded": 4_000_000, "bytes_received": 4_100_000, "kept_blobs": [],
       "orphans_removed": ["x.incomplete"], "orphans_busy": [], "download_seconds": 2.0, "verify_seconds": 0.5,
       "hashed_bytes": 1_000_000_000, "verified": {"config.json": {}, "model.safetensors": {}}, "refetched": []}


@pytest.mark.parametrize("out, mb_per_s, gb_per_s, source", [
    (OUT, 2.0, 2.0, "this run"),
    (dict(OUT, download_seconds=None, verify_seconds=0.0), 0.0, None, "this run"),
    (dict(OUT, hashed_bytes=0, noop=True), 2.0, None, "manifest"),
])
def test_applied_verification(out, mb_per_s, gb_per_s, source):
    got = hf_snapshot_result.applied_verification(out, MANIFEST, 4)
    assert got["mb_per_s"] == mb_per_s
    assert got["verification"]["gb_per_s"] == gb_per_s and got["verification"]["source"] == source
    assert got["verification"]["files"] == 2 and got["verification"]["workers"] == 4
    assert got["verification"]["verified_at"] == MANIFEST["verified_at"]


def summary_result(**overrides):
    base = dict(repo_id="lab/tiny-a", commit=COMMIT[:8], files=9, bytes_total=2411724, files_downloaded=9,
                bytes_downloaded=2411724, seconds=1.25, mb_per_s=1.9, snapshot_path="/snap",
                verification={"mode": "full", "source": "this run", "files": 9, "refetched": [],
                              "verified_at": "t"})
    base.update(overrides)
    return base


@pytest.mark.parametrize("result, check_mode, line", [
    (summary_result(), False,
     "lab/tiny-a@8976b449: 9 files, 2.3 MiB; downloaded 9 files (2.3 MiB) in 1.2 s (1.9 MB/s); verified full "
     "(9 files); /snap"),
    (summary_result(verification={"mode": "full", "source": "this run", "files": 9, "refetched": ["a"]}), False,
     "lab/tiny-a@8976b449: 9 files, 2.3 MiB; downloaded 9 files (2.3 MiB) in 1.2 s (1.9 MB/s); verified full "
     "(9 files, 1 fetched again); /snap"),
    (summary_result(verification={"mode": "size", "source": "manifest", "verified_at": "t"}), False,
     "lab/tiny-a@8976b449: 9 files, 2.3 MiB; verified size at t, nothing to do; /snap"),
    (summary_result(would_fetch={"files": [], "bytes": 0, "verify": []}), True,
     "lab/tiny-a@8976b449: 9 files, 2.3 MiB; verified full (manifest), nothing to do"),
    (summary_result(would_fetch={"files": ["a", "b"], "bytes": 2048, "verify": ["c"]}), True,
     "lab/tiny-a@8976b449: 9 files, 2.3 MiB; would fetch 2 files (2.0 KiB) and verify 1 present ones (check mode)"),
])
def test_summary_line(result, check_mode, line):
    assert hf_snapshot_result.summary_line(result, check_mode) == line


class FakeJob(SimpleNamespace):
    """A planned SnapshotJob's surface: setup, plan, preview, execute, write_manifest."""

    def __init__(self, plan, out=None, fail_at=None, **overrides):
        SimpleNamespace.__init__(self, **vars(job(**overrides)))
        self._plan, self._out, self._fail_at = plan, out, fail_at
        self.calls = []

    def _step(self, name):
        self.calls.append(name)
        if self._fail_at == name:
            raise hf_errors.FetchError("%s failed" % name, "network")

    def setup(self):
        self._step("setup")

    def plan(self):
        self._step("plan")
        return self._plan

    def preview(self, plan):
        self._step("preview")
        return {"would_fetch": {"files": plan["fetch"], "bytes": 4096, "verify": []},
                "verification": {"mode": "full", "ok": plan["noop"], "source": "pending",
                                 "verified_at": None}}

    def execute(self, plan, settle=None):
        self._step("execute")
        out = dict(self._out)
        if settle is not None:
            out["settled"] = settle(out)
            self.calls.append("released")
        return out

    def write_manifest(self, verified):
        self._step("write_manifest")
        self.manifest = MANIFEST
        return MANIFEST

    def _fail(self, exc, what):
        return hf_errors.FetchError("%s: %s" % (what, exc), "io")


class FakeProgress:
    def __init__(self):
        self.events = []

    def set(self, **fields):
        self.events.append(("set", fields))

    def finish(self, state, message=None):
        self.events.append(("finish", state, message))


NOOP = {"noop": True, "fetch": [], "verify": []}
FETCH = {"noop": False, "fetch": ["model.safetensors"], "verify": []}


def run(the_job, progress=None, check_mode=False, diff=True, **overrides):
    warnings = []
    changed, result = hf_snapshot_result.run(the_job, options(**overrides), progress, check_mode=check_mode,
                                             diff=diff, warn=warnings.append, started=10.0, clock=lambda: 12.5)
    return changed, result, warnings


def test_run_noop_keeps_the_manifest():
    progress = FakeProgress()
    changed, result, warnings = run(FakeJob(NOOP, manifest=MANIFEST), progress)
    assert changed is False and warnings == []
    assert result["verification"]["source"] == "manifest" and result["mb_per_s"] == 0.0
    assert result["seconds"] == 2.5 and result["timings"] == {"plan_s": 0.123} and result["requests_made"] == 3
    assert result["summary"].endswith("verified full at 2026-01-02T10:00:00Z, nothing to do; "
                                      "/hub/models--lab--tiny-a/snapshots/" + COMMIT)
    assert progress.events == [("set", {"commit": None}), ("set", {"commit": COMMIT}), ("finish", "done", None)]


def test_run_check_mode_previews_with_a_diff_and_executes_nothing():
    the_job = FakeJob(FETCH)
    changed, result, _warnings = run(the_job, check_mode=True)
    assert changed is True and the_job.calls == ["setup", "plan", "preview"]
    assert result["would_fetch"]["files"] == ["model.safetensors"]
    assert result["diff"]["before"] == "" and result["diff"]["after"].startswith("lab/tiny-a@%s verify=full\n" % COMMIT)
    _changed, no_diff, _warnings = run(FakeJob(FETCH), check_mode=True, diff=False)
    assert "diff" not in no_diff


def test_run_applies_writes_the_manifest_and_warns_about_leftovers():
    the_job = FakeJob(FETCH, dict(OUT, orphans_busy=["y.incomplete"]))
    the_job.layout.extra_files = lambda wanted: ["stale.bin"]
    changed, result, warnings = run(the_job, verify_workers=3)
    # the manifest is written before the repository lock is released
    assert changed is True and the_job.calls == ["setup", "plan", "execute", "write_manifest", "released"]
    assert result["files_downloaded"] == 2 and result["orphans_removed"] == ["x.incomplete"]
    assert result["extra_files"] == ["stale.bin"] and len(warnings) == 2
    assert result["verification"]["workers"] == 3 and result["mb_per_s"] == 2.0
    assert result["diff"]["after"] == hf_snapshot_result.manifest_lines(MANIFEST)


def test_run_offline_with_files_to_fetch_fails_before_executing():
    the_job = FakeJob(FETCH)
    progress = FakeProgress()
    with pytest.raises(hf_snapshot_result.Failed) as err:
        run(the_job, progress, offline=True)
    assert err.value.cause == "offline" and "execute" not in the_job.calls
    assert err.value.msg == ("offline: 1 files of lab/tiny-a@8976b4498976 are missing or bad under "
                             "/hub/models--lab--tiny-a (e.g. model.safetensors) and must be downloaded; run with "
                             "network access")
    assert progress.events[-1] == ("finish", "failed", err.value.msg)


@pytest.mark.parametrize("fail_at", ["setup", "plan", "execute"])
def test_run_fetch_errors_become_the_modules_failure(fail_at):
    with pytest.raises(hf_snapshot_result.Failed) as err:
        run(FakeJob(FETCH, OUT, fail_at=fail_at))
    assert err.value.msg == "%s failed" % fail_at and err.value.cause == "network"
    assert err.value.extra["library_messages"] == ["resolved main"]


def test_run_records_the_download(tmp_path):
    record = tmp_path / "deployment.json"
    changed, result, _warnings = run(FakeJob(NOOP, manifest=MANIFEST), record=str(record), record_name="tiny-a")
    assert changed is True and result["record"]["changed"] is True
    assert json.loads(record.read_text())["fetched"]["tiny-a"]["commit"] == COMMIT
    again_changed, again, _warnings = run(FakeJob(NOOP, manifest=MANIFEST), record=str(record), record_name="tiny-a")
    assert again_changed is False and again["record"]["changed"] is False
    preview_changed, preview, _warnings = run(FakeJob(FETCH), check_mode=True, record=str(record), record_name="tiny-a")
    assert preview["record"] == {"path": str(record), "name": "tiny-a", "changed": True, "entry": None}


def test_run_fails_when_the_record_cannot_be_written(tmp_path):
    record = tmp_path / "deployment.json"
    record.write_text("[]")
    progress = FakeProgress()
    with pytest.raises(hf_snapshot_result.Failed) as err:
        run(FakeJob(NOOP, manifest=MANIFEST), progress, record=str(record), record_name="tiny-a")
    assert err.value.cause == "record"
    assert err.value.msg.startswith("the download succeeded but recording it failed: the deployment record")
    assert err.value.extra == {"commit": COMMIT, "snapshot_path": "/hub/models--lab--tiny-a/snapshots/" + COMMIT}
    assert progress.events[-1][:2] == ("finish", "failed")
