"""vllm_service takes over a vLLM server set up by hand (vllm_service_replaces), on the lab.

The example fleet served with its own units before modelswap. Each lab host gets such a unit,
vllm-handmade.service: vLLM serving tiny-a on the slot's port, with an API key modelswap does
not know. Then, on both hosts at once (two vLLM starts at a time):

  without vllm_service_replaces the deploy is refused before anything changes (the port is held
  by another process, and the message says how to take it over) -> the preview names the unit
  it would stop and disable -> gpu1 takes over with tiny-b (the hand-made unit is stopped and
  disabled, the slot serves) while gpu2 tries tiny-broken (it fails, the slot has no earlier
  configuration, so the hand-made unit is enabled and started again and serves tiny-a).
"""
from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration import vllm_lab as V

pytestmark = [pytest.mark.lab, pytest.mark.vllm]

HOSTS = ["gpu1", "gpu2"]
HAND = "vllm-handmade.service"
HAND_KEY = "hand-" + secrets.token_hex(12)


def hand_unit(lab) -> str:
    model = lab.models["tiny-a"]
    snapshot = "/var/lib/modelswap/hf/hub/models--%s/snapshots/%s" % (
        model["repo_id"].replace("/", "--"), model["commit"])
    args = "--dtype float32 --max-model-len 512 --enforce-eager"    # the lab's CPU settings
    return (
        "[Unit]\nDescription=vLLM set up by hand before modelswap (test)\n\n[Service]\n"
        "Environment=HOME=/root VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1\n"
        f"ExecStart={V.VENV}/bin/vllm serve {snapshot} --served-model-name handmade-a "
        f"--host 0.0.0.0 --port {V.PORT} {args} --api-key {HAND_KEY}\n"
        "Restart=no\n\n[Install]\nWantedBy=multi-user.target\n")


def unit_state(lab, host: str, unit: str = HAND) -> tuple[str, str]:
    out = lab.ssh(host, f"systemctl is-active {unit}; systemctl is-enabled {unit}", check=False).stdout.split()
    return out[0], out[1] if len(out) > 1 else ""


def hand_serves(lab, host: str) -> bool:
    try:
        return V.served_names(lab, host, HAND_KEY) == ["handmade-a"]
    except (AssertionError, OSError):
        return False


def last_failure(result, host: str) -> tuple[str, str]:
    found = None
    for ev in result.events:
        data = ev.get("event_data", {})
        if ev.get("event") == "runner_on_failed" and data.get("host") == host and not data.get("ignore_errors"):
            found = data["task"], data["res"].get("msg", "")
    assert found, result.stdout[-4000:]
    return found


@pytest.fixture(scope="module")
def story(lab):
    key = V.new_api_key()
    for host in HOSTS:
        V.reset_host(lab, host)
    V.prepare(lab, HOSTS, key)
    unit = hand_unit(lab)
    for host in HOSTS:
        lab.ssh(host, f"cat > /etc/systemd/system/{HAND} <<'EOF'\n{unit}EOF\n"
                      f"systemctl daemon-reload && systemctl enable --now {HAND}")
    for host in HOSTS:
        assert V.wait_for(lambda h=host: hand_serves(lab, h), 240, 2), lab.ssh(
            host, f"journalctl -u {HAND} -n 30 --no-pager", check=False).stdout

    def run(model, limit, check=False, **extra):
        return lab.playbook(V.DEPLOY, V.role_vars(lab, key, modelswap_serve=model, **extra),
                            limit=limit, check=check, diff=check)

    state = {"key": key, "run": run}
    yield state
    for host in HOSTS:
        lab.ssh(host, f"systemctl disable --now {HAND}; rm -f /etc/systemd/system/{HAND}; "
                      "systemctl daemon-reload", check=False)
        V.reset_host(lab, host)


def test_a_hand_made_server_on_the_port_is_refused_until_named(lab, story):
    refused = story["run"]("tiny-b", "gpu1")
    assert refused.rc != 0
    task, msg = last_failure(refused, "gpu1")
    assert task == "Check that the host can take the deployment", (task, msg)     # validate.yml, before any change
    assert f"unit {HAND}" in msg and "vllm_service_replaces" in msg
    assert unit_state(lab, "gpu1") == ("active", "enabled") and hand_serves(lab, "gpu1")
    assert unit_state(lab, "gpu1", V.UNIT)[0] != "active"

    preview = story["run"]("tiny-b", "gpu1", check=True, vllm_service_replaces=[HAND])
    assert preview.rc == 0, preview.stdout[-4000:]
    said = [r["msg"] for r in preview.task_results("Say what is stopped and started", "gpu1")
            if r.get("msg")]
    assert said and f"would stop and disable {HAND} (set up outside modelswap, serving /var/lib/modelswap/hf/hub/models--lab--tiny-a" in said[0]
    assert unit_state(lab, "gpu1") == ("active", "enabled") and hand_serves(lab, "gpu1")


@pytest.fixture(scope="module")
def takeovers(lab, story):
    with ThreadPoolExecutor(max_workers=2) as pool:
        good = pool.submit(story["run"], "tiny-b", "gpu1", vllm_service_replaces=[HAND])
        broken = pool.submit(story["run"], "tiny-broken", "gpu2", vllm_service_replaces=[HAND])
        return {"good": good.result(), "broken": broken.result()}


@pytest.mark.campaign
def test_the_slot_takes_over_and_the_hand_made_unit_stays_off(lab, story, takeovers):
    run = takeovers["good"]
    assert run.rc == 0, run.stdout[-4000:]
    assert unit_state(lab, "gpu1") == ("inactive", "disabled")
    assert V.served_names(lab, "gpu1", story["key"]) == ["tiny-b"]
    outcome = [r for r in run.task_results("Report the outcome", "gpu1") if r["_event"] == "runner_on_ok"]
    assert outcome[0]["ansible_facts"]["vllm_service_result"]["replaced_units"] == [HAND]
    # a rerun finds the hand-made unit off and changes nothing
    again = story["run"]("tiny-b", "gpu1", vllm_service_replaces=[HAND])
    assert again.rc == 0 and again.changed("gpu1") == 0, again.stdout[-4000:]


@pytest.mark.campaign
def test_a_failed_first_start_brings_the_hand_made_unit_back(lab, story, takeovers):
    run = takeovers["broken"]
    assert run.rc != 0
    task, msg = last_failure(run, "gpu2")
    assert task == "Fail the host - the swap failed and the replaced units serve again", (task, msg)
    assert f"Rolled back: {HAND} (set up outside modelswap) enabled and started again" in msg
    assert unit_state(lab, "gpu2") == ("active", "enabled")
    assert V.wait_for(lambda: hand_serves(lab, "gpu2"), 30, 1)
    slot = unit_state(lab, "gpu2", V.UNIT)
    assert slot[0] != "active" and slot[1] == "disabled", slot
