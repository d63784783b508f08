"""One migration at a time per host (issue 27 item 2): the host_lease module as Ansible runs it.
The lease's rules, its refusal and its file are tested in
tests/unit/plugins/module_utils/common/test_host_lease.py."""
from __future__ import annotations

import json
import os
import platform

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common import host_lease
from tests.support.modules import run_module

pytestmark = pytest.mark.unit


def test_the_module_takes_the_lease(tmp_path):
    path = str(tmp_path / "lib" / "lease.json")
    taken = run_module("host_lease", {"path": path, "run_id": "run-a", "controller": "ctl01", "user": "alice",
                                      "pid": 4242, "ttl": 600})
    assert taken.get("failed") is not True, taken
    assert taken["changed"] and taken["action"] == "take" and not taken["taken_over"]
    assert taken["lease"] == host_lease.read(path) and taken["previous"] is None
    assert (taken["lease"]["user"], taken["lease"]["pid"], taken["lease"]["purpose"]) == ("alice", 4242, "migrate")
    assert taken["lease"]["expires"] - taken["lease"]["started"] == 600
    renewed = run_module("host_lease", {"path": path, "run_id": "run-a"})
    assert renewed["changed"] and renewed["action"] == "renew"
    assert renewed["lease"]["started"] == taken["lease"]["started"]
    assert renewed["lease"]["expires"] - renewed["lease"]["renewed"] == 14400          # the default ttl
    read = run_module("host_lease", {"path": path, "state": "read"})
    assert not read["changed"] and read["lease"] == host_lease.read(path)
    released = run_module("host_lease", {"path": path, "state": "released", "run_id": "run-a"})
    assert released["changed"] and released["action"] == "release" and released["lease"] is None
    assert not os.path.exists(path)


def test_the_module_refuses_a_second_run(tmp_path):
    path = str(tmp_path / "lease.json")
    run_module("host_lease", {"path": path, "run_id": "run-a", "controller": "ctl01", "user": "alice", "pid": 4242})
    before = open(path, "rb").read()
    refused = run_module("host_lease", {"path": path, "run_id": "run-b"})
    assert refused["failed"] and refused["changed"] is False and refused["action"] == "refuse"
    assert refused["msg"].startswith("host_lease: %s is held by run run-a (controller ctl01, user alice, "
                                     "PID 4242, since " % platform.node())
    assert refused["msg"].endswith("run again with -e modelswap_break_lease=run-a; nothing was changed")
    assert refused["holder"] == json.loads(before)
    wrong = run_module("host_lease", {"path": path, "run_id": "run-b", "break_lease": "run-x"})
    assert wrong["failed"] and "not by run run-x" in wrong["msg"] and wrong["holder"]["run_id"] == "run-a"
    released = run_module("host_lease", {"path": path, "state": "released", "run_id": "run-b"})
    assert not released["changed"] and released["action"] == "none"
    assert open(path, "rb").read() == before


def test_the_module_takes_over_as_asked_and_says_so(tmp_path):
    path = str(tmp_path / "lease.json")
    run_module("host_lease", {"path": path, "run_id": "run-a"})
    broken = run_module("host_lease", {"path": path, "run_id": "run-b", "break_lease": "run-a"})
    assert broken["changed"] and broken["taken_over"] and broken["lease"]["run_id"] == "run-b"
    assert broken["previous"]["run_id"] == "run-a"
    warnings = [w if isinstance(w, str) else json.dumps(w) for w in broken.get("warnings", [])]
    assert any("taken over from run run-a as asked (modelswap_break_lease)" in w for w in warnings), broken


def test_the_module_writes_nothing_in_check_mode(tmp_path):
    folder = tmp_path / "lib"
    path = str(folder / "lease.json")
    checked = run_module("host_lease", {"path": path, "run_id": "run-a"}, check_mode=True)
    assert checked.get("failed") is not True, checked
    assert checked["action"] == "take" and checked["would"].startswith("would take the lease for run run-a")
    assert checked["lease"]["run_id"] == "run-a" and not folder.exists()
    run_module("host_lease", {"path": path, "run_id": "run-a"})
    before = open(path, "rb").read()
    listing = sorted(os.listdir(folder))
    refused = run_module("host_lease", {"path": path, "run_id": "run-b"}, check_mode=True)
    assert refused["failed"] and refused["holder"]["run_id"] == "run-a" and "would refuse" in refused["would"]
    released = run_module("host_lease", {"path": path, "state": "released", "run_id": "run-a"}, check_mode=True)
    assert released["action"] == "release" and "would give the lease back" in released["would"]
    broken = run_module("host_lease", {"path": path, "run_id": "run-b", "break_lease": "run-a"}, check_mode=True)
    assert broken["action"] == "take" and broken["taken_over"]
    assert open(path, "rb").read() == before and sorted(os.listdir(folder)) == listing


@pytest.mark.parametrize("args, words", [
    ({"run_id": "run-a", "ttl": 0}, "ttl must be a number of seconds above 0, not 0"),
    ({"run_id": "run a"}, "run_id 'run a' is not a run id"),
    ({"run_id": "run-a", "break_lease": "x y"}, "break_lease 'x y' is not a run id"),
    ({"state": "released"}, "run_id"),
])
def test_the_module_refuses_bad_options(tmp_path, args, words):
    result = run_module("host_lease", dict(args, path=str(tmp_path / "lib" / "lease.json")))
    assert result["failed"] and words in result["msg"], result
    assert not (tmp_path / "lib").exists()


def test_the_module_names_a_corrupt_file(tmp_path):
    path = tmp_path / "lease.json"
    path.write_text("garbage")
    result = run_module("host_lease", {"path": str(path), "run_id": "run-a"})
    assert result["failed"] and str(path) in result["msg"] and "remove it" in result["msg"]
    assert path.read_text() == "garbage"
