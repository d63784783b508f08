"""The lb_pool role on the lab, against the lab's HAProxy: real vLLM (CPU) serves tiny-a on gpu1 (the
lab's serve playbook, port 8000, the one vLLM of this module), and the known-timing simulator
(tests/lab/simulator.py) answers as tiny-a on gpu2, so the pool has two servers that serve while
only one vLLM runs on this 2-core machine.

In order (one started vLLM for the whole module):

  pool on both hosts -> check mode drain and rejoin change nothing -> the floor: gpu2 in
  maintenance, the drain of gpu1 is refused and nothing changes -> a drain that gives up (long
  answers through the load balancer keep sessions open on gpu2) puts gpu2 back; with `proceed` it
  goes on -> under a closed-loop load through the frontend, the rollout's order in one play
  (tests/integration/playbooks/lb_pool_swap.yml: drain gpu1, restart its vLLM, vllm_ready's
  gates, rejoin): no request fails, HAProxy chooses gpu1 for none while it is out, traffic comes
  back after -> a rejoin HAProxy does not confirm (gpu2's server stopped) fails with the reason.

vLLM's own gauges are not enough on this lab: with the tiny model, the engine finishes a
200-token answer long before the API server has streamed it, and vllm:num_requests_running read
0 in most samples while two clients streamed back to back. The drain therefore waits for
HAProxy's sessions on the server first (the requests it sent, streams included), then for vLLM's
gauges (clients that reach the host directly).
"""
from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.lab import labctl
from tests.support.lb_load import LoadRun
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.lab, pytest.mark.vllm]

PLAYBOOK = "tests/integration/playbooks/lb_pool.yml"
SERVE = "tests/lab/playbooks/lab_serve.yml"
SWAP = "tests/integration/playbooks/lb_pool_swap.yml"
SIM_UNIT = "modelswap-lbsim.service"
PORT = labctl.LB_SERVER_PORT
BOTH_UP = {"gpu1": "UP", "gpu2": "UP"}
# Short polls: the lab's HAProxy checks every second.
FAST = {"lb_pool_poll_interval": 0.5, "lb_pool_idle_settle": 0.5, "lb_pool_rejoin_timeout": 30}


def start_sim(lab, host: str) -> None:
    """The simulator on the host's vLLM port, answering as tiny-a (a transient unit)."""
    stop_sim(lab, host)                 # one an interrupted run left
    code = base64.b64encode((labctl.REPO / "tests" / "lab" / "simulator.py").read_bytes()).decode()
    lab.ssh(host, f"echo {code} | base64 -d > /root/lbsim.py && systemd-run --quiet --unit={SIM_UNIT} "
                  f"/usr/bin/python3 /root/lbsim.py --host {lab.address(host)} --port {PORT} --model tiny-a "
                  "--ttft-ms 20 --chunk-ms 25 --max-seconds 1800")


def stop_sim(lab, host: str) -> None:
    lab.ssh(host, f"systemctl stop {SIM_UNIT} 2>/dev/null; systemctl reset-failed {SIM_UNIT} 2>/dev/null; true")


def completes(lab, host: str) -> bool:
    """A one-token completion straight to the host's server (the generation gate's question)."""
    req = urllib.request.Request(f"http://{lab.address(host)}:{PORT}/v1/completions",
                                 data=json.dumps({"model": "tiny-a", "prompt": "Hi", "max_tokens": 1}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def pool(lab):
    started = lab.playbook(SERVE, {"lab_serve_hosts": "gpu1", "lab_serve_model": "tiny-a"})
    try:
        assert started.rc == 0, started.stdout[-4000:]
        start_sim(lab, "gpu2")
        wait_for(lambda: lab.lb_servers() == BOTH_UP, 60, 0.5, "HAProxy to see both servers UP")
        yield lab
    finally:
        stop_sim(lab, "gpu2")
        stopped = lab.playbook(SERVE, {"lab_serve_hosts": "gpu1", "lab_serve_state": "stopped"})
        assert stopped.rc == 0, stopped.stdout[-3000:]


def run(lab, action: str, limit: str = "gpu1,gpu2", check: bool = False, **extra):
    return lab.playbook(PLAYBOOK, dict(FAST, lb_test_action=action, **extra), limit=limit, check=check)


def result(run_result, host: str, task: str = "Report the lb_pool result") -> dict:
    found = [r for r in run_result.task_results(task, host) if r["_event"] == "runner_on_ok"]
    assert found, run_result.stdout[-4000:]
    return found[-1]["lb_pool_result"]


def the_failure(run_result, host: str) -> str:
    """The message of the host's last failed task (without the task's name)."""
    messages = run_result.failures().get(host)
    assert messages, run_result.stdout[-4000:]
    return messages[-1].split(": ", 1)[1]


def test_pool_reads_every_server_and_its_state(pool):
    out = run(pool, "pool")
    assert out.rc == 0, out.stdout[-4000:]
    for host in ("gpu1", "gpu2"):
        res = result(out, host)
        assert res["type"] == "haproxy" and res["pool"] == "vllm" and res["server"] == host
        assert [(s["name"], s["status"], s["serving"]) for s in res["servers"]] == [
            ("gpu1", "UP", True), ("gpu2", "UP", True)]
        assert res["serving"] == 2 and res["floor_ok"] is True and res["changed"] is False
        assert res["message"] == "pool vllm: gpu1 UP, gpu2 UP (2 of 2 serving)"
    assert out.changed("gpu1") == out.changed("gpu2") == 0


def test_check_mode_says_what_drain_and_rejoin_would_do_and_changes_nothing(pool):
    before = {h: row["lastchg"] for h, row in pool.lb_rows().items()}
    drain = run(pool, "drain", "gpu1", check=True)
    assert drain.rc == 0, drain.stdout[-4000:]
    res = result(drain, "gpu1")
    assert res["check_mode"] is True and res["changed"] is False and res["out_since"] is None
    assert res["message"] == ("would take gpu1 out of pool vllm (UP now; 2 of 2 serving, 1 would stay, floor 1) "
                              "and wait up to 300 s for its requests in flight (0 on the load balancer, 0 running, "
                              "0 waiting now)")
    assert res["in_flight_at_start"] == {"running": 0, "waiting": 0}      # read from the real vLLM's /metrics
    rejoin = run(pool, "rejoin", "gpu1", check=True)
    assert rejoin.rc == 0, rejoin.stdout[-4000:]
    assert result(rejoin, "gpu1")["message"] == ("would put gpu1 back into pool vllm (UP now) and wait up to 30 s "
                                                 "until the load balancer says it serves")
    assert drain.changed("gpu1") == rejoin.changed("gpu1") == 0
    assert pool.lb_servers() == BOTH_UP
    # no state change since: lastchg only grows
    assert all(int(row["lastchg"]) >= int(before[h]) for h, row in pool.lb_rows().items())


def test_the_floor_refuses_a_drain_and_nothing_changes(pool):
    pool.lb_command("disable server vllm/gpu2")
    try:
        wait_for(lambda: pool.lb_servers() == {"gpu1": "UP", "gpu2": "MAINT"}, 10, 0.2, "gpu2 in maintenance")
        refused = run(pool, "drain", "gpu1")
        assert refused.rc != 0
        assert ("lb_pool: refusing to take gpu1 out of pool vllm: 1 of 2 servers serve now (gpu1 UP, gpu2 MAINT) "
                "and 0 would stay serving, fewer than the floor of 1 (lb_pool_min_serving, modelswap_min_serving). "
                "Nothing was changed.") in the_failure(refused, "gpu1")
        assert refused.changed("gpu1") == 0
        assert pool.lb_servers() == {"gpu1": "UP", "gpu2": "MAINT"}
        assert completes(pool, "gpu1")                    # and vLLM was left alone
        # the same refusal in check mode: the preview says what the run would say
        preview = run(pool, "drain", "gpu1", check=True)
        assert preview.rc != 0 and "refusing to take gpu1 out" in the_failure(preview, "gpu1")
    finally:
        pool.lb_command("set server vllm/gpu2 state ready")
        wait_for(lambda: pool.lb_servers() == BOTH_UP, 20, 0.5, "gpu2 back UP")


def test_a_drain_that_gives_up_puts_the_host_back_or_proceeds(pool):
    # long answers through the load balancer keep sessions open on gpu2 (the simulator streams
    # 1000 tokens in 25 s; vLLM refuses them at once: more than its 512-token context), and every
    # worker ends up there, longer than the drain waits
    long = LoadRun(pool.lb_url, pool.api_key, workers=4, max_requests=40, max_seconds=120, model="tiny-a",
                   max_tokens=1000)
    with long:
        wait_for(lambda: int(pool.lb_rows()["gpu2"]["scur"] or 0) >= 2, 30, 0.1, "long requests on gpu2")
        failed = run(pool, "drain", "gpu2", lb_pool_drain_timeout=2)
        assert failed.rc != 0
        message = the_failure(failed, "gpu2")
        assert message.startswith("lb_pool: HAProxy still held ") and message.endswith(
            " session(s) on gpu2 (requests in flight) after 2 s (lb_pool_drain_timeout). gpu2 was put back into "
            "pool vllm (its old server still serves); nothing else changed."), message
        assert pool.lb_servers()["gpu2"].startswith("UP")       # serving again ("UP 1/2" until its next check)

        wait_for(lambda: int(pool.lb_rows()["gpu2"]["scur"] or 0) > 0, 30, 0.1, "a long request on gpu2 again")
        proceeded = run(pool, "drain", "gpu2", lb_pool_drain_timeout=2, lb_pool_drain_timeout_action="proceed")
        assert proceeded.rc == 0, proceeded.stdout[-4000:]
        res = result(proceeded, "gpu2")
        assert res["idle"] is False and res["status_after"] == "MAINT" and res["sessions_left"] > 0
        assert "request(s) still in flight on the load balancer after" in res["message"]
    back = run(pool, "rejoin", "gpu2")
    assert back.rc == 0, back.stdout[-4000:]
    assert pool.lb_servers() == BOTH_UP


class PoolWatch(threading.Thread):
    """Samples HAProxy's view of one server every 0.25 s (status, how often it was chosen) until
    stopped; bounded by `max_seconds`."""

    def __init__(self, lab, host, max_seconds=600):
        super().__init__(daemon=True)
        self.lab, self.host, self.deadline = lab, host, time.monotonic() + max_seconds
        self.samples = []
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set() and time.monotonic() < self.deadline:
            row = self.lab.lb_rows()[self.host]
            self.samples.append((time.time(), row["status"], int(row["lbtot"] or 0)))
            self.done.wait(0.25)

    def stop(self):
        self.done.set()
        self.join(5)


@pytest.mark.campaign
def test_drain_swap_rejoin_under_load_fails_no_request(pool, record_property):
    """The rollout's order in one play (playbooks/lb_pool_swap.yml): drain, restart vLLM, gates,
    rejoin, while a closed-loop load runs through the frontend."""
    watch = PoolWatch(pool, "gpu1")
    load = LoadRun(pool.lb_url, pool.api_key, workers=3, max_requests=5000, max_seconds=420, model="tiny-a",
                   max_tokens=16)
    watch.start()
    with load:
        wait_for(lambda: len(load.records) >= 6, 30, 0.2, "the load's first requests")
        swapped = pool.playbook(SWAP, dict(FAST, lb_test_hosts="gpu1"))
        assert swapped.rc == 0, swapped.stdout[-4000:]
        wait_for(lambda: any(s[1] == "UP" for s in watch.samples[-3:]) and watch.samples[-1][2] >=
                 max((s[2] for s in watch.samples if s[1] == "MAINT"), default=0) + 5, 60, 0.5, "requests on gpu1 again")
    watch.stop()
    drain = result(swapped, "gpu1", "Report the drain")
    rejoin = result(swapped, "gpu1", "Report the rejoin")
    assert (drain["status_before"], drain["status_after"], drain["changed"], drain["idle"]) == (
        "UP", "MAINT", True, True)
    assert drain["serving_after"] == 1 and drain["sessions_left"] == 0 and drain["drain_seconds"] >= 0
    assert (rejoin["status_before"], rejoin["status_after"], rejoin["changed"]) == ("MAINT", "UP", True)
    assert rejoin["serving"] == 2 and rejoin["seconds_out"] > drain["drain_seconds"]
    # while gpu1 was in maintenance, HAProxy chose it for no request
    out = [s for s in watch.samples if s[1] == "MAINT"]
    assert out and out[0][2] == out[-1][2], out
    assert out[-1][0] - out[0][0] > 10                # the restart took that long at least
    summary = load.summary()
    for key, value in (("drain", drain["message"]), ("rejoin", rejoin["message"]),
                       ("load", json.dumps({k: summary[k] for k in ("total", "failed", "models", "seconds")}))):
        record_property(key, value)
        print(f"{key}: {value}")
    assert summary["failed"] == 0, summary["failures"]
    assert summary["total"] >= 30 and summary["models"] == {"tiny-a": summary["total"]}


def test_a_rejoin_the_load_balancer_does_not_confirm_fails_with_the_reason(pool):
    drained = run(pool, "drain", "gpu2")
    assert drained.rc == 0, drained.stdout[-4000:]
    stop_sim(pool, "gpu2")
    try:
        failed = run(pool, "rejoin", "gpu2", lb_pool_rejoin_timeout=3)
        assert failed.rc != 0
        assert the_failure(failed, "gpu2").startswith(
            "lb_pool: gpu2 was put back into pool vllm but the load balancer did not say it serves within 3 s (now ")
    finally:
        start_sim(pool, "gpu2")
        wait_for(lambda: pool.lb_servers() == BOTH_UP, 30, 0.5, "gpu2 UP again")
