"""An orphaned download no longer blocks the rerun (issue 27, item 7).

A controller killed during the download leaves hf_snapshot running on the host, holding the
repository lock. The rerun's hf_snapshot follows it while its progress moves and takes the lock
when it ends; it gives up after lock_timeout on a holder that shows none. The holders here are real
processes that take the RepoLock and write a progress file as hf_snapshot does; the poller's
reading, migrate_facts' in_flight and the plan's fetch text are checked against them.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import migrate_facts, plan_steps
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_errors
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_layout
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_locks
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot_progress as progress_mod
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_snapshot_progress import HolderWatch, Progress
from tests.support.modules import COLLECTIONS
from tests.unit.plugins.module_utils.fleet.test_migrate_facts import commands, params

pytestmark = pytest.mark.unit


# A download as hf_snapshot runs it: the repository lock (naming its run and progress file), then
# progress written every 0.1 s; bytes arrive for `seconds` (or never, with advance 0), then the
# run says done, keeps the lock a moment (the manifest is written) and ends.
HOLDER = r"""
import sys, time
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_locks import RepoLock
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_snapshot_progress import Progress
lock_path, progress_path, run, seconds, advance = sys.argv[1:6]
lock = RepoLock(lock_path, run=run, progress_file=progress_path)
assert lock.acquire(10)
p = None
if progress_path:
    p = Progress(progress_path, run_id=run, interval=0.1)
    p.set(state="downloading", repo_id="o/r", commit="a" * 40, bytes_total=10 ** 9, files_total=3)
    p.start()
print("ready", flush=True)
end = time.monotonic() + float(seconds)
while time.monotonic() < end:
    if advance == "1":
        p.add_bytes(1000)
    time.sleep(0.05)
if p is not None:
    p.finish("done")
time.sleep(0.5)
lock.release()
"""


def env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(COLLECTIONS), os.environ.get("PYTHONPATH", "")]))


@contextlib.contextmanager
def holder(lock_path, progress_path="", run="holder-run", seconds=30.0, advance=True):
    """A real process holding the repository lock; killed by its pid at the end if still running."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_path), str(progress_path), run, str(seconds),
                             "1" if advance else "0"], stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert proc.stdout.readline().strip() == "ready", "the holder did not start (rc=%s)" % proc.poll()
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def follower(tmp_path, progress_file, lock_timeout=1, follow_timeout=60, run="follower-run"):
    """The rerun's job, set up on the cache (no huggingface_hub needed to take the lock)."""
    progress = Progress(str(progress_file), run_id=run, interval=0.05)
    job = hf_snapshot.SnapshotJob("o/r", hf=None, cache_dir=str(tmp_path / "hub"), lock_timeout=lock_timeout,
                                  follow_timeout=follow_timeout, progress=progress)
    job.setup()
    return job, progress


def lock_path_of(tmp_path):
    return hf_layout.CacheLayout(str(tmp_path / "hub"), "o/r").lock_path


# ------------------------------------------------------------------------------------------ following
def test_the_rerun_follows_a_download_that_makes_progress_and_takes_the_lock_when_it_ends(tmp_path):
    shared = tmp_path / "progress" / "tiny.json"          # both runs of one model write one path
    lock_path = lock_path_of(tmp_path)
    with holder(lock_path, shared, seconds=3.0) as proc:
        job, progress = follower(tmp_path, shared, lock_timeout=1)
        progress.start()                                 # it writes until it finds the lock held
        seen, stop = [], threading.Event()

        def sample():                                    # the file and the follower's poller, while it waits
            time.sleep(0.4)
            while not stop.is_set():
                data = progress_mod.read_json_object(str(shared)) or {}
                seen.append((data.get("id"), data.get("state"), progress_mod.read_progress(str(shared), "follower-run")))
                if data.get("state") == "done":          # the holder ended its download: no longer following
                    return
                time.sleep(0.03)

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        try:
            lock = job.lock_repository()
        finally:
            stop.set()
            sampler.join()
        waited = time.monotonic() - started
        try:
            assert waited > 2.5                          # well past lock_timeout: it followed
            record = lock.info()
            assert record["run"] == "follower-run" and record["progress_file"] == str(shared)
            assert record["pid_start"] == progress_mod.process_start(os.getpid())
        finally:
            lock.release()
            progress.finish("done")
    assert seen and {i for i, _unused, _unused in seen} == {"holder-run"}, "the follower wrote the holder's progress file"
    following = [r for _unused, state, r in seen if state == "downloading"]
    assert following and all(r["following"] == "holder-run" and r["finished"] is False and r["state"] == "waiting"
                             for r in following)
    assert following[-1]["line"].startswith("following the download of run holder-run (pid %d): o/r@aaaaaaaaaaaa "
                                            "downloading" % proc.pid)
    # its own file again once it holds the lock
    assert progress_mod.read_progress(str(shared), "follower-run")["state"] == "done"


def test_the_rerun_gives_up_on_a_download_that_shows_no_progress_naming_its_run(tmp_path):
    shared = tmp_path / "progress" / "tiny.json"
    with holder(lock_path_of(tmp_path), shared, advance=False) as proc:
        job, progress = follower(tmp_path, shared, lock_timeout=1)
        started = time.monotonic()
        with pytest.raises(hf_errors.FetchError) as info:
            job.lock_repository()
        waited = time.monotonic() - started
        assert proc.poll() is None
    assert info.value.cause == "locked"
    assert 1.0 <= waited < 5.0
    msg = str(info.value)
    assert "pid %d on %s since " % (proc.pid, socket.gethostname()) in msg and ", run holder-run" in msg
    assert "has shown no progress for 1s (lock_timeout)" in msg and "wait for it to end" in msg
    assert progress.data["following"] == "holder-run" and progress.data["state"] == "waiting"


def test_a_holder_without_a_progress_file_gets_the_fixed_wait(tmp_path):
    with holder(lock_path_of(tmp_path), "", run="", advance=False) as proc:
        job, _progress = follower(tmp_path, tmp_path / "mine.json", lock_timeout=1)
        started = time.monotonic()
        with pytest.raises(hf_errors.FetchError, match="writes no progress this run can follow") as info:
            job.lock_repository()
        assert 1.0 <= time.monotonic() - started < 5.0
    assert info.value.cause == "locked" and "pid %d on " % proc.pid in str(info.value)
    assert ", run" not in str(info.value)


def test_following_ends_at_follow_timeout_whatever_the_holder_does(tmp_path):
    shared = tmp_path / "progress" / "tiny.json"
    with holder(lock_path_of(tmp_path), shared) as proc:
        job, _progress = follower(tmp_path, shared, lock_timeout=1, follow_timeout=2)
        started = time.monotonic()
        with pytest.raises(hf_errors.FetchError, match=r"after this run followed it for 2s \(follow_timeout\)"):
            job.lock_repository()
        assert 2.0 <= time.monotonic() - started < 6.0 and proc.poll() is None


def test_a_negative_follow_timeout_is_refused():
    job = hf_snapshot.SnapshotJob("o/r", hf=None, cache_dir="/tmp", follow_timeout=-1)
    with pytest.raises(hf_errors.FetchError, match="follow_timeout must be 0 or more") as info:
        job.setup()
    assert info.value.cause == "bad_option"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def snap(bytes_done, state="downloading", updated=0.0, **more):
    return dict({"state": state, "bytes_done": bytes_done, "updated": updated}, **more)


@pytest.mark.parametrize("stall, limit, reads, verdicts, reason", [
    # bytes arrive at every poll: it waits far past the stall time
    (10, 100, [(0, snap(1)), (8, snap(2)), (16, snap(3)), (24, snap(4)), (32, snap(5))],
     [True, True, True, True, True], ""),
    # the file is rewritten (updated moves) but nothing else does: stalled 10 s after the wait began
    (10, 100, [(0, snap(1, updated=1)), (5, snap(1, updated=2)), (10, snap(1, updated=3))], [True, True, False], "stalled"),
    # headway, then none: stalled 10 s after the last move
    (10, 100, [(0, snap(1)), (5, snap(2)), (12, snap(2)), (15, snap(2))], [True, True, True, False], "stalled"),
    # a new phase is headway too (verifying: no bytes, but files get verified)
    (10, 100, [(0, snap(9)), (8, snap(9, "verifying")), (16, snap(9, "verifying", verified_files=1)), (24, snap(9, "verifying"))],
     [True, True, True, True], ""),
    # no progress file at all: the fixed wait of old
    (10, 100, [(0, None), (5, None), (10, None)], [True, True, False], "stalled"),
    # a file that appears later is a baseline, not headway
    (10, 100, [(0, None), (6, snap(1)), (10, snap(1))], [True, True, False], "stalled"),
    # moving all the while, but the overall bound ends it
    (10, 20, [(0, snap(1)), (8, snap(2)), (16, snap(3)), (20, snap(4))], [True, True, True, False], "limit"),
    # a limit under the stall time is the stall time
    (10, 0, [(0, snap(1)), (9, snap(2)), (10, snap(3))], [True, True, False], "limit"),
    # lock_timeout 0: no wait at all
    (0, 100, [(0, snap(1))], [False], "stalled"),
], ids=["moving", "ticking-only", "moved-then-stuck", "phases", "no-file", "late-file", "limit", "limit-under-stall",
        "no-wait"])
def test_whether_to_keep_following_the_holder(stall, limit, reads, verdicts, reason):
    clock = Clock()
    answers = iter(reads)
    current = {}

    def read(info):
        assert info == {"pid": 7}
        return current["data"]

    watch = HolderWatch(stall, limit, clock=clock, read=read)
    got = []
    for at, data in answers:
        clock.t = 100.0 + at
        current["data"] = data
        got.append(watch.keep_waiting({"pid": 7}))
    assert got == verdicts and watch.reason == reason


RECORD = {"pid": 42, "pid_start": "777", "host": "gpu-a01", "since": "t", "run": "r1", "progress_file": "/p/x.json"}


@pytest.mark.parametrize("record, data, start, host, expected", [
    (RECORD, {"id": "r1", "pid": 42, "state": "downloading"}, "777", "gpu-a01", True),
    (RECORD, {"id": "r2", "pid": 99, "state": "downloading"}, "777", "gpu-a01", False),   # the follower's own
    (RECORD, {"id": "r2", "pid": 42, "state": "downloading"}, "777", "gpu-a01", False),   # another run's id
    (RECORD, {"id": "r1", "pid": 42, "state": "downloading"}, "555", "gpu-a01", False),   # pid reused
    (RECORD, {"id": "r1", "pid": 42, "state": "downloading"}, None, "gpu-a01", False),    # the holder is gone
    (RECORD, {"id": "r1", "pid": 42, "state": "downloading"}, "777", "gpu-b02", False),   # another host's
    (dict(RECORD, progress_file=None), {"id": "r1", "pid": 42}, "777", "gpu-a01", False),
    (dict(RECORD, run=None), {"id": "any", "pid": 42, "state": "downloading"}, "777", "gpu-a01", True),
    (None, None, "777", "gpu-a01", False),
], ids=["its-own", "not-its-file", "other-run", "pid-reused", "dead", "other-host", "no-file", "no-run", "no-record"])
def test_only_the_holders_own_progress_counts(record, data, start, host, expected):
    got = progress_mod.holder_progress(record, read=lambda path: data, start_of=lambda pid: start, host=host)
    assert (got is data) if expected else got is None


# ------------------------------------------------------------------------------------------ the lock record, the poller
def test_the_lock_names_its_holder_in_full(tmp_path):
    lock = hf_locks.RepoLock(str(tmp_path / "l" / "modelswap.lock"), run="r1", progress_file="/p/tiny.json")
    assert lock.acquire(0)
    try:
        record = lock.info()
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert record["pid_start"] == progress_mod.process_start(os.getpid())
        assert record["run"] == "r1" and record["progress_file"] == "/p/tiny.json" and record["since"].endswith("Z")
        assert lock.holder() == "pid %d on %s since %s, run r1" % (os.getpid(), socket.gethostname(), record["since"])
    finally:
        lock.release()
    assert lock.info() is None and lock.holder() == "another process"


def test_the_poller_of_a_waiting_run_reports_the_run_it_follows(tmp_path):
    path = tmp_path / "tiny.json"
    p = Progress(str(path), run_id="r-old", interval=60).start()     # a live writer: this process
    p.set(state="downloading", repo_id="o/r", commit="b" * 40, bytes_total=100)
    p.write()
    info = progress_mod.read_progress(str(path), "r-new")
    assert info["following"] == "r-old" and info["finished"] is False and info["found"] is False
    assert info["line"].startswith("following the download of run r-old (pid %d): o/r@bbbbbbbbbbbb downloading"
                                   % os.getpid())
    assert "following" not in progress_mod.read_progress(str(path), "r-old")
    p.finish("done")
    # a dead writer of another run is no download to follow
    data = progress_mod.read_json_object(str(path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    path.write_text(json.dumps(dict(data, pid=int(dead.stdout), pid_start="1", state="downloading")))
    info = progress_mod.read_progress(str(path), "r-new")
    assert "following" not in info and info["line"] == "waiting for the download to start"


def test_a_muted_progress_leaves_the_file_alone(tmp_path):
    path = tmp_path / "tiny.json"
    p = Progress(str(path), run_id="mine", interval=60).start()
    path.write_text('{"id": "theirs"}')
    p.mute(True)
    p.set(state="waiting")                                  # a new phase writes at once, unless muted
    p.write()
    assert progress_mod.read_json_object(str(path)) == {"id": "theirs"}
    p.mute(False)
    p.finish("done")
    assert progress_mod.read_json_object(str(path))["id"] == "mine"


# ------------------------------------------------------------------------------------------ the plan
def test_migrate_facts_reports_the_download_in_flight(tmp_path):
    p = params(tmp_path)
    layout = hf_layout.CacheLayout(str(tmp_path / "hub"), "lab/tiny-b")
    assert migrate_facts.gather(p, commands())["fetch"]["in_flight"] is None           # nobody holds it
    with holder(layout.lock_path, tmp_path / "progress.json", run="run-7") as proc:
        fetch = migrate_facts.gather(p, commands())["fetch"]
        record = hf_locks.read_lock_record(layout.lock_path)
        assert fetch["in_flight"] == {"pid": proc.pid, "host": socket.gethostname(), "since": record["since"],
                                      "run": "run-7"}
        assert fetch["verified"] is False
        # on a shared store another host holds it: its flock says so
        assert hf_locks.lock_in_flight(layout.lock_path, host="other-host")["run"] == "run-7"
        os.kill(proc.pid, signal.SIGKILL)                 # killed: its record stays, its flock goes
        proc.wait(timeout=10)
    assert hf_locks.read_lock_record(layout.lock_path)["run"] == "run-7"
    assert migrate_facts.gather(p, commands())["fetch"]["in_flight"] is None
    assert hf_locks.lock_in_flight(layout.lock_path, host="other-host") is None


FETCH = {"commit": "c" * 40, "verified": False, "would_fetch": {"files": ["a", "b"], "bytes": 2048, "verify": []}}
IN_FLIGHT = {"pid": 4242, "host": "gpu-a01", "since": "2026-03-01T10:00:00Z", "run": "gpu-a01-20260301T100000"}


@pytest.mark.parametrize("fetch, text", [
    (dict(FETCH, in_flight=IN_FLIGHT),
     "follow the download started by run gpu-a01-20260301T100000 (pid 4242 since 2026-03-01T10:00:00Z), then verify"),
    (dict(FETCH, in_flight=dict(IN_FLIGHT, run=None)),
     "follow the download started by pid 4242 on gpu-a01 since 2026-03-01T10:00:00Z, then verify"),
    (dict(FETCH, in_flight=None), "download 2 file(s), 2.0 KiB"),
    (dict(FETCH, verified=True, in_flight=IN_FLIGHT, would_fetch={"files": [], "bytes": 0, "verify": []}),
     "already downloaded and verified"),
], ids=["run", "no-run", "free", "verified"])
def test_the_plans_fetch_step_says_it_follows_the_download_in_flight(fetch, text):
    plan = plan_steps.plan_steps(plan_steps.plan_inputs(
        {"target": "tiny-b", "fetch": fetch, "service": {"would_swap": True, "unit": "vllm.service"}}))
    step = next(s for s in plan["steps"] if s["step"] == "fetch")
    assert step["text"] == text
    assert step.get("in_flight") == (fetch["in_flight"] if text.startswith("follow") else None)
