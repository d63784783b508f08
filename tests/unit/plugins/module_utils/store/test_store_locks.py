"""store_locks (download locks, real filelock): plugins/module_utils/store/store_locks.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from filelock import FileLock
from huggingface_hub.utils import WeakFileLock

from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_locks

pytestmark = pytest.mark.unit


@pytest.fixture
def lockdir(tmp_path):
    d = tmp_path / ".locks" / "models--org--m"
    d.mkdir(parents=True)
    return d


@pytest.mark.parametrize("holder", ["filelock", "hf_weak"])
def test_probe_sees_a_held_download_lock(lockdir, holder):
    path = str(lockdir / ("e" * 64 + ".lock"))
    ctx = FileLock(path) if holder == "filelock" else WeakFileLock(path)
    with ctx:
        assert store_locks.probe(path) is True
        assert store_locks.busy_locks(str(lockdir)) == [path]
        with store_locks.LockSet(str(lockdir)) as locks:
            assert locks.acquire_all() == [path]
            assert locks.held == {}
    assert store_locks.probe(path) is False
    assert store_locks.busy_locks(str(lockdir)) == []


def test_probe_of_a_missing_lock_is_free_and_creates_nothing(lockdir):
    assert store_locks.probe(str(lockdir / "nope.lock")) is False
    assert list(lockdir.iterdir()) == []


def test_lockset_holds_out_a_downloader_and_removes_stale_files(lockdir):
    """While we hold the repo's locks a downloader waits; unlinking while holding is safe."""
    path = lockdir / ("f" * 64 + ".lock")
    path.touch()
    locks = store_locks.LockSet(str(lockdir))
    assert locks.acquire_all() == []
    assert locks.acquire("new.lock") is True                 # created and held
    code = ("import sys, time; from filelock import FileLock; l = FileLock(sys.argv[1]); "
            "print('trying', flush=True); t = time.time(); l.acquire(timeout=60); "
            "print(round(time.time() - t, 2), flush=True); l.release()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "trying"
        time.sleep(0.5)
        assert proc.poll() is None, "the downloader got a lock we hold"
        assert sorted(os.path.basename(p) for p in locks.remove_held()) == ["f" * 64 + ".lock", "new.lock"]
        locks.release()
        out, _unused = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0 and float(out) >= 0.5        # it waited, then got a fresh lock
