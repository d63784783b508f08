"""The /dev/shm cleanup logic (plugins/module_utils/gpu/shm.py, procfs.py) on a temporary directory standing
in for /dev/shm, with real processes holding files open or mapped.
"""
from __future__ import annotations

import os
import pwd

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common import procfs
from ansible_collections.modelswap.vllm.plugins.module_utils.gpu import shm
from tests.support.holders import holding

pytestmark = pytest.mark.unit

ME_UID = os.getuid()
ME = pwd.getpwuid(ME_UID).pw_name
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="creating another user's file needs root")


def other_uid():
    for name in ("nobody", "daemon"):
        try:
            return pwd.getpwnam(name).pw_uid
        except KeyError:
            continue
    raise RuntimeError("no second account on this machine")


def make(d, name, size=4096, uid=None):
    path = d / name
    path.write_bytes(b"\0" * size)
    if uid is not None:
        os.chown(path, uid, -1)
    return path


@pytest.fixture
def shmdir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return d


def names(entries):
    return sorted(os.path.basename(e["path"]) for e in entries)


@NEEDS_ROOT
def test_plan_removes_only_unused_files_of_the_service_user(shmdir):
    make(shmdir, "nccl-unused-1", 32 * 1024)
    make(shmdir, "psm_0ab12cd3")
    make(shmdir, "sem.mp-xyz", 32)
    make(shmdir, "vllm_offload_buf")
    held = make(shmdir, "psm_held")
    mapped = make(shmdir, "nccl-mapped", 8192)
    make(shmdir, "vllm_other_user", uid=other_uid())
    make(shmdir, "unrelated-file")                      # the user's, but no pattern matches
    (shmdir / "nccl-dir").mkdir()                       # matches, not a regular file
    os.symlink("/etc/passwd", shmdir / "nccl-link")     # matches, a symlink: never followed
    with holding(held, "fd") as fd_pid, holding(mapped, "mmap") as map_pid:
        planned = shm.plan(str(shmdir), ME_UID)
    assert names(planned["remove"]) == ["nccl-unused-1", "psm_0ab12cd3", "sem.mp-xyz",
                                        "vllm_offload_buf"]
    assert [e["pattern"] for e in planned["remove"]] == ["nccl-*", "psm_*", "sem.mp-*", "vllm_*"]
    in_use = {os.path.basename(e["path"]): e for e in planned["in_use"]}
    assert sorted(in_use) == ["nccl-mapped", "psm_held"]
    (fd_holder,) = in_use["psm_held"]["holders"]
    assert fd_holder["pid"] == fd_pid and fd_holder["via"] == ["fd"]
    assert fd_holder["user"] == ME and "python" in fd_holder["cmdline"]
    (map_holder,) = in_use["nccl-mapped"]["holders"]
    assert map_holder["pid"] == map_pid and map_holder["via"] == ["mmap"]
    assert in_use["nccl-mapped"]["size"] == 8192
    assert planned["other_owner"] == [{"path": str(shmdir / "vllm_other_user"),
                                       "owner": pwd.getpwuid(other_uid()).pw_name, "size": 4096}]
    assert sorted((os.path.basename(s["path"]), s["reason"]) for s in planned["skipped"]) == [
        ("nccl-dir", "directory, not a regular file"), ("nccl-link", "symlink, not a regular file")]
    assert not {fd_pid, map_pid} & set(planned["uninspectable"])


@NEEDS_ROOT
def test_apply_removes_the_plan_and_nothing_else(shmdir):
    make(shmdir, "nccl-a", 1000)
    make(shmdir, "psm_b", 24)
    held = make(shmdir, "sem.mp-held")
    make(shmdir, "nccl-theirs", uid=other_uid())
    with holding(held, "mmap"):
        planned = shm.plan(str(shmdir), ME_UID)
        removed, errors = shm.apply(planned["remove"], str(shmdir))
        assert errors == []
        assert sorted(r["path"] for r in removed) == [str(shmdir / "nccl-a"),
                                                      str(shmdir / "psm_b")]
        assert sum(r["size"] for r in removed) == 1024
        assert sorted(os.listdir(shmdir)) == ["nccl-theirs", "sem.mp-held"]
        # Nothing left to do: the same plan again is empty (idempotent).
        assert shm.plan(str(shmdir), ME_UID)["remove"] == []


def test_a_file_freed_by_its_process_becomes_removable(shmdir):
    path = make(shmdir, "vllm_shared")
    with holding(path, "fd"):
        assert names(shm.plan(str(shmdir), ME_UID)["in_use"]) == ["vllm_shared"]
    planned = shm.plan(str(shmdir), ME_UID)
    assert names(planned["remove"]) == ["vllm_shared"] and planned["in_use"] == []


def test_a_file_replaced_after_the_scan_is_left_alone(shmdir):
    path = make(shmdir, "nccl-race")
    planned = shm.plan(str(shmdir), ME_UID)
    newer = make(shmdir, "nccl-race.new")
    os.replace(newer, path)             # same name, new inode: someone created it since
    removed, errors = shm.apply(planned["remove"], str(shmdir))
    assert removed == [] and path.exists()
    assert errors == [{"path": str(path),
                       "reason": "changed since it was checked (replaced or re-owned); left"}]


def test_a_file_already_gone_is_not_an_error(shmdir):
    path = make(shmdir, "psm_gone")
    planned = shm.plan(str(shmdir), ME_UID)
    path.unlink()
    assert shm.apply(planned["remove"], str(shmdir)) == ([], [])


def test_extra_patterns(shmdir):
    make(shmdir, "sem.loky-12")
    make(shmdir, "nccl-x")
    planned = shm.plan(str(shmdir), ME_UID, list(shm.DEFAULT_PATTERNS) + ["sem.loky-*"])
    assert names(planned["remove"]) == ["nccl-x", "sem.loky-12"]
    assert names(shm.plan(str(shmdir), ME_UID)["remove"]) == ["nccl-x"]


def test_processes_that_cannot_be_inspected_are_reported(shmdir, monkeypatch):
    path = make(shmdir, "nccl-unproven")
    me = os.getpid()
    real_listdir = os.listdir

    def listdir(p):
        if p == "/proc/%d/fd" % me:
            raise PermissionError(13, "Permission denied", p)
        return real_listdir(p)

    monkeypatch.setattr(procfs.os, "listdir", listdir)
    planned = shm.plan(str(shmdir), ME_UID, exclude_pids=())
    assert me in planned["uninspectable"]
    assert names(planned["remove"]) == [path.name]
    to_remove, unverified = shm.removable(planned)
    assert to_remove == [] and names(unverified) == [path.name]


def test_removable_when_every_process_was_inspected(shmdir):
    make(shmdir, "nccl-proven")
    planned = shm.plan(str(shmdir), ME_UID)
    planned["uninspectable"] = []      # this machine's PID 1 may hide its maps from root
    to_remove, unverified = shm.removable(planned)
    assert names(to_remove) == ["nccl-proven"] and unverified == []


def test_holders_match_by_inode_not_only_by_name(shmdir, tmp_path):
    # A file of the same name elsewhere (another mount namespace's /dev/shm) is not this file.
    other = tmp_path / "elsewhere"
    other.mkdir()
    twin = make(other, "nccl-same-name")
    mine = make(shmdir, "nccl-same-name")
    with holding(twin, "fd"):
        st = os.stat(mine)
        found, _unused = procfs.holders({(st.st_dev, st.st_ino): str(mine)})
    assert found == {}


def test_unreadable_directory_is_a_clear_error(tmp_path):
    with pytest.raises(shm.ShmError) as err:
        shm.plan(str(tmp_path / "missing"), ME_UID)
    assert "cannot list" in str(err.value) and "missing" in str(err.value)


@pytest.mark.parametrize("pattern,why", [
    ("/dev/shm/nccl-*", "is absolute"),
    ("../etc/*", "contains '/'"),
    ("sub/nccl-*", "contains '/'"),
    ("..", "starts with '.'"),
    (".hidden*", "starts with '.'"),
    ("*", "would match almost any file name"),
    ("*?*", "would match almost any file name"),
    ("[a-z]*", "would match almost any file name"),
    ("", "is empty"),
    ("  ", "is empty"),
    ("nccl\0*", "contains a NUL byte"),
])
def test_unknown_patterns_are_rejected(pattern, why):
    assert why in shm.pattern_problem(pattern)
    with pytest.raises(shm.ShmError) as err:
        shm.validate_patterns(["sem.loky-*", pattern])
    assert "unknown shm pattern(s)" in str(err.value) and why in str(err.value)


@pytest.mark.parametrize("pattern", list(shm.DEFAULT_PATTERNS) + ["sem.loky-*", "torch_[0-9]*",
                                                                  "vllm_offload_*", "*.nccl"])
def test_good_patterns(pattern):
    assert shm.pattern_problem(pattern) is None


def test_service_user_must_exist():
    with pytest.raises(shm.ShmError) as err:
        shm.resolve_user("no-such-user-modelswap")
    assert "service user 'no-such-user-modelswap' does not exist on this host" in str(err.value)
    with pytest.raises(shm.ShmError):
        shm.resolve_user("")
    assert shm.resolve_user(ME) == (ME_UID, ME)


def test_process_info_of_a_pid_that_does_not_exist():
    assert procfs.process_info(2 ** 22 + 12345) is None
    info = procfs.process_info(os.getpid())
    assert info["uid"] == ME_UID and info["user"] == ME and "python" in info["cmdline"]
