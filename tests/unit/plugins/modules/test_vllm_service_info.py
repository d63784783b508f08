"""The vllm_service_info module, run as Ansible runs it (tests.support.modules), on real sockets and
files; systemd is not running here, so the unit-related paths are covered by the lab tests.
(vllm_ready's module tests: test_vllm_ready.py beside this file.)"""
from __future__ import annotations

import json
import os
import socket
import stat

import pytest

from tests.support.modules import run_module
from tests.unit.plugins.module_utils.store.test_snapshot_check import COMMIT, REPO, make_snapshot
from tests.unit.plugins.module_utils.serving.test_vllm_gates import free_port

pytestmark = pytest.mark.unit


def fake_venv(root, version="0.32.0+cpu"):
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    py = bin_dir / "python"
    py.write_text("#!/bin/sh\necho %s\n" % version)
    vllm = bin_dir / "vllm"
    vllm.write_text("#!/bin/sh\nexit 0\n")
    for f in (py, vllm):
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return root


def test_vllm_service_info_reads_record_port_snapshot_and_venv(tmp_path):
    snap = make_snapshot(tmp_path / "hub")
    record = tmp_path / "deployment.json"
    record.write_text(json.dumps({"model": "tiny-b", "path": "/p", "served_model_name": "tiny-b",
                                  "unit": "vllm.service", "previous": {"model": "tiny-a"}}))
    venv = fake_venv(tmp_path / "venv")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        res = run_module("vllm_service_info", {
            "port": port, "record_path": str(record),
            "model": {"name": "tiny-a", "repo_id": REPO, "revision": COMMIT},
            "cache_dir": str(tmp_path / "hub"), "venv": str(venv)})
    assert not res.get("failed"), res
    assert res["changed"] is False
    assert res["deployment"]["model"] == "tiny-b" and res["previous"] == {"model": "tiny-a"}
    assert res["snapshot"]["verified"] is True and res["snapshot"]["path"] == str(snap)
    assert res["vllm"] == {"binary": str(venv / "bin" / "vllm"), "exists": True,
                           "python": str(venv / "bin" / "python"), "version": "0.32.0+cpu"}
    # this test process holds the port, outside vllm.service: a foreign listener
    [listener] = res["port"]["listeners"]
    assert listener["pid"] == os.getpid() and res["port"]["foreign"] == [listener]
    assert listener["text"].startswith("pid %d" % os.getpid())
    # systemd does not run on this machine: the unit is reported as not loaded, with the reason
    assert res["unit"]["loaded"] is False and res["unit"]["main_pid"] == 0


def test_vllm_service_info_reports_what_is_missing(tmp_path):
    res = run_module("vllm_service_info", {
        "record_path": str(tmp_path / "none.json"), "port": free_port(),
        "model": {"name": "tiny-a", "repo_id": REPO, "revision": COMMIT},
        "cache_dir": str(tmp_path), "venv": str(tmp_path / "novenv")})
    assert res["record"] is None and res["deployment"] is None
    assert res["port"]["listeners"] == [] and res["port"]["foreign"] == []
    assert res["snapshot"]["verified"] is False and "is not on this host" in res["snapshot"]["reason"]
    assert res["vllm"]["exists"] is False and res["vllm"]["version"] is None


def test_vllm_service_info_reports_a_broken_record(tmp_path):
    record = tmp_path / "deployment.json"
    record.write_text("{")
    res = run_module("vllm_service_info", {"record_path": str(record)})
    assert res["failed"] and "not valid JSON" in res["msg"]
