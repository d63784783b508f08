"""A failed record write must not lose the rollback target (issue 27 item 6).

deployment_record stages the new saved configuration in <saved_dir>/.staged (for.json last),
writes the record (the commit point), then publishes the staged copies over saved/active and
saved/previous. Each test injects a fault into the real module, run as Ansible runs it (a child
process, see tests/support/modules.py), at one point of that order: an OSError (ENOSPC) or a crash
(os._exit: no exception handler, no cleanup, as a host that loses power), then runs the module
again without the fault, and ends on the invariant: the record names D, saved/active holds D's
files and saved/previous the files of the deployment before D.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import deployment_record
from tests.support.modules import COLLECTIONS, REPO, run_module
from tests.support.scratch_fs import tree_fingerprint

pytestmark = pytest.mark.unit

NAMES = ("unit", "env", "secret")


def deployment(name: str) -> dict:
    commit = hashlib.sha1(name.encode()).hexdigest()
    return {"model": "tiny-" + name, "repo_id": "lab/tiny-" + name, "commit": commit,
            "path": "/var/lib/modelswap/hf/hub/models--lab--tiny-%s/snapshots/%s" % (name, commit),
            "served_model_name": "tiny-" + name, "unit": "vllm.service", "vllm_version": "0.32.0+cpu",
            "args": ["/opt/v/bin/vllm", "serve", "/p", "--port", "8100"], "host": "0.0.0.0", "port": 8100}


# ------------------------------------------------------------------------------ the fault hook
HOOK = r"""
import errno, json, os, runpy, sys
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import deployment_record as dr
fault = json.loads(os.environ["MODELSWAP_TEST_FAULT"])
count = [0]

def matches(dest):
    dest = str(dest)
    if fault["dest_has"] not in dest or (fault.get("dest_lacks") and fault["dest_lacks"] in dest):
        return False
    count[0] += 1
    return count[0] == fault.get("nth", 1)

def fire():
    if fault["how"] == "crash":
        os._exit(137)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

if fault["fn"] == "copy_file":
    real_copy = dr.copy_file
    def copy_file(src, dest, mode):
        hit = matches(dest)
        if hit and not fault.get("after"):
            fire()
        real_copy(src, dest, mode)
        if hit:
            fire()
    dr.copy_file = copy_file
else:
    real_replace = os.replace
    def replace(src, dst, *args, **kwargs):
        hit = matches(dst)
        if hit and not fault.get("after"):
            fire()
        real_replace(src, dst, *args, **kwargs)
        if hit:
            fire()
    os.replace = replace

sys.argv = [sys.argv[1], sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_faulted(args: dict, fault: dict) -> dict:
    """Run plugins/modules/deployment_record.py as run_module does, with ``fault`` armed: ``fn``
    (copy_file or replace), the ``nth`` call whose destination holds ``dest_has`` (and not
    ``dest_lacks``) fails, before the call (or ``after`` it): ENOSPC or a crash. A crashed run
    prints nothing: {"crashed": True, "rc": ...}."""
    payload = dict(args, _ansible_check_mode=False, _ansible_diff=False)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"ANSIBLE_MODULE_ARGS": payload}, fh)
        args_file = fh.name
    env = dict(os.environ, MODELSWAP_TEST_FAULT=json.dumps(fault))
    env["PYTHONPATH"] = os.pathsep.join([str(COLLECTIONS), env.get("PYTHONPATH", "")])
    try:
        proc = subprocess.run([sys.executable, "-c", HOOK, str(REPO / "plugins" / "modules" / "deployment_record.py"),
                               args_file], capture_output=True, text=True, env=env, timeout=300)
    finally:
        os.unlink(args_file)
    if fault["how"] == "crash" and proc.returncode == 137:
        assert not proc.stdout.strip(), proc.stdout
        return {"crashed": True, "rc": proc.returncode}
    assert proc.stdout.strip(), "rc=%s: %s" % (proc.returncode, proc.stderr[-3000:])
    return json.loads(proc.stdout)


# ------------------------------------------------------------------------------ a host
class Host:
    """A record, a saved_dir and the three live files; ``deploy(name)`` writes name's live files
    (their content names the deployment) and ``args(name)`` records it."""

    def __init__(self, root):
        self.root = root
        self.record = root / "state" / "deployment.json"
        self.record.parent.mkdir()
        self.saved = root / "state" / "vllm" / "vllm"
        self.live = {n: root / "etc" / ("live." + n) for n in NAMES}
        self.live["unit"].parent.mkdir()
        self.staged = self.saved / ".staged"

    @staticmethod
    def files(name):
        return {n: "%s %s\n" % (name, n) for n in NAMES}

    def deploy(self, name):
        for n, text in self.files(name).items():
            self.live[n].write_text(text)

    def args(self, name):
        return {"path": str(self.record), "deployment": deployment(name),
                "unit_file": str(self.live["unit"]), "env_file": str(self.live["env"]),
                "saved_dir": str(self.saved),
                "saved_files": [{"name": n, "path": str(p), "mode": "0644" if n == "unit" else "0600"}
                                for n, p in self.live.items()]}

    def record_ok(self, name, check_mode=False):
        self.deploy(name)
        res = run_module("deployment_record", self.args(name), check_mode=check_mode)
        assert not res.get("failed"), res
        return res

    def saved_files(self, kind):
        folder = self.saved / kind
        return {n: (folder / n).read_text() for n in NAMES if (folder / n).exists()}

    def assert_consistent(self, name, before):
        """The record names ``name``, active holds its files, previous those of ``before``."""
        record = json.loads(self.record.read_text())
        assert record["model"] == "tiny-" + name
        assert (record["previous"] or {}).get("model") == (before and "tiny-" + before)
        assert self.saved_files("active") == self.files(name)
        assert self.saved_files("previous") == (self.files(before) if before else {})
        assert not self.staged.exists()
        assert oct((self.saved / "active" / "secret").stat().st_mode & 0o777) == "0o600"
        if before:
            assert oct((self.saved / "previous" / "unit").stat().st_mode & 0o777) == "0o644"


@pytest.fixture
def host(tmp_path):
    """A host that served Z and now serves A (previous = Z)."""
    h = Host(tmp_path)
    h.record_ok("z")
    h.record_ok("a")
    h.assert_consistent("a", "z")
    return h


def tree(h):
    return tree_fingerprint(h.root / "state")


# ------------------------------------------------------------------------------ the module
def test_a_swap_then_the_same_swap_again_changes_nothing_and_stages_nothing(host):
    swap = host.record_ok("b")
    assert swap["changed"] is True and swap["recovered"] is None
    assert swap["saved"] == {"rotated": list(NAMES), "saved": list(NAMES)}
    host.assert_consistent("b", "a")
    fingerprint, mtime = tree(host), host.record.stat().st_mtime_ns
    again = host.record_ok("b")
    assert again["changed"] is False and again["recovered"] is None
    assert again["saved"] == {"rotated": [], "saved": []}
    assert tree(host) == fingerprint and host.record.stat().st_mtime_ns == mtime
    assert not host.staged.exists()


def test_enospc_at_the_record_write_keeps_the_rollback_target(host):
    """The bug: the copies went first, the record write failed, the rerun rotated again and
    saved/previous held B's files while the record named A -> B."""
    host.deploy("b")
    failed = run_faulted(host.args("b"), {"fn": "replace", "dest_has": str(host.record), "how": "enospc"})
    assert failed.get("failed") is True, failed
    assert str(host.record) in failed["msg"] and "No space left on device" in failed["msg"]
    assert "as before" in failed["msg"]
    # the old state, whole: the record names A, the saved files are A's and Z's, nothing staged
    host.deploy("a")
    host.assert_consistent("a", "z")
    host.deploy("b")
    again = run_module("deployment_record", host.args("b"))
    assert again["changed"] is True and not again.get("failed") and again["recovered"] is None
    host.assert_consistent("b", "a")                      # previous holds A's files, not B's


def test_enospc_while_staging_leaves_the_old_state_and_no_staged_folder(host):
    host.deploy("b")
    failed = run_faulted(host.args("b"), {"fn": "copy_file", "dest_has": "/.staged/", "nth": 2,
                                          "how": "enospc"})
    assert failed.get("failed") is True and "No space left on device" in failed["msg"], failed
    assert not host.staged.exists()
    host.deploy("a")
    host.assert_consistent("a", "z")
    again = host.record_ok("b")
    assert again["changed"] is True and again["recovered"] is None
    host.assert_consistent("b", "a")


@pytest.mark.parametrize("nth", [1, 2, 4, 6])
def test_a_crash_mid_stage_is_discarded_by_the_next_run(host, nth):
    host.deploy("b")
    crashed = run_faulted(host.args("b"), {"fn": "copy_file", "dest_has": "/.staged/", "nth": nth,
                                           "how": "crash", "after": nth == 6})
    assert crashed.get("crashed"), crashed
    assert host.staged.is_dir() and not (host.staged / "for.json").exists()
    assert json.loads(host.record.read_text())["model"] == "tiny-a"
    assert host.saved_files("active") == host.files("a") and host.saved_files("previous") == host.files("z")
    again = host.record_ok("b")
    assert again["recovered"] == "discarded" and again["changed"] is True
    host.assert_consistent("b", "a")


def test_a_crash_at_the_record_write_after_staging_is_discarded(host):
    """for.json is written, the record is not: the commit never happened."""
    host.deploy("b")
    crashed = run_faulted(host.args("b"), {"fn": "replace", "dest_has": str(host.record), "how": "crash"})
    assert crashed.get("crashed"), crashed
    assert (host.staged / "for.json").exists()
    assert json.loads(host.record.read_text())["model"] == "tiny-a"
    assert host.saved_files("active") == host.files("a") and host.saved_files("previous") == host.files("z")
    again = host.record_ok("b")
    assert again["recovered"] == "discarded" and again["changed"] is True
    assert again["saved"] == {"rotated": list(NAMES), "saved": list(NAMES)}
    host.assert_consistent("b", "a")


def test_a_crash_right_after_the_commit_is_published_by_the_next_run(host):
    host.deploy("b")
    crashed = run_faulted(host.args("b"), {"fn": "replace", "dest_has": str(host.record), "how": "crash",
                                           "after": True})
    assert crashed.get("crashed"), crashed
    assert json.loads(host.record.read_text())["model"] == "tiny-b"
    assert host.saved_files("active") == host.files("a")          # not yet published
    again = host.record_ok("b")
    assert again["recovered"] == "published" and again["changed"] is True
    assert again["saved"] == {"rotated": [], "saved": []}          # nothing left to copy after it
    host.assert_consistent("b", "a")


@pytest.mark.parametrize("how, nth", [("enospc", 1), ("crash", 1), ("crash", 4), ("crash", 6)])
def test_a_failure_during_the_publish_is_completed_by_the_next_run(host, how, nth):
    """The record names B; some of saved/previous (or active) may already hold the new copies."""
    host.deploy("b")
    res = run_faulted(host.args("b"), {"fn": "copy_file", "dest_has": str(host.saved),
                                       "dest_lacks": "/.staged/", "nth": nth, "how": how})
    if how == "crash":
        assert res.get("crashed"), res
    else:
        assert res.get("failed") is True and "No space left on device" in res["msg"], res
        assert "the next run publishes it" in res["msg"] and ".staged" in res["msg"]
    assert json.loads(host.record.read_text())["model"] == "tiny-b"
    assert (host.staged / "for.json").exists()
    again = host.record_ok("b")                           # the same deployment, run again
    assert again["recovered"] == "published" and again["changed"] is True
    host.assert_consistent("b", "a")
    last = host.record_ok("b")
    assert last["changed"] is False and last["recovered"] is None


def test_a_committed_staging_is_published_before_the_next_swap(host):
    """A run of another deployment C first completes B (else C's previous would be A's files)."""
    host.deploy("b")
    run_faulted(host.args("b"), {"fn": "copy_file", "dest_has": str(host.saved), "dest_lacks": "/.staged/",
                                 "how": "crash"})
    res = host.record_ok("c")
    assert res["recovered"] == "published"
    host.assert_consistent("c", "b")


def test_check_mode_with_a_staged_folder_writes_nothing_and_predicts_the_recovery(host):
    host.deploy("b")
    run_faulted(host.args("b"), {"fn": "copy_file", "dest_has": str(host.saved), "dest_lacks": "/.staged/",
                                 "how": "crash"})
    fingerprint = tree(host)
    lock = host.record.parent / "deployment.json.lock"
    lock_existed = lock.exists()
    check = run_module("deployment_record", host.args("b"), check_mode=True)
    assert check["changed"] is True and check["recovered"] == "published"
    assert check["saved"] == {"rotated": [], "saved": []}          # planned as after the publish
    check_c = run_module("deployment_record", dict(host.args("b"), deployment=deployment("c")), check_mode=True)
    assert check_c["recovered"] == "published" and check_c["saved"]["rotated"] == list(NAMES)
    assert tree(host) == fingerprint and lock.exists() == lock_existed


def test_check_mode_predicts_a_discard_and_writes_nothing(host):
    host.deploy("b")
    run_faulted(host.args("b"), {"fn": "replace", "dest_has": str(host.record), "how": "crash"})
    fingerprint = tree(host)
    check = run_module("deployment_record", host.args("b"), check_mode=True)
    assert check["changed"] is True and check["recovered"] == "discarded"
    assert check["saved"] == {"rotated": list(NAMES), "saved": list(NAMES)}
    assert tree(host) == fingerprint
    host.record_ok("b")
    host.assert_consistent("b", "a")


def test_a_staged_folder_with_an_unreadable_for_json_is_refused_with_its_path(host):
    host.staged.mkdir()
    (host.staged / "for.json").write_text("{half")
    fingerprint = tree(host)
    res = run_module("deployment_record", host.args("a"))
    assert res.get("failed") is True
    assert str(host.staged / "for.json") in res["msg"] and "remove %s" % host.staged in res["msg"]
    assert tree(host) == fingerprint


def test_an_old_record_of_the_same_deployment_rotates_nothing(host):
    """A schema upgrade writes the record but is no new deployment: previous keeps Z's files."""
    record = json.loads(host.record.read_text())
    del record["schema"]
    host.record.write_text(json.dumps(record))
    res = host.record_ok("a")
    assert res["changed"] is True and res["saved"] == {"rotated": [], "saved": []}
    host.assert_consistent("a", "z")


# ------------------------------------------------------------------------------ the pure decisions
B = deployment_record.normalize(deployment("b"))
REC_A = deployment_record.record_deployment(None, deployment("a"), "t1")[0]
REC_B = deployment_record.record_deployment(REC_A, deployment("b"), "t2")[0]
MANIFEST_B = {"schema": 1, "deployment": B, "files": [{"name": "unit", "to": "active", "mode": 0o644}]}


@pytest.mark.parametrize("staged, manifest, record, decision", [
    (False, None, REC_A, None),                          # nothing staged
    (False, None, None, None),
    (True, None, REC_A, "discard"),                       # died while staging (no for.json)
    (True, None, REC_B, "discard"),
    (True, MANIFEST_B, REC_A, "discard"),                 # the record write never happened
    (True, MANIFEST_B, None, "discard"),                  # first deployment, record never written
    (True, MANIFEST_B, REC_B, "publish"),                 # committed, not (all) published
    (True, MANIFEST_B, dict(REC_B, when="t9"), "publish"),   # `when` is not part of the identity
    (True, dict(MANIFEST_B, deployment=dict(B, port=8200)), REC_B, "discard"),   # any key counts
    (True, MANIFEST_B, deployment_record.record_deployment(REC_B, deployment("a"), "t3")[0], "discard"),
])
def test_recovery(staged, manifest, record, decision):
    assert deployment_record.recovery(staged, manifest, record) == decision


def test_staging_plan_stages_rotations_from_active_and_saves_from_live():
    files = [{"name": "unit", "path": "/etc/u", "mode": "0644"}, {"name": "env", "path": "/etc/e", "mode": "0600"}]
    manifest, sources = deployment_record.staging_plan(
        "/s", files, [("rotate", "unit"), ("save", "unit"), ("save", "env")], deployment("b"),
        {"unit": 0o644, "env": 0o600})
    assert manifest == {"schema": 1, "deployment": B, "files": [
        {"name": "unit", "to": "previous", "mode": 0o644}, {"name": "unit", "to": "active", "mode": 0o644},
        {"name": "env", "to": "active", "mode": 0o600}]}
    assert sources == {("previous", "unit"): "/s/active/unit", ("active", "unit"): "/etc/u",
                       ("active", "env"): "/etc/e"}
    assert deployment_record.staging_plan("/s", files, [], deployment("b"), {}) == (None, {})


@pytest.mark.parametrize("record, new, replaced", [
    (None, "a", False),
    (REC_A, "a", False),
    ({k: v for k, v in REC_A.items() if k != "schema"}, "a", False),
    (REC_A, "b", True),
])
def test_deployment_replaced(record, new, replaced):
    assert deployment_record.deployment_replaced(record, deployment(new)) is replaced


@pytest.mark.parametrize("text", [
    "{half", "[]", '{"deployment": {}}',
    json.dumps(dict(MANIFEST_B, files=[{"name": "../x", "to": "active", "mode": 384}])),
    json.dumps(dict(MANIFEST_B, files=[{"name": "x", "to": "elsewhere", "mode": 384}])),
    json.dumps(dict(MANIFEST_B, files=[{"name": "x", "to": "active", "mode": "0600"}])),
])
def test_unusable_for_json_is_refused(text):
    with pytest.raises(deployment_record.RecordError, match="/s/.staged/for.json"):
        deployment_record.parse_staged(text, "/s/.staged/for.json")


def test_discard_removes_for_json_before_the_copies(tmp_path, monkeypatch):
    staged = tmp_path / ".staged"
    (staged / "active").mkdir(parents=True)
    (staged / "active" / "unit").write_text("u")
    (staged / "for.json").write_text("{}")
    order = []
    real_unlink = os.unlink
    monkeypatch.setattr(os, "unlink", lambda p, *a, **k: (order.append(os.path.basename(p)),
                                                          real_unlink(p, *a, **k))[1])
    deployment_record.discard(str(tmp_path))
    assert order[0] == "for.json" and not staged.exists()
    deployment_record.discard(str(tmp_path))                # nothing there: nothing to do
