"""shm_cleanup: its logic (plugins/module_utils/gpu/shm.py, common/procfs.py) on a temporary
directory standing in for /dev/shm, with real processes holding files open or mapped, and the
module run as Ansible runs it (tests.support.modules.run_module), end to end inside a fresh PID
namespace (tests.support.shm_ns), where every process can be inspected.
"""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from ansible_collections.modelswap.vllm.plugins.module_utils.common import procfs
from ansible_collections.modelswap.vllm.plugins.module_utils.gpu import shm
from tests.support.holders import holding
from tests.support.modules import COLLECTIONS, REPO
from tests.support.shm_ns import NEEDS_NAMESPACE, in_namespace, populate

pytestmark = pytest.mark.unit

ME_UID = os.getuid()
ME = pwd.getpwuid(ME_UID).pw_name
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="creating another user's file needs root")
CHATTR = shutil.which("chattr")


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


def warnings(result):
    """Warning texts of a result (ansible-core 2.19 returns structured WarningSummary dicts)."""
    return [w["event"]["msg"] if isinstance(w, dict) else str(w) for w in result.get("warnings", [])]


@contextlib.contextmanager
def chattr(path, flag):
    """`path` with the inode flag +i or +a set (root, a file system that keeps it); always unset."""
    if os.geteuid() != 0 or not CHATTR:
        pytest.skip("setting an inode flag needs root and chattr")
    proc = subprocess.run([CHATTR, "+" + flag, str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip("the file system of %s keeps no inode flags: %s" % (path, proc.stderr.strip()))
    try:
        yield path
    finally:
        subprocess.run([CHATTR, "-" + flag, str(path)], capture_output=True, check=False)


# ---------------------------------------------------------------------------- the plan

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
    planned = shm.plan(str(shmdir), ME_UID, shm.with_defaults(["sem.loky-*"]))
    assert names(planned["remove"]) == ["nccl-x", "sem.loky-12"]
    assert names(shm.plan(str(shmdir), ME_UID)["remove"]) == ["nccl-x"]


def test_with_defaults_keeps_the_defaults_first_and_once():
    assert shm.with_defaults([]) == list(shm.DEFAULT_PATTERNS)
    assert shm.with_defaults(["sem.loky-*", "nccl-*"]) == list(shm.DEFAULT_PATTERNS) + ["sem.loky-*"]


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


# ---------------------------------------------------------------------------- refusals, before anything goes

def planned_files(shmdir):
    return shm.plan(str(shmdir), ME_UID)["remove"]


def test_nothing_refused_in_a_writable_directory(shmdir):
    make(shmdir, "nccl-a")
    make(shmdir, "psm_b")
    ready, refused = shm.refusals(planned_files(shmdir), str(shmdir))
    assert names(ready) == ["nccl-a", "psm_b"] and refused == []
    assert shm.refusals([], str(shmdir)) == ([], [])


def test_an_immutable_file_is_refused_and_named(shmdir):
    make(shmdir, "nccl-a")
    locked = make(shmdir, "psm_locked")
    with chattr(locked, "i"):
        ready, refused = shm.refusals(planned_files(shmdir), str(shmdir))
        with pytest.raises(PermissionError):   # what unlink would have said, for the record
            os.unlink(locked)
    assert names(ready) == ["nccl-a"]
    assert refused == [{"path": str(locked), "reason": "the file is immutable (chattr +i)"}]


def test_an_append_only_directory_refuses_every_file(shmdir):
    make(shmdir, "nccl-a")
    make(shmdir, "psm_b")
    planned = planned_files(shmdir)
    with chattr(shmdir, "a"):
        ready, refused = shm.refusals(planned, str(shmdir))
    assert ready == []
    assert [r["reason"] for r in refused] == ["%s is append-only (chattr +a)" % shmdir] * 2


def test_the_sticky_bit_refuses_another_users_file(shmdir):
    make(shmdir, "nccl-a")
    os.chmod(shmdir, 0o1777)
    planned = planned_files(shmdir)
    stranger = 2 ** 20 + 7               # neither root, the file's owner nor the directory's
    ready, refused = shm.refusals(planned, str(shmdir), euid=stranger)
    assert ready == [] and len(refused) == 1
    assert "has the sticky bit and the file belongs to %s" % ME in refused[0]["reason"]
    # Its owner (or root) may remove it.
    assert names(shm.refusals(planned, str(shmdir), euid=ME_UID)[0]) == ["nccl-a"]


def test_a_file_changed_since_the_plan_is_refused_and_a_gone_one_dropped(shmdir):
    path = make(shmdir, "nccl-race")
    gone = make(shmdir, "psm_gone")
    make(shmdir, "vllm_fine")
    planned = planned_files(shmdir)
    os.replace(make(shmdir, "nccl-race.new"), path)
    gone.unlink()
    ready, refused = shm.refusals(planned, str(shmdir))
    assert names(ready) == ["vllm_fine"]
    assert refused == [{"path": str(path), "reason": "changed since it was checked (replaced or re-owned)"}]


def test_a_refused_unlink_during_apply_is_reported_and_the_rest_goes(shmdir, monkeypatch):
    """What refusals cannot foresee (an LSM's denial): apply names it, the others still go."""
    make(shmdir, "nccl-a", 100)
    denied = make(shmdir, "psm_denied")
    make(shmdir, "vllm_c", 10)
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if os.fspath(path) == denied.name:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(shm.os, "unlink", unlink)
    removed, errors = shm.apply(planned_files(shmdir), str(shmdir))
    assert removed == [{"path": str(shmdir / "nccl-a"), "size": 100},
                       {"path": str(shmdir / "vllm_c"), "size": 10}]
    assert errors == [{"path": str(denied), "reason": "Operation not permitted"}]
    assert sorted(os.listdir(shmdir)) == ["psm_denied"]


# ---------------------------------------------------------------------------- the module: documentation

def test_documentation_matches_the_argument_spec():
    spec = importlib.util.spec_from_file_location("shm_cleanup_doc", REPO / "plugins" / "modules" / "shm_cleanup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    doc = yaml.safe_load(mod.DOCUMENTATION)
    argspec = mod.argument_spec()
    assert sorted(doc["options"]) == sorted(argspec)
    for name, arg in argspec.items():
        assert doc["options"][name]["type"] == arg["type"], name
        assert doc["options"][name].get("default") == arg.get("default"), name
        assert doc["options"][name].get("elements") == arg.get("elements"), name
        assert bool(doc["options"][name].get("required")) == bool(arg.get("required")), name
    assert doc["attributes"]["check_mode"]["support"] == "full"
    assert doc["attributes"]["diff_mode"]["support"] == "full"
    assert "modelswap.vllm.attributes" in doc["extends_documentation_fragment"]
    yaml.safe_load(mod.EXAMPLES)
    returns = yaml.safe_load(mod.RETURN)
    assert {"removed", "bytes_freed", "in_use", "refused", "unverified"} <= set(returns)
    # ansible-doc renders it: tests/unit/test_module_docs.py, for every module.


# ---------------------------------------------------------------------------- the module, end to end

STALE = ["nccl-1a2b", "psm_9f8e", "sem.loky-7", "sem.mp-abc", "vllm_buf"]
STALE_BYTES = 32768 + 4096 + 32 + 1024 + 32


@NEEDS_NAMESPACE
def test_check_mode_then_apply_then_idempotent(tmp_path):
    shmdir = tmp_path / "shm"
    populate(shmdir)
    before = sorted(os.listdir(shmdir))
    args = {"service_user": ME, "shm_dir": str(shmdir), "patterns": ["sem.loky-*"]}
    out = in_namespace(tmp_path, {"dir": str(shmdir), "hold_fd": ["psm_held"],
                                  "hold_map": ["nccl-mapped"],
                                  "runs": [{"args": args, "check_mode": True, "diff": True},
                                           {"args": args, "diff": True},
                                           {"args": args}]})
    check, real, again = (r["result"] for r in out["runs"])

    # Check mode: lists what would go, with sizes, removes nothing.
    assert check.get("failed") is not True, check
    assert check["changed"] is True
    assert names(check["removed"]) == STALE
    assert {os.path.basename(r["path"]): r["size"] for r in check["removed"]}["nccl-1a2b"] == 32768
    assert check["bytes_freed"] == STALE_BYTES
    assert out["runs"][0]["after"] == before
    assert "would be removed" in check["msg"]
    assert check["diff"]["before"].count("\n") == 7 and check["diff"]["after"].count("\n") == 2
    assert check["refused"] == [] and check["unverified"] == []

    # The real run removes exactly those; held, mapped and other users' files stay.
    assert real["changed"] is True and real["removed"] == check["removed"]
    assert real["bytes_freed"] == STALE_BYTES
    assert out["runs"][1]["after"] == ["keep-me", "nccl-mapped", "psm_held", "vllm_theirs"]
    in_use = {os.path.basename(e["path"]): e["holders"] for e in real["in_use"]}
    assert in_use["psm_held"][0]["pid"] == out["holders"]["psm_held"]
    assert in_use["psm_held"][0]["via"] == ["fd"]
    assert in_use["nccl-mapped"][0]["pid"] == out["holders"]["nccl-mapped"]
    assert in_use["nccl-mapped"][0]["via"] == ["mmap"]
    assert [os.path.basename(e["path"]) for e in real["other_owner"]] == ["vllm_theirs"]
    assert any("Kept %s: still in use by PID %d (fd" % (shmdir / "psm_held", out["holders"]["psm_held"])
               in w for w in warnings(real))
    assert real["diff"]["after"] == "%s\n%s\n" % (shmdir / "nccl-mapped", shmdir / "psm_held")
    assert real["msg"].startswith("%s: 5 stale segment(s) of %s removed (" % (shmdir, ME))

    # Nothing left to do.
    assert again["changed"] is False and again["removed"] == [] and again["bytes_freed"] == 0
    assert out["runs"][2]["after"] == out["runs"][1]["after"]


@NEEDS_NAMESPACE
def test_check_mode_reports_what_would_go_and_removes_nothing(tmp_path):
    shmdir = tmp_path / "shm"
    shmdir.mkdir()
    make(shmdir, "nccl-stale", 65536)
    make(shmdir, "psm_stale", 100)
    args = {"service_user": ME, "shm_dir": str(shmdir)}
    out = in_namespace(tmp_path, {"dir": str(shmdir), "runs": [{"args": args, "check_mode": True}] * 2})
    for run in out["runs"]:
        res = run["result"]
        assert res.get("failed") is not True, res
        assert res["changed"] is True
        assert res["removed"] == [{"path": str(shmdir / "nccl-stale"), "size": 65536, "pattern": "nccl-*"},
                                  {"path": str(shmdir / "psm_stale"), "size": 100, "pattern": "psm_*"}]
        assert res["bytes_freed"] == 65636
        assert res["msg"] == "%s: 2 stale segment(s) of %s would be removed (64.1 KiB), 0 in use kept" % (shmdir, ME)
        assert run["after"] == ["nccl-stale", "psm_stale"]


@NEEDS_NAMESPACE
@pytest.mark.parametrize("check_mode", [True, False], ids=["check-mode", "real"])
def test_a_refused_delete_fails_clearly_and_removes_nothing(tmp_path, check_mode):
    shmdir = tmp_path / "shm"
    shmdir.mkdir()
    make(shmdir, "nccl-a")
    locked = make(shmdir, "psm_locked")
    make(shmdir, "vllm_c")
    with chattr(locked, "i"):
        out = in_namespace(tmp_path, {"dir": str(shmdir), "runs": [
            {"args": {"service_user": ME, "shm_dir": str(shmdir)}, "check_mode": check_mode}]})
    res, after = out["runs"][0]["result"], out["runs"][0]["after"]
    assert res["failed"] is True and res["changed"] is False, res
    assert after == ["nccl-a", "psm_locked", "vllm_c"]          # nothing half-done
    assert res["removed"] == [] and res["bytes_freed"] == 0
    assert res["refused"] == [{"path": str(locked), "reason": "the file is immutable (chattr +i)"}]
    assert res["msg"].startswith("Refusing to remove the stale shared-memory segments of %s in %s: "
                                 "1 of 3 file(s) cannot be removed - %s: the file is immutable"
                                 % (ME, shmdir, locked))
    assert "Nothing was removed. Fix:" in res["msg"]


@NEEDS_NAMESPACE
def test_a_read_only_mount_refuses_every_file(tmp_path):
    shmdir = tmp_path / "shm"
    shmdir.mkdir()
    make(shmdir, "nccl-a")
    make(shmdir, "psm_b")
    out = in_namespace(tmp_path, {"dir": str(shmdir), "readonly": True, "runs": [
        {"args": {"service_user": ME, "shm_dir": str(shmdir)}}]})
    res = out["runs"][0]["result"]
    assert res["failed"] is True and res["changed"] is False and res["removed"] == []
    assert [r["reason"] for r in res["refused"]] == ["%s is on a read-only file system" % shmdir] * 2
    assert out["runs"][0]["after"] == ["nccl-a", "psm_b"]


# Stands in for what the pre-check cannot foresee (an LSM that denies the unlink itself).
DENY_UNLINK = '''
import errno, os
_unlink = os.unlink
def unlink(path, *args, **kwargs):
    if "denied" in os.fspath(path):
        raise PermissionError(errno.EACCES, "Permission denied")
    return _unlink(path, *args, **kwargs)
os.unlink = unlink
'''


@NEEDS_NAMESPACE
def test_an_unforeseen_refusal_fails_naming_the_file_and_what_went(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(DENY_UNLINK)
    shmdir = tmp_path / "shm"
    shmdir.mkdir()
    make(shmdir, "nccl-a", 100)
    make(shmdir, "psm_denied", 10)
    env = {"PYTHONPATH": os.pathsep.join([str(shim), str(COLLECTIONS)])}
    out = in_namespace(tmp_path, {"dir": str(shmdir), "runs": [
        {"args": {"service_user": ME, "shm_dir": str(shmdir)}, "env": env}]})
    res = out["runs"][0]["result"]
    assert res["failed"] is True and res["changed"] is True, res
    assert res["removed"] == [{"path": str(shmdir / "nccl-a"), "size": 100, "pattern": "nccl-*"}]
    assert res["bytes_freed"] == 100
    assert res["refused"] == [{"path": str(shmdir / "psm_denied"), "reason": "Permission denied"}]
    assert "failed for 1 file(s) - %s: Permission denied. Removed 1 other(s)" % (shmdir / "psm_denied") in res["msg"]
    assert out["runs"][0]["after"] == ["psm_denied"]


@pytest.fixture
def public_dir():
    """A directory another user can reach (pytest's tmp_path lives under a 0700 folder)."""
    path = Path(tempfile.mkdtemp(prefix="ms-shm-cleanup-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_without_become_removes_nothing(public_dir):
    """Run as an unprivileged user (no become): root's processes cannot be inspected, so no
    file is proven unused and nothing is removed."""
    nobody = pwd.getpwnam("nobody")
    work = public_dir
    shmdir = work / "shm"
    shmdir.mkdir()
    (shmdir / "nccl-x").write_bytes(b"x")
    os.chown(shmdir / "nccl-x", nobody.pw_uid, -1)
    args = work / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {
        "service_user": "nobody", "shm_dir": str(shmdir)}}))
    for path in (work, shmdir, args):
        os.chmod(path, 0o755)
    # The host's python3 (the venv's interpreter lives under /root); ansible.module_utils from
    # the venv, as a module finds it on a host.
    site = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p + "/ansible")]
    env = dict(os.environ, HOME=str(work), PYTHONPATH=os.pathsep.join([str(COLLECTIONS)] + site))
    python = shutil.which("python3", path="/usr/bin:/bin")
    proc = subprocess.run([python, str(REPO / "plugins" / "modules" / "shm_cleanup.py"), str(args)],
                          capture_output=True, text=True, env=env, user=nobody.pw_uid,
                          group=nobody.pw_gid, extra_groups=[], cwd=str(work), timeout=120, check=False)
    assert proc.stdout.strip().startswith("{"), proc.stderr
    result = json.loads(proc.stdout)
    assert result.get("failed") is not True, result
    assert result["changed"] is False and result["removed"] == []
    assert result["unverified"] == [str(shmdir / "nccl-x")]
    assert any("could not be inspected" in w and "become: true" in w for w in warnings(result))
    assert (shmdir / "nccl-x").exists()
