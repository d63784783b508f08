"""vllm_ready state=idle: the requests in flight read from /metrics (one parser, serving/vllm_metrics.py),
the wait until they stay 0 (table-driven, a fake clock and fake readings), its result and messages,
and the module itself against a local server that speaks /metrics."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_gates
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_ready
from tests.support.modules import run_module

pytestmark = pytest.mark.unit


def metrics(running, waiting, model="tiny-a", other=None):
    """A /metrics text shaped like vLLM 0.32's (HELP/TYPE lines, labels, other families)."""
    text = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="{model}"}} {float(running)}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} {float(waiting)}\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.25\n'
            'python_gc_objects_collected_total{generation="0"} 1234.0\n')
    if other:
        text += (f'vllm:num_requests_running{{engine="0",model_name="{other}"}} 7.0\n'
                 f'vllm:num_requests_waiting{{engine="0",model_name="{other}"}} 2.0\n')
    return text


@pytest.mark.parametrize("text, served, expected", [
    (metrics(3, 1), "tiny-a", {"running": 3, "waiting": 1}),
    (metrics(0, 0), "tiny-a", {"running": 0, "waiting": 0}),
    (metrics(1, 0, other="tiny-b"), "tiny-a", {"running": 1, "waiting": 0}),     # the other model is left out
    (metrics(1, 0, other="tiny-b"), None, {"running": 8, "waiting": 2}),          # no name: every model
    ('vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
     'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n', "m", {"running": 3, "waiting": 0}),  # engines summed
])
def test_in_flight_of(text, served, expected):
    assert vllm_gates.in_flight_of(text, served) == expected


@pytest.mark.parametrize("text, served", [
    ("# not vLLM\nprocess_cpu_seconds_total 1.0\n", None),
    (metrics(1, 0, model="tiny-b"), "tiny-a"),
])
def test_in_flight_of_without_the_gauges_is_final(text, served):
    with pytest.raises(vllm_gates.GateError) as err:
        vllm_gates.in_flight_of(text, served)
    assert err.value.final and "/metrics has no vllm:num_requests_running or vllm:num_requests_waiting" in str(err.value)


@pytest.mark.parametrize("answer, final, message", [
    ((401, {"error": "Unauthorized"}), True, "/metrics answered 401: the server rejected the API key"),
    ((404, "Not Found"), True, "/metrics answered 404 Not Found"),
    ((503, "busy"), False, "/metrics answered 503 busy"),
    ((200, {"a": 1}), True, "/metrics answered JSON, not Prometheus text"),
])
def test_read_in_flight_errors(answer, final, message):
    seen = {}

    def request(url, api_key=None, timeout=None):
        seen.update(url=url, api_key=api_key, timeout=timeout)
        return answer
    with pytest.raises(vllm_gates.GateError) as err:
        vllm_gates.read_in_flight("http://10.0.0.5:8000", "tiny-a", "k", 3.0, request=request)
    assert err.value.final is final and str(err.value).startswith(message)
    assert seen == {"url": "http://10.0.0.5:8000/metrics", "api_key": "k", "timeout": 3.0}


def params(**overrides):
    base = dict(state="idle", host="0.0.0.0", port=8000, scheme="http", served_model_name="tiny-a",
                api_key=None, api_key_file=None, timeout=None, model_path=None, parallel_size=1,
                enforce_eager=False, poll_interval=0.5, request_timeout=10.0, completion=True, api=True,
                prompt="Hello", unit=None, check_port_owner=True, journal_lines=40,
                fail_when_not_ready=True, idle_settle=1.0)
    base.update(overrides)
    return base


class FakeClock:
    def __init__(self):
        self.now = 50.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


REFUSED = vllm_gates.GateError("no answer from http://127.0.0.1:8000/metrics: [Errno 111] Connection refused",
                               refused=True)
SLOW = vllm_gates.GateError("no answer from http://127.0.0.1:8000/metrics: timed out")
FINAL = vllm_gates.GateError("/metrics answered 404 Not Found", final=True)


def c(running, waiting=0):
    return {"running": running, "waiting": waiting}


# Each reading is one poll (0.5 s apart); the last one repeats. settle 1.0 s = three readings of 0.
IDLE_CASES = {
    "idle at once, settled over three readings": (
        [c(0)], {}, True, 1.0, 3, c(0), c(0), None),
    "settle 0 takes the first 0": (
        [c(0)], {"idle_settle": 0.0}, True, 0.0, 1, c(0), c(0), None),
    "two requests end, then it settles": (
        [c(2, 1), c(1), c(0), c(0), c(0)], {}, True, 2.0, 5, c(2, 1), c(0), None),
    "a new request resets the settle time": (
        [c(1), c(0), c(1), c(0), c(0), c(0)], {}, True, 2.5, 6, c(1), c(0), None),
    "a failed reading resets it too, and is retried": (
        [c(0), SLOW, c(0), c(0), c(0)], {}, True, 2.0, 4, c(0), c(0), None),
    "nothing listens: idle, nothing in flight": (
        [REFUSED], {}, True, 0.0, 0, None, None, None),
    "the server goes away during the wait": (
        [c(1), REFUSED], {}, True, 0.5, 1, c(1), c(1), None),
    "busy until the budget ends": (
        [c(4, 2), c(3, 1)], {"timeout": 2.0}, False, 2.0, 5, c(4, 2), c(3, 1),
        "vllm_ready: tiny-a on http://127.0.0.1:8000 still had requests in flight after 2.0 s (budget 2.0 s): "
        "3 running, 1 waiting (4 running, 2 waiting when the wait began). Raise the timeout, or find the "
        "clients that reach the server without the load balancer"),
    "idle seen before the deadline settles past it (by idle_settle at most)": (
        [c(1), c(0)], {"timeout": 0.5}, True, 1.5, 4, c(1), c(0), None),
    "timeout 0 reads once: what is in flight now": (
        [c(2)], {"timeout": 0.0, "fail_when_not_ready": False}, False, 0.0, 1, c(2), c(2), None),
    "no /metrics: final at once": (
        [FINAL], {}, False, 0.0, 0, None, None,
        "vllm_ready: cannot tell whether tiny-a on http://127.0.0.1:8000 is idle: /metrics answered 404 Not Found"),
    "never an answer within the budget": (
        [SLOW], {"timeout": 1.0, "served_model_name": None}, False, 1.0, 0, None, None,
        "vllm_ready: cannot tell whether the server on http://127.0.0.1:8000 is idle: no answer from "
        "http://127.0.0.1:8000/metrics: timed out"),
}


@pytest.mark.parametrize("readings, overrides, ready, elapsed, samples, first, last, message",
                         list(IDLE_CASES.values()), ids=list(IDLE_CASES))
def test_wait_until_idle(readings, overrides, ready, elapsed, samples, first, last, message):
    clock = FakeClock()
    queue = list(readings)
    calls = []

    def read(base, served, api_key, timeout):
        calls.append((base, served, api_key, timeout))
        item = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(item, Exception):
            raise item
        return item

    p = params(**overrides)
    budget = vllm_ready.budget_for(p)
    result, failure = vllm_ready.wait_until_idle(p, budget, clock=clock, sleep=clock.sleep, read=read)
    assert (result["ready"], result["elapsed"], result["samples"]) == (ready, elapsed, samples)
    assert (result["in_flight"], result["in_flight_last"]) == (first, last)
    assert failure == message
    assert result["server_absent"] is (readings[-1] is REFUSED)
    assert result["changed"] is False and result["monotonic"] == clock.now
    assert calls[0] == ("http://127.0.0.1:8000", p["served_model_name"], None, 10.0)   # 0.0.0.0 probed on loopback
    if not ready:
        assert result["stopped_by"] in ("timeout", "final") and result["last_error"]
    else:
        assert "stopped_by" not in result


def test_idle_budget_and_settle_option():
    assert vllm_ready.budget_for(params()) == {"seconds": 300.0, "derived": False, "model_bytes": None}
    assert vllm_ready.budget_for(params(timeout=20.0))["seconds"] == 20.0
    assert vllm_ready.options_problem(params(idle_settle=-1.0)) == "vllm_ready: idle_settle must be >= 0 seconds"
    assert vllm_ready.options_problem(params()) is None


class FakeMetricsServer:
    """/metrics whose gauges follow a list of (running, waiting), one per request, the last repeats."""

    def __init__(self, sequence):
        self.sequence = list(sequence)
        self.hits = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                fake.hits += 1
                counts = fake.sequence.pop(0) if len(fake.sequence) > 1 else fake.sequence[0]
                body = metrics(*counts).encode() if self.path == "/metrics" else b"no"
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_the_module_waits_for_idle_against_a_local_server():
    server = FakeMetricsServer([(2, 1), (1, 0), (0, 0)])
    try:
        out = run_module("vllm_ready", {"state": "idle", "port": server.port, "served_model_name": "tiny-a",
                                        "poll_interval": 0.1, "idle_settle": 0.2, "timeout": 20})
        assert out.get("failed") is not True, out
        assert out["ready"] is True and out["changed"] is False and out["server_absent"] is False
        assert out["in_flight"] == {"running": 2, "waiting": 1} and out["in_flight_last"] == {"running": 0, "waiting": 0}
        assert out["samples"] >= 4 and server.hits == out["samples"]
        # check mode reads the same (it only reads)
        snap = run_module("vllm_ready", {"state": "idle", "port": server.port, "timeout": 0, "idle_settle": 0,
                                         "fail_when_not_ready": False}, check_mode=True)
        assert snap["samples"] == 1 and snap["in_flight"] == {"running": 0, "waiting": 0}
    finally:
        server.close()


def test_the_module_says_when_requests_stay_in_flight():
    server = FakeMetricsServer([(1, 0)])
    try:
        out = run_module("vllm_ready", {"state": "idle", "port": server.port, "served_model_name": "tiny-a",
                                        "poll_interval": 0.1, "timeout": 0.5})
        assert out["failed"] is True and out["ready"] is False and out["stopped_by"] == "timeout"
        assert out["msg"].startswith("vllm_ready: tiny-a on http://127.0.0.1:%d still had requests in flight" % server.port)
    finally:
        server.close()
