"""Pure logic behind hf_snapshot: hashing, manifests, progress, locks, orphans, errors, patterns."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.hub_errors import http_error, local_entry_error_from
from tests.support.modules import COLLECTIONS
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import target_listing
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_errors
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_layout
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_locks
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.store import hf_manifest
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot_progress
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_verify
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hub_client

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------------------ hashing
@pytest.mark.parametrize("data", [b"", b"hello\n", os.urandom(hf_verify.BUFFER_SIZE), os.urandom(hf_verify.BUFFER_SIZE + 17)])
def test_hash_file_matches_hashlib_and_git(tmp_path, data):
    path = tmp_path / "f"
    path.write_bytes(data)
    assert hf_verify.hash_file(str(path), "sha256") == (hashlib.sha256(data).hexdigest(), len(data))
    git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert hf_verify.hash_file(str(path), "git-sha1") == (git, len(data))
    assert hf_verify.git_blob_id(data) == git


def test_git_blob_id_is_gits():
    # `printf 'hello\n' | git hash-object --stdin`
    assert hf_verify.git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def entry_for(data: bytes, lfs: bool) -> dict:
    e = {"size": len(data), "blob_id": hf_verify.git_blob_id(data)}
    if lfs:
        e["lfs_sha256"] = hashlib.sha256(data).hexdigest()
    return e


@pytest.mark.parametrize("lfs", [True, False])
@pytest.mark.parametrize("mode, content, ok, reason", [
    ("full", b"right", True, ""),
    ("full", b"wrong", False, "expected"),
    ("full", b"longer!", False, "size 7, expected 5"),
    ("size", b"wrong", True, ""),
    ("size", b"longer!", False, "size 7, expected 5"),
    ("full", None, False, "missing"),
])
def test_check_file(tmp_path, lfs, mode, content, ok, reason):
    path = tmp_path / "f"
    if content is not None:
        path.write_bytes(content)
    res = hf_verify.check_file(str(path), entry_for(b"right", lfs), mode)
    assert res["ok"] is ok
    assert reason in res["reason"]
    assert res["algo"] == ("sha256" if lfs else "git-sha1")
    if mode == "full" and ok:
        assert res["hashed"] == 5


def test_verify_all_runs_in_parallel_and_keeps_order(tmp_path):
    items = []
    for i in range(12):
        data = os.urandom(100_000 + i)
        p = tmp_path / f"f{i}"
        p.write_bytes(data if i != 7 else data[::-1])
        items.append((str(p), entry_for(data, lfs=i % 2 == 0)))
    results = hf_verify.verify_all(items, workers=3)
    assert [r["path"] for r in results] == [p for p, _unused in items]
    assert [r["ok"] for r in results] == [i != 7 for i in range(12)]


def test_verifier_cancel_stops_hashing(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * (3 * hf_verify.BUFFER_SIZE))
    verifier = hf_verify.Verifier(1)
    verifier.cancel.set()
    with pytest.raises(hf_verify.Cancelled):
        verifier.submit(str(p), {"size": 3 * hf_verify.BUFFER_SIZE, "blob_id": "0" * 40}).result()
    verifier.shutdown()


# ------------------------------------------------------------------------------------------ manifest
def test_manifest_covers_only_unchanged_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"aaa")
    b.write_bytes(b"bbb")
    wanted = {"a": entry_for(b"aaa", False), "b": entry_for(b"bbb", True)}
    verified = {}
    for name, path in (("a", a), ("b", b)):
        algo, digest = hf_verify.expected_digest(wanted[name])
        verified[name] = dict(hf_manifest.fingerprint(path.stat()), algo=algo, digest=digest)
    man = hf_manifest.build_manifest(repo_id="o/r", revision="main", commit="c" * 40, endpoint="e", layout="cache",
                                     snapshot=str(tmp_path), listing=wanted, verified=verified, mode="full",
                                     patterns={}, tool={})
    mpath = hf_manifest.manifest_path(str(tmp_path), "c" * 40)
    hf_manifest.atomic_write_json(mpath, man)
    back = hf_manifest.read_manifest(mpath, "o/r", "c" * 40)

    def locate(p):
        return str(tmp_path / p)

    assert hf_manifest.covers(back, wanted, locate, "full") == (True, [])
    assert hf_manifest.covers(back, wanted, locate, "size") == (True, [])
    assert hf_manifest.read_manifest(mpath, "o/other", "c" * 40) is None
    assert hf_manifest.read_manifest(mpath, "o/r", "d" * 40) is None
    # a new file selected by other patterns, a touched file, a removed file
    assert hf_manifest.covers(back, dict(wanted, c=entry_for(b"c", False)), locate, "full") == (False, ["c"])
    os.utime(a, ns=(1, 1))
    assert hf_manifest.covers(back, wanted, locate, "full") == (False, ["a"])
    b.unlink()
    assert hf_manifest.covers(back, wanted, locate, "full") == (False, ["a", "b"])
    # a size-only manifest does not vouch for full verification
    weak = dict(back, verify="size")
    assert hf_manifest.covers(weak, {"b": wanted["b"]}, locate, "full")[0] is False
    assert hf_manifest.covers(None, wanted, locate, "size") == (False, ["a", "b"])


def test_a_shared_stores_manifest_ignores_the_device_each_host_sees(tmp_path):
    """Hosts that mount one NFS export see one inode, size and mtime under other device numbers."""
    a = tmp_path / "a"
    a.write_bytes(b"aaa")
    wanted = {"a": entry_for(b"aaa", False)}
    algo, digest = hf_verify.expected_digest(wanted["a"])
    rec = dict(hf_manifest.fingerprint(a.stat()), algo=algo, digest=digest)
    rec["dev"] += 1                               # as written by the other host of the store
    man = {"verify": "full", "files": {"a": rec}}

    def locate(p):
        return str(tmp_path / p)

    assert hf_manifest.covers(man, wanted, locate, "full") == (False, ["a"])
    assert hf_manifest.covers(dict(man, store="nfs1"), wanted, locate, "full") == (True, [])
    assert hf_manifest.covers(man, wanted, locate, "full", same_device=False) == (True, [])
    os.utime(a, ns=(1, 1))                        # a changed file is still caught
    assert hf_manifest.covers(dict(man, store="nfs1"), wanted, locate, "full") == (False, ["a"])


def test_tree_cache_round_trip_is_readable_by_huggingface_hub_and_disk_plan(tmp_path):
    listing = {"config.json": {"size": 3, "blob_id": "a" * 40},
               "w.safetensors": {"size": 10, "blob_id": "b" * 40, "lfs_sha256": "c" * 64}}
    repo = tmp_path / "models--o--r"
    assert hub_client.write_tree(str(repo), "d" * 40, listing) is True
    assert hub_client.write_tree(str(repo), "d" * 40, listing) is False       # only when missing
    assert hub_client.read_tree(str(repo), "d" * 40) == listing
    from huggingface_hub._tree_cache import read_tree_cache
    entries = read_tree_cache(str(repo), "d" * 40)
    assert entries["w.safetensors"].lfs_sha256 == "c" * 64 and entries["config.json"].blob_id == "a" * 40
    planned = target_listing.list_target("o/r", "d" * 40, cache_dir=str(tmp_path))
    assert planned["source"] == "tree_cache"
    assert sorted((f["path"], f["etag"]) for f in planned["files"]) == [("config.json", "a" * 40), ("w.safetensors", "c" * 64)]


def test_write_ref_only_when_changed(tmp_path):
    assert hf_manifest.write_ref(str(tmp_path), "main", "a" * 40) is True
    assert (tmp_path / "refs" / "main").read_text() == "a" * 40
    assert hf_manifest.write_ref(str(tmp_path), "main", "a" * 40) is False
    assert hf_manifest.write_ref(str(tmp_path), "refs/pr/1", "b" * 40) is True
    assert (tmp_path / "refs" / "refs" / "pr" / "1").read_text() == "b" * 40
    assert hf_manifest.write_ref(str(tmp_path), "a" * 40, "a" * 40) is False


def test_record_update_keeps_other_keys_and_is_idempotent(tmp_path):
    record = tmp_path / "state" / "deployment.json"
    entry = {"repo_id": "o/r", "commit": "a" * 40}
    assert hf_manifest.update_record(str(record), "m", entry) is True
    record.write_text(json.dumps(dict(json.loads(record.read_text()), model="served")))
    assert hf_manifest.update_record(str(record), "m", entry) is False
    assert hf_manifest.update_record(str(record), "m", dict(entry, commit="b" * 40)) is True
    data = json.loads(record.read_text())
    assert data["model"] == "served" and data["fetched"]["m"]["commit"] == "b" * 40
    record.write_text("{not json")
    with pytest.raises(hf_manifest.ManifestError, match="not valid JSON"):
        hf_manifest.update_record(str(record), "m", entry)


# ------------------------------------------------------------------------------------------ progress
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_progress_rate_eta_and_line():
    clock = Clock()
    p = hf_snapshot_progress.Progress("", clock=clock, wall=lambda: 5.0)
    p.set(state="downloading", repo_id="o/r", commit="a" * 40, bytes_total=1000 * 1024 * 1024, files_total=4)
    p.snapshot()
    clock.t += 10
    p.add_bytes(100 * 1024 * 1024)
    snap = p.snapshot()
    assert snap["percent"] == 10.0
    assert snap["rate_bps"] == 10 * 1024 * 1024
    assert snap["eta_s"] == 90
    assert snap["line"] == "o/r@aaaaaaaaaaaa downloading 10.0% 100.0 MiB of 1000.0 MiB 10.0 MiB/s ETA 0:01:30 0/4 files"
    progress_bar = p.bar_class()(total=5, initial=0)
    progress_bar.update(1024)
    progress_bar.update(-1024)   # huggingface_hub rolls back when a server ignored a Range
    progress_bar.update_transfer(7)
    assert p.data["bytes_done"] == 100 * 1024 * 1024 and p.data["bytes_transferred"] == 7


def test_bytes_written_counts_the_files_not_the_wire_nor_a_resume():
    """bytes_downloaded comes from bytes_written: over Xet the transfer updates count compressed
    chunks, and a resumed file's ``initial`` was written by an earlier run."""
    p = hf_snapshot_progress.Progress(None, run_id="r")
    xet = p.bar_class()(total=1000, initial=0)
    xet.update_transfer(300)          # hf_xet: compressed bytes on the wire
    xet.update(1000)                  # the file's bytes, reconstructed
    resumed = p.bar_class()(total=500, initial=200)     # an .incomplete of 200 bytes resumed
    resumed.update(300)
    resumed.update_transfer(300)
    restarted = p.bar_class()(total=100, initial=40)    # a server ignored the Range: back to byte 0
    restarted.update(-40)
    restarted.update_transfer(-40)
    restarted.update(100)
    restarted.update_transfer(100)
    assert p.data["bytes_written"] == 1000 + 300 + 100
    assert p.data["bytes_done"] == 1000 + 500 + 100


def test_progress_file_and_reader(tmp_path):
    path = tmp_path / "p" / "progress.json"
    p = hf_snapshot_progress.Progress(str(path), run_id="r1", interval=0.2).start()
    p.set(state="downloading", bytes_total=10)
    p.add_bytes(4)
    time.sleep(0.5)
    info = hf_snapshot_progress.read_progress(str(path), "r1")
    assert info["found"] and info["state"] == "downloading" and info["alive"] is True
    assert info["finished"] is False and info["bytes_done"] == 4 and info["percent"] == 40.0
    assert hf_snapshot_progress.read_progress(str(path), "other")["found"] is False
    p.finish("failed", "boom")
    info = hf_snapshot_progress.read_progress(str(path), "r1")
    assert info["finished"] is True and info["state"] == "failed" and "error: boom" in info["line"]


def test_reader_sees_a_dead_writer_and_an_ended_job(tmp_path):
    path = tmp_path / "progress.json"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    dead = int(child.stdout)
    path.write_text(json.dumps({"id": "r", "pid": dead, "pid_start": "1", "state": "downloading",
                                "updated": time.time(), "line": "x"}))
    info = hf_snapshot_progress.read_progress(str(path), "r")
    assert info["alive"] is False and info["finished"] is True and "ended without a final report" in info["line"]
    # a live pid with another start time is a reused pid: not our writer
    path.write_text(json.dumps({"id": "r", "pid": os.getpid(), "pid_start": "bogus", "state": "downloading"}))
    assert hf_snapshot_progress.read_progress(str(path), "r")["alive"] is False
    results = tmp_path / "job"
    results.write_text(json.dumps({"started": True, "finished": False, "ansible_job_id": "1"}))
    assert hf_snapshot_progress.job_finished(str(results)) is False
    results.write_text(json.dumps({"changed": True, "commit": "a" * 40}))
    assert hf_snapshot_progress.job_finished(str(results)) is True
    assert hf_snapshot_progress.read_progress(str(tmp_path / "none.json"), "r", str(results))["finished"] is True
    assert hf_snapshot_progress.job_finished(str(tmp_path / "nope")) is None


def test_process_start_parses_names_with_spaces_and_parens():
    assert hf_snapshot_progress.process_start(os.getpid()) is not None
    assert hf_snapshot_progress.process_start(2 ** 22 + 12345) is None


# ------------------------------------------------------------------------------------------ patterns
def test_select_and_a_pattern_matching_nothing():
    listing = {"config.json": {}, "model.safetensors": {}, "onnx/model.onnx": {}}
    assert sorted(hf_snapshot.select(listing, ["*.json", "*.safetensors"], None, "o/r", "a" * 40)) == \
        ["config.json", "model.safetensors"]
    assert sorted(hf_snapshot.select(listing, None, ["onnx/"], "o/r", "a" * 40)) == ["config.json", "model.safetensors"]
    with pytest.raises(hf_errors.FetchError, match="match none of the 3 files") as info:
        hf_snapshot.select(listing, ["*.gguf"], None, "o/r", "a" * 40)
    assert info.value.cause == "no_match"
    with pytest.raises(hf_errors.FetchError, match="has no files"):
        hf_snapshot.select({}, None, None, "o/r", "a" * 40)


# ------------------------------------------------------------------------------------------ errors
class FakeHF:
    from huggingface_hub import errors


@pytest.mark.parametrize("make, cause, transient, words", [
    (lambda: http_error("GatedRepoError", 401), "gated", False, ["gated repository", "no token was given"]),
    (lambda: http_error("RepositoryNotFoundError", 404), "repo_not_found", False, ["was not found", "HTTP 404"]),
    (lambda: http_error("RevisionNotFoundError", 404), "revision_not_found", False, ["revision 'main'"]),
    (lambda: http_error("HfHubHTTPError", 503), "hub_unavailable", True, ["HTTP 503", "retry later"]),
    (lambda: http_error("HfHubHTTPError", 429), "hub_unavailable", True, ["HTTP 429"]),
    (lambda: http_error("HfHubHTTPError", 401), "unauthorized", False, ["HTTP 401", "token"]),
    (lambda: http_error("HfHubHTTPError", 400), "http_error", False, ["HTTP 400"]),
    (lambda: OSError(errno.ENOSPC, "No space left on device"), "disk_full", False, ["disk is full", "model_purge"]),
    (lambda: OSError(errno.EROFS, "Read-only file system"), "not_writable", False, ["cannot write under"]),
    # hf_xet raises this host's I/O errors as RuntimeErrors with Rust's io::Error text
    (lambda: RuntimeError("Task error: File reconstruction error: IO Error: No space left on device (os error 28)"),
     "disk_full", False, ["disk is full (No space left on device) under /data"]),
    (lambda: RuntimeError("File reconstruction error: IO Error: Disk quota exceeded (os error 122)"),
     "disk_full", False, ["disk is full"]),
    (lambda: RuntimeError("IO Error: Permission denied (os error 13)"), "not_writable", False, ["cannot write under"]),
    (lambda: OSError("Consistency check failed: file should be of size 3"), "short_transfer", True, ["ended short"]),
    (lambda: ConnectionRefusedError(111, "refused"), "unreachable", True, ["cannot reach"]),
    (lambda: RuntimeError("weird"), "error", False, ["RuntimeError: weird"]),
])
def test_classify(make, cause, transient, words):
    err = hf_errors.classify(make(), FakeHF, repo_id="o/r", revision="main", where="the Hub at http://hub",
                             token_given=False, what="doing it", dest="/data")
    assert err.cause == cause and err.transient is transient
    for word in words:
        assert word in str(err)


def test_classify_looks_through_wrapping_errors():
    err = hf_errors.classify(local_entry_error_from(http_error("GatedRepoError", 403)), FakeHF, repo_id="o/r",
                             revision="main", where="w", token_given=True, what="x")
    assert err.cause == "gated" and "the token given has no access" in str(err)


def test_retrying_gives_up_after_the_attempts_and_backs_off():
    job = hf_snapshot.SnapshotJob("o/r", hf=FakeHF, retries=3, retry_delay=0.01)
    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise http_error("HfHubHTTPError", 502)
        return "ok"

    assert job._retrying(flaky, "thing") == "ok" and len(calls) == 3

    def always(status, cls="HfHubHTTPError"):
        def fn():
            calls.append(time.monotonic())
            raise http_error(cls, status)
        return fn

    calls.clear()
    with pytest.raises(hf_errors.FetchError, match="gave up after 4 attempts"):
        job._retrying(always(503), "thing")
    assert len(calls) == 4 and calls[3] - calls[2] >= 0.04 > calls[1] - calls[0]   # 0.01, 0.02, 0.04
    calls.clear()
    with pytest.raises(hf_errors.FetchError) as info:   # permanent: no retry
        job._retrying(always(404, "RepositoryNotFoundError"), "thing")
    assert info.value.cause == "repo_not_found" and len(calls) == 1


# ------------------------------------------------------------------------------------------ locks, orphans
HOLD = (
    "import sys, time\n"
    "from filelock import FileLock\n"
    "lock = FileLock(sys.argv[1]); lock.acquire()\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n")


def hold(path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc):
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()


def test_orphans_go_only_when_their_download_lock_is_free(tmp_path):
    layout = hf_layout.CacheLayout(str(tmp_path), "o/r")
    blobs = Path(layout.repo_path, "blobs")
    blobs.mkdir(parents=True)
    dead = blobs / ("a" * 64 + ".1234abcd.incomplete")
    live = blobs / ("b" * 64 + ".5678abcd.incomplete")
    done = blobs / ("c" * 64)
    for p in (dead, live, done):
        p.write_bytes(b"x" * 5000)
    Path(layout.lock_dir).mkdir(parents=True)
    holder = hold(Path(layout.lock_dir, "b" * 64 + ".lock"))
    try:
        removed, busy = hf_locks.clean_orphans(layout)
    finally:
        stop(holder)
    assert [p for p, _unused in removed] == [str(dead)] and busy == [str(live)]
    assert live.exists() and done.exists() and not dead.exists()


def test_local_dir_orphans_wait_for_every_file_lock(tmp_path):
    layout = hf_layout.LocalDirLayout(str(tmp_path), "o/r")
    download = Path(layout.lock_dir, "sub")
    download.mkdir(parents=True)
    orphan = download / "abc.deadbeef.1234abcd.incomplete"
    orphan.write_bytes(b"x")
    holder = hold(download / "w.safetensors.lock")
    try:
        removed, busy = hf_locks.clean_orphans(layout)
        assert removed == [] and busy == [str(orphan)]
    finally:
        stop(holder)
    removed, busy = hf_locks.clean_orphans(layout)
    assert [p for p, _unused in removed] == [str(orphan)] and busy == []


def test_repo_lock_excludes_other_processes_and_names_its_holder(tmp_path):
    path = tmp_path / ".locks" / "models--o--r" / "modelswap.lock"
    mine = hf_locks.RepoLock(str(path))
    assert mine.acquire(1) is True
    code = ("import sys; from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_locks import RepoLock; "
            "l = RepoLock(sys.argv[1]); print(l.acquire(0.3), l.holder())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(COLLECTIONS),
                                                      os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert out.startswith("False pid %d on " % os.getpid())
    mine.release()
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert out.startswith("True")


def test_writable_problem(tmp_path):
    assert hf_layout.writable_problem(str(tmp_path / "a" / "b"), probe=True) == ""
    assert hf_layout.writable_problem(str(tmp_path / "a" / "b"), probe=False) == ""
    (tmp_path / "file").write_text("x")
    assert "not a directory" in hf_layout.writable_problem(str(tmp_path / "file" / "sub"), probe=False)
