"""The lb_pool role with lb_pool_type hooks, through the worked nginx example the role's README shows
(roles/lb_pool/examples/nginx/): the hooks edit a real upstream file, `nginx -t` and the reload are
replaced by `true` (no nginx here), and a local server stands in for vLLM's /health and /metrics.
Runs on the controller only (two inventory hosts with a local connection): no lab needed.

Proves the hook contract end to end: the state hook's mapping is read; drain marks the server
down and waits on vLLM's counters; the floor refuses a drain with nothing changed; check mode
changes nothing; rejoin removes the mark and confirms it with the state hook.
"""
from __future__ import annotations

import hashlib
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils.runner import run_playbook
from tests.support.modules import REPO

pytestmark = pytest.mark.unit

PLAYBOOK = str(REPO / "tests" / "integration" / "playbooks" / "lb_pool.yml")
EXAMPLE = REPO / "roles" / "lb_pool" / "examples" / "nginx"
UPSTREAM = """upstream vllm {
    server 127.0.0.1:8000;        # gpu1
    server 127.0.0.1:8001;        # gpu2
}
"""


class FakeVllm:
    """/health 200 and /metrics with nothing in flight, on a free loopback port."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = (b'vllm:num_requests_running{model_name="tiny-a"} 0.0\n'
                        b'vllm:num_requests_waiting{model_name="tiny-a"} 0.0\n') if self.path == "/metrics" else b"{}"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lb_hooks")
    vllm = FakeVllm()
    upstream = tmp / "vllm-upstream.conf"
    inventory = tmp / "hosts.yml"
    inventory.write_text(
        "all:\n  children:\n    gpu_hosts:\n      vars:\n        ansible_connection: local\n"
        f"        ansible_python_interpreter: {sys.executable}\n        ansible_host: 127.0.0.1\n"
        "      hosts:\n        gpu1:\n        gpu2:\n")
    base = {
        "lb_pool_type": "hooks", "lb_pool_name": "vllm",
        "lb_pool_state_tasks": str(EXAMPLE / "state.yml"), "lb_pool_drain_tasks": str(EXAMPLE / "drain.yml"),
        "lb_pool_rejoin_tasks": str(EXAMPLE / "rejoin.yml"),
        "nginx_upstream_file": str(upstream), "nginx_test_command": ["true"], "nginx_reload_command": ["true"],
        "lb_pool_vllm_host": "127.0.0.1", "lb_pool_vllm_port": vllm.port, "lb_pool_poll_interval": 0.2,
        "lb_pool_idle_settle": 0.2, "lb_pool_rejoin_timeout": 5,
        "ansible_python_interpreter": sys.executable,
    }
    yield {"upstream": upstream, "inventory": str(inventory), "vars": base}
    vllm.close()


def run(setup, action, check=False, limit=None, **extra):
    extra_vars = dict(setup["vars"], lb_test_action=action, **extra)
    return run_playbook(PLAYBOOK, setup["inventory"], extra_vars, check=check, limit=limit, timeout=300)


def result(run_result, host):
    [res] = [r for r in run_result.task_results("Report the lb_pool result", host) if r["_event"] == "runner_on_ok"]
    return res["lb_pool_result"]


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_hooks_pool_drain_floor_check_mode_and_rejoin(setup):
    upstream = setup["upstream"]
    upstream.write_text(UPSTREAM)

    pool = run(setup, "pool")
    assert pool.rc == 0, pool.stdout[-3000:]
    assert result(pool, "gpu1")["message"] == "pool vllm: gpu1 serving, gpu2 serving (2 of 2 serving)"

    # check mode: the drain says what it would do and the upstream file is untouched
    before = digest(upstream)
    preview = run(setup, "drain", check=True, limit="gpu1")
    assert preview.rc == 0, preview.stdout[-3000:]
    assert result(preview, "gpu1")["message"].startswith(
        "would take gpu1 out of pool vllm (serving now; 2 of 2 serving, 1 would stay, floor 1)")
    assert digest(upstream) == before

    drained = run(setup, "drain", limit="gpu1")
    assert drained.rc == 0, drained.stdout[-3000:]
    out = result(drained, "gpu1")
    assert out["changed"] is True and out["idle"] is True
    assert out["in_flight_at_start"] == {"running": 0, "waiting": 0}
    assert "    server 127.0.0.1:8000 down;        # gpu1\n" in upstream.read_text()

    # the floor: gpu2 is the last one serving; its drain is refused and nothing changes
    before = digest(upstream)
    refused = run(setup, "drain", limit="gpu2")
    assert refused.rc != 0
    [message] = refused.failures()["gpu2"]
    assert "lb_pool: refusing to take gpu2 out of pool vllm: 1 of 2 servers serve now (gpu1 out, gpu2 serving) " \
           "and 0 would stay serving, fewer than the floor of 1" in message
    assert digest(upstream) == before

    rejoined = run(setup, "rejoin", limit="gpu1")
    assert rejoined.rc == 0, rejoined.stdout[-3000:]
    back = result(rejoined, "gpu1")
    assert back["changed"] is True and back["status_after"] == "serving"
    assert upstream.read_text() == UPSTREAM


def test_both_hosts_at_once_is_refused_by_the_floor(setup):
    """Without serial, the whole fleet is one batch: it would all leave together."""
    setup["upstream"].write_text(UPSTREAM)
    refused = run(setup, "drain")
    assert refused.rc != 0
    assert all("(leaving with it: gpu" in m for msgs in refused.failures().values() for m in msgs)
    assert setup["upstream"].read_text() == UPSTREAM
