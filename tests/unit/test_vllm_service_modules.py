"""The modules vllm_ready and vllm_service_facts, run as Ansible runs them (tests.support.modules),
against a vLLM-like server on loopback, real sockets and files; systemd is not running here, so
the unit-related paths are covered by the lab tests."""
from __future__ import annotations

import json
import os
import socket
import stat

import pytest

from tests.support.modules import run_module
from tests.unit.test_snapshot_check import COMMIT, REPO, make_snapshot
from tests.unit.test_vllm_probe import KEY, FakeVllm, free_port, serve

pytestmark = pytest.mark.unit


def test_vllm_ready_passes_the_gates_and_never_returns_the_key():
    fake = FakeVllm(served="tiny-a", health_after=1)
    with serve(fake) as port:
        res = run_module("vllm_ready", {"port": port, "served_model_name": "tiny-a", "api_key": KEY,
                                        "poll_interval": 0.1, "timeout": 20})
    assert not res.get("failed"), res
    assert res["ready"] is True and res["changed"] is False
    assert list(res["gates"]) == ["port", "health", "models", "completion"]
    assert res["models"] == ["tiny-a"]
    assert res["budget"] == {"seconds": 20.0, "derived": False, "model_bytes": None}
    assert isinstance(res["monotonic"], float)
    assert KEY not in json.dumps(res)


def test_vllm_ready_reads_the_key_from_the_units_environment_file(tmp_path):
    env = tmp_path / "vllm.secret.env"
    env.write_text('# managed\nVLLM_API_KEY="%s"\n' % KEY)
    fake = FakeVllm()
    with serve(fake) as port:
        res = run_module("vllm_ready", {"port": port, "served_model_name": "tiny-a",
                                        "api_key_file": str(env), "poll_interval": 0.1, "timeout": 20})
        wrong = tmp_path / "wrong.env"
        wrong.write_text('VLLM_API_KEY="not-the-key"\n')
        bad = run_module("vllm_ready", {"port": port, "served_model_name": "tiny-a",
                                        "api_key_file": str(wrong), "poll_interval": 0.1, "timeout": 20})
    assert res["ready"] is True
    assert KEY not in json.dumps(res)
    assert bad["failed"] and bad["failed_gate"] == "models" and bad["stopped_by"] == "final"
    assert "rejected the API key" in bad["msg"]
    assert "not-the-key" not in json.dumps(bad)


def test_vllm_ready_failure_says_the_gate_the_error_and_the_budget():
    port = free_port()
    res = run_module("vllm_ready", {"port": port, "served_model_name": "tiny-a", "timeout": 0.5,
                                    "poll_interval": 0.1, "request_timeout": 0.5})
    assert res["failed"] is True and res["ready"] is False
    assert res["failed_gate"] == "port" and res["stopped_by"] == "timeout"
    assert "gate 'port' failed after" in res["msg"] and "(budget 0.5 s)" in res["msg"]
    assert "raise the timeout" in res["msg"]
    soft = run_module("vllm_ready", {"port": port, "timeout": 0.2, "poll_interval": 0.1,
                                     "fail_when_not_ready": False})
    assert not soft.get("failed") and soft["ready"] is False


def test_vllm_ready_derives_its_budget_from_the_model(tmp_path):
    snap = make_snapshot(tmp_path)
    fake = FakeVllm()
    with serve(fake) as port:
        res = run_module("vllm_ready", {"port": port, "served_model_name": "tiny-a", "api_key": KEY,
                                        "model_path": str(snap), "parallel_size": 2,
                                        "enforce_eager": True})
    assert res["ready"] is True
    # 180 s + 4 s/GiB (a few KiB here) + 30 s for the second GPU; no compile time (eager)
    assert res["budget"] == {"seconds": 210.0, "derived": True, "model_bytes": 4096 + 39 + 18}


@pytest.mark.parametrize("args, message", [
    ({"port": 0}, "not a TCP port"),
    ({"port": 8000, "timeout": -1}, "timeout must be >= 0"),
    ({"port": 8000, "poll_interval": 0}, "must be > 0"),
    ({"port": 8000, "state": "stopped"}, "unit"),
    ({"port": 8000, "api_key": "k", "api_key_file": "/f"}, "mutually exclusive"),
])
def test_vllm_ready_bad_arguments(args, message):
    res = run_module("vllm_ready", args)
    assert res["failed"] and message in res["msg"]
    assert "'k'" not in res["msg"]


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


def test_vllm_service_facts_reads_record_port_snapshot_and_venv(tmp_path):
    snap = make_snapshot(tmp_path / "hub")
    record = tmp_path / "deployment.json"
    record.write_text(json.dumps({"model": "tiny-b", "path": "/p", "served_model_name": "tiny-b",
                                  "unit": "vllm.service", "previous": {"model": "tiny-a"}}))
    venv = fake_venv(tmp_path / "venv")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        res = run_module("vllm_service_facts", {
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


def test_vllm_service_facts_reports_what_is_missing(tmp_path):
    res = run_module("vllm_service_facts", {
        "record_path": str(tmp_path / "none.json"), "port": free_port(),
        "model": {"name": "tiny-a", "repo_id": REPO, "revision": COMMIT},
        "cache_dir": str(tmp_path), "venv": str(tmp_path / "novenv")})
    assert res["record"] is None and res["deployment"] is None
    assert res["port"]["listeners"] == [] and res["port"]["foreign"] == []
    assert res["snapshot"]["verified"] is False and "is not on this host" in res["snapshot"]["reason"]
    assert res["vllm"]["exists"] is False and res["vllm"]["version"] is None


def test_vllm_service_facts_reports_a_broken_record(tmp_path):
    record = tmp_path / "deployment.json"
    record.write_text("{")
    res = run_module("vllm_service_facts", {"record_path": str(record)})
    assert res["failed"] and "not valid JSON" in res["msg"]
