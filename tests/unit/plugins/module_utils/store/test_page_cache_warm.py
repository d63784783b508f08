"""page_cache_warm's logic (plugins/module_utils/store/page_cache_warm.py): /proc/meminfo, the snapshot's files
(links to blobs followed, each once), read-or-skip from MemAvailable, the bounded read with a fake
clock, check mode that reads nothing, and the module itself on a real folder."""
from __future__ import annotations

import os

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.store import page_cache_warm as pcw
from tests.support.modules import run_module

pytestmark = pytest.mark.unit

GIB = 1 << 30
MEMINFO = """MemTotal:       24589156 kB
MemFree:        16031872 kB
MemAvailable:   19293544 kB
Buffers:          201616 kB
HugePages_Total:       0
"""


def test_parse_meminfo_and_mem_available():
    info = pcw.parse_meminfo(MEMINFO)
    assert info["MemAvailable"] == 19293544 * 1024 and info["HugePages_Total"] == 0
    assert pcw.mem_available(lambda: MEMINFO) == 19293544 * 1024
    with pytest.raises(pcw.WarmError, match="has no MemAvailable"):
        pcw.mem_available(lambda: "MemTotal: 1 kB\n")

    def unreadable():
        raise PermissionError(13, "Permission denied")
    with pytest.raises(pcw.WarmError, match="cannot read /proc/meminfo: Permission denied"):
        pcw.mem_available(unreadable)


PLANS = {
    "fits": (6 * GIB, 10 * GIB, 0.8, 0, True, 8 * GIB, None),
    "exactly the budget": (8 * GIB, 10 * GIB, 0.8, 0, True, 8 * GIB, None),
    "larger than the budget": (9 * GIB, 10 * GIB, 0.8, 0, False, 8 * GIB,
                               "the snapshot (9.0 GiB) is larger than the budget (8.0 GiB: 80% of 10.0 GiB "
                               "available): reading it would evict what it read first, and the load would read "
                               "the disk anyway"),
    "max_bytes caps it": (3 * GIB, 10 * GIB, 0.8, 2 * GIB, False, 2 * GIB,
                          "the snapshot (3.0 GiB) is larger than the budget (2.0 GiB: max_bytes): reading it "
                          "would evict what it read first, and the load would read the disk anyway"),
    "a larger max_bytes does not raise it": (9 * GIB, 10 * GIB, 0.8, 20 * GIB, False, 8 * GIB, "..."),
    "547 GB on a host with 1.5 TiB free": (547 * 10**9, 1536 * GIB, 0.8, 0, True, int(1536 * GIB * 0.8), None),
    "547 GB on a host with 512 GiB free": (547 * 10**9, 512 * GIB, 0.8, 0, False, int(512 * GIB * 0.8), "..."),
    "empty": (0, 10 * GIB, 0.8, 0, False, 8 * GIB, "the snapshot holds no bytes to read"),
}


@pytest.mark.parametrize("total, available, fraction, max_bytes, read, budget, reason", list(PLANS.values()),
                         ids=list(PLANS))
def test_plan(total, available, fraction, max_bytes, read, budget, reason):
    decision = pcw.plan(total, available, fraction, max_bytes)
    assert decision["read"] is read and decision["budget_bytes"] == budget
    if reason == "...":
        assert decision["reason"].startswith("the snapshot (")
    else:
        assert decision["reason"] == reason


def test_snapshot_files_follow_links_once(tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "aaa").write_bytes(b"x" * 300)
    (blobs / "bbb").write_bytes(b"y" * 50)
    snap = tmp_path / "snapshots" / "c0ffee"
    (snap / "sub").mkdir(parents=True)
    os.symlink("../../blobs/aaa", snap / "model.safetensors")
    os.symlink("../../../blobs/bbb", snap / "sub" / "tokenizer.json")
    os.symlink("../../blobs/aaa", snap / "same-blob-again.safetensors")
    (snap / "config.json").write_text("{}")
    files = pcw.snapshot_files(str(snap))
    assert [(os.path.relpath(p, snap), size) for p, size in files] == [
        ("config.json", 2), ("model.safetensors", 300), ("sub/tokenizer.json", 50)]
    with pytest.raises(pcw.WarmError, match="is not a folder"):
        pcw.snapshot_files(str(tmp_path / "missing"))


class FakeClock:
    def __init__(self):
        self.now = 10.0

    def __call__(self):
        return self.now


def fake_reader(clock, seconds_per_file):
    """Each file takes its time on the clock; a deadline inside a file stops it half-way."""
    calls = []

    def reader(path, buf, deadline, clk):
        calls.append(path)
        size = int(path.rsplit("-", 1)[1])
        if deadline is not None and clock.now + seconds_per_file > deadline:
            clock.now = deadline
            return size // 2, False
        clock.now += seconds_per_file
        return size, True
    return reader, calls


@pytest.mark.parametrize("timeout, read_bytes, files_read, complete, seconds", [
    (0, 600, 3, True, 3.0),          # no limit
    (10, 600, 3, True, 3.0),
    (2.5, 450, 2, False, 2.5),       # the third file is cut half-way at the deadline
])
def test_warm_is_bounded_and_measured(timeout, read_bytes, files_read, complete, seconds):
    clock = FakeClock()
    reader, calls = fake_reader(clock, 1.0)
    files = [("/s/a-100", 100), ("/s/b-200", 200), ("/s/c-300", 300)]
    out = pcw.warm(files, timeout, clock=clock, reader=reader)
    assert (out["bytes_read"], out["files_read"], out["complete"], out["seconds"]) == (
        read_bytes, files_read, complete, seconds)
    assert out["bytes_per_s"] == int(read_bytes / seconds)


def params(**over):
    base = {"path": "/snap", "max_fraction": 0.8, "max_bytes": 0, "timeout": 600.0}
    base.update(over)
    return base


FILES = [("/snap/config.json", 1000), ("/snap/model.safetensors", 3 * GIB)]


@pytest.mark.parametrize("check, available, msg, skipped, warmed", [
    (False, 10 * GIB, "read 2 file(s), 3.0 GiB, in 1.5 s (2.0 GiB/s)", False, True),
    (True, 10 * GIB, "would read 2 file(s), 3.0 GiB, into the page cache (budget 8.0 GiB)", False, False),
    (False, 2 * GIB, "skipped: the snapshot (3.0 GiB) is larger than the budget (1.6 GiB: 80% of 2.0 GiB available)",
     True, False),
    (True, 2 * GIB, "skipped: the snapshot (3.0 GiB) is larger than the budget", True, False),
])
def test_run(check, available, msg, skipped, warmed):
    calls = []

    def do_warm(files, timeout):
        calls.append((files, timeout))
        return {"bytes_read": 3 * GIB + 1000, "files_read": 2, "complete": True, "seconds": 1.5,
                "bytes_per_s": 2 * GIB}
    result = pcw.run(params(), check, available=lambda: available, list_files=lambda path: FILES, do_warm=do_warm)
    assert result["msg"].startswith(msg) and result["skipped"] is skipped
    assert bool(calls) is warmed            # check mode and a skip read nothing
    assert result["changed"] is False and result["files"] == 2 and result["bytes_total"] == 3 * GIB + 1000
    if check and not skipped:
        assert result["would_read_bytes"] == 3 * GIB + 1000 and result["bytes_read"] == 0


def test_run_stopped_by_the_timeout_says_so():
    result = pcw.run(params(timeout=5.0), available=lambda: 10 * GIB, list_files=lambda path: FILES,
                     do_warm=lambda files, timeout: {"bytes_read": GIB, "files_read": 1, "complete": False,
                                                     "seconds": 5.0, "bytes_per_s": GIB // 5})
    assert result["msg"] == result["reason"] == "stopped at the timeout (5.0 s) with 1.0 GiB of 3.0 GiB read"


@pytest.mark.parametrize("over, message", [
    ({"max_fraction": 0.0}, "max_fraction must be above 0 and at most 1, not 0.0"),
    ({"max_fraction": 1.5}, "max_fraction must be above 0 and at most 1, not 1.5"),
    ({"max_bytes": -1}, "max_bytes and timeout must be >= 0"),
    ({"timeout": -1.0}, "max_bytes and timeout must be >= 0"),
])
def test_bad_options(over, message):
    with pytest.raises(pcw.WarmError, match=message):
        pcw.run(params(**over), available=lambda: GIB, list_files=lambda path: [])


def test_the_module_reads_a_real_folder_and_check_mode_reads_nothing(tmp_path):
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "model.safetensors").write_bytes(os.urandom(3 * pcw.CHUNK + 123))
    (snap / "config.json").write_text("{}")
    preview = run_module("page_cache_warm", {"path": str(snap)}, check_mode=True)
    assert preview["changed"] is False and preview["bytes_read"] == 0 and preview["would_read_bytes"] == 3 * pcw.CHUNK + 125
    done = run_module("page_cache_warm", {"path": str(snap)})
    assert done.get("failed") is not True, done
    assert done["bytes_read"] == done["bytes_total"] == 3 * pcw.CHUNK + 125 and done["complete"] is True
    assert done["files_read"] == 2 and done["changed"] is False and done["mem_available_after"] > 0
    tiny = run_module("page_cache_warm", {"path": str(snap), "max_bytes": 1000})
    assert tiny["skipped"] is True and tiny["bytes_read"] == 0 and "(budget" not in tiny["msg"]
    missing = run_module("page_cache_warm", {"path": str(tmp_path / "nope")})
    assert missing["failed"] is True and missing["msg"] == (
        "page_cache_warm: %s is not a folder (the snapshot to read)" % (tmp_path / "nope"))
