"""The vllm_ready module, run as Ansible runs it (tests.support.modules), against a vLLM-like server
on loopback, real sockets and files; systemd is not running here, so the unit-related paths are
covered by the lab tests. (vllm_service_info's module tests: test_vllm_service_info.py beside this file.)"""
from __future__ import annotations

import json

import pytest

from tests.support.modules import run_module
from tests.unit.plugins.module_utils.store.test_snapshot_check import make_snapshot
from tests.unit.plugins.module_utils.serving.test_vllm_gates import KEY, FakeVllm, free_port, serve

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
