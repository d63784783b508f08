"""vllm_probe: the readiness gates against a small vLLM-like HTTP server on loopback, budgets,
unit states, port owners from /proc, journal errors, environment files."""
from __future__ import annotations

import json
import os
import socket
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_gates
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_ready
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit_state

pytestmark = pytest.mark.unit

KEY = "msk-unit-test-key"
DATA = Path(__file__).resolve().parents[3] / "data"   # tests/unit/data


class FakeVllm:
    """Answers like vLLM's OpenAI server; `health_after` /health calls answer 503 first."""

    def __init__(self, served="tiny-a", key=KEY, health_after=0, completion_status=200,
                 models_status=None):
        self.served, self.key = served, key
        self.health_after, self.completion_status = health_after, completion_status
        self.models_status = models_status
        self.calls = []
        self.bodies = []


def handler_for(fake):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status, payload):
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _authorized(self):
            return not fake.key or self.headers.get("Authorization") == "Bearer " + fake.key

        def do_GET(self):
            fake.calls.append(("GET", self.path, self.headers.get("Authorization")))
            if self.path == "/health":
                ok = sum(1 for c in fake.calls if c[1] == "/health") > fake.health_after
                self._send(200 if ok else 503, {} if ok else {"error": "engine starting"})
            elif self.path == "/v1/models":
                if not self._authorized():
                    self._send(401, {"error": "Unauthorized"})
                elif fake.models_status:
                    self._send(fake.models_status, {"error": "boom"})
                else:
                    self._send(200, {"object": "list", "data": [{"id": fake.served, "object": "model"}]})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            fake.calls.append(("POST", self.path, self.headers.get("Authorization")))
            fake.bodies.append(body)
            if not self._authorized():
                self._send(401, {"error": "Unauthorized"})
            elif fake.completion_status != 200:
                self._send(fake.completion_status, {"error": {"message": "bad request"}})
            else:
                self._send(200, {"choices": [{"text": " the", "index": 0}],
                                 "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
    return Handler


@contextmanager
def serve(fake):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(fake))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_gates_pass_in_order_with_the_key():
    fake = FakeVllm(health_after=2)
    with serve(fake) as port:
        out = vllm_gates.wait_ready(host="127.0.0.1", port=port, served_name="tiny-a", api_key=KEY,
                                    budget=10, poll=0.05, request_timeout=2)
    assert out["ready"] is True, out
    assert list(out["gates"]) == ["port", "health", "models", "completion"]
    assert all(v >= 0 for v in out["gates"].values())
    assert out["models"] == ["tiny-a"]
    assert out["completion"]["usage"]["completion_tokens"] == 1
    # /health answered 503 twice before 200; the /v1 routes carried the key
    assert [c[1] for c in fake.calls].count("/health") == 3
    assert all(c[2] == "Bearer " + KEY for c in fake.calls if c[1].startswith("/v1"))
    assert fake.bodies == [{"model": "tiny-a", "prompt": "Hello", "max_tokens": 1, "temperature": 0}]


def test_port_gate_times_out_with_the_last_error():
    port = free_port()
    out = vllm_gates.wait_ready(host="127.0.0.1", port=port, served_name="x", budget=0.3, poll=0.05,
                                request_timeout=0.5)
    assert out["ready"] is False
    assert out["failed_gate"] == "port" and out["stopped_by"] == "timeout"
    assert "does not accept connections" in out["last_error"]
    assert out["gates"] == {}


def test_health_that_stays_503_fails_at_the_health_gate():
    fake = FakeVllm(health_after=10 ** 6)
    with serve(fake) as port:
        out = vllm_gates.wait_ready(host="127.0.0.1", port=port, served_name="tiny-a", api_key=KEY,
                                    budget=0.4, poll=0.05)
    assert out["failed_gate"] == "health" and out["stopped_by"] == "timeout"
    assert "503" in out["last_error"]
    assert list(out["gates"]) == ["port"]


def test_without_the_api_gates_a_server_of_unknown_key_is_ready_at_health():
    fake = FakeVllm()
    with serve(fake) as port:
        out = vllm_gates.wait_ready(host="127.0.0.1", port=port, api_key="not-its-key", budget=30, poll=0.05,
                                    api=False)
    assert out["ready"] is True and list(out["gates"]) == ["port", "health"]


def test_wrong_api_key_stops_at_once():
    fake = FakeVllm()
    with serve(fake) as port:
        out = vllm_gates.wait_ready(host="127.0.0.1", port=port, served_name="tiny-a", api_key="wrong",
                                    budget=30, poll=0.05)
    assert out["ready"] is False and out["stopped_by"] == "final"
    assert out["failed_gate"] == "models"
    assert "rejected the API key" in out["last_error"]
    assert out["elapsed"] < 5


def test_another_model_on_the_port_stops_at_once():
    fake = FakeVllm(served="tiny-b")
    with serve(fake) as port:
        out = vllm_gates.wait_ready(host="127.0.0.1", port=port, served_name="tiny-a", api_key=KEY,
                                    budget=30, poll=0.05)
    assert out["failed_gate"] == "models" and out["stopped_by"] == "final"
    assert "['tiny-b'], not 'tiny-a'" in out["last_error"]


def test_models_5xx_is_retried_until_the_budget():
    fake = FakeVllm(models_status=500)
    with serve(fake) as port:
        # a budget of many polls: on a loaded machine the health gate alone can take 0.2 s
        out = vllm_gates.wait_ready(host="127.0.0.1", port=port, served_name="tiny-a", api_key=KEY,
                                    budget=1.5, poll=0.05)
    assert out["failed_gate"] == "models" and out["stopped_by"] == "timeout"
    assert sum(1 for c in fake.calls if c[1] == "/v1/models") >= 2


def test_completion_4xx_is_final_and_can_be_skipped():
    fake = FakeVllm(completion_status=400)
    with serve(fake) as port:
        out = vllm_gates.wait_ready(host="127.0.0.1", port=port, served_name="tiny-a", api_key=KEY,
                                    budget=30, poll=0.05)
        assert out["failed_gate"] == "completion" and out["stopped_by"] == "final"
        skipped = vllm_gates.wait_ready(host="127.0.0.1", port=port, served_name="tiny-a", api_key=KEY,
                                        budget=5, poll=0.05, completion=False)
    assert skipped["ready"] is True and "completion" not in skipped["gates"]


def test_without_a_served_name_the_first_listed_model_completes():
    fake = FakeVllm(served="whatever")
    with serve(fake) as port:
        out = vllm_gates.wait_ready(host="127.0.0.1", port=port, api_key=KEY, budget=5, poll=0.05)
    assert out["ready"] and fake.bodies[0]["model"] == "whatever"


def test_check_callback_ends_the_wait():
    calls = []

    def check():
        calls.append(1)
        return "vllm.service failed during start-up" if len(calls) >= 3 else None
    out = vllm_gates.wait_ready(host="127.0.0.1", port=free_port(), budget=30, poll=0.01, check=check)
    assert out["stopped_by"] == "check" and out["failed_gate"] == "port"
    assert out["last_error"] == "vllm.service failed during start-up"


@pytest.mark.parametrize("show, before, expected", [
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "0"}, 0, None),
    ({"LoadState": "loaded", "ActiveState": "activating", "SubState": "start", "NRestarts": "0"}, 0, None),
    ({"Id": "vllm.service", "LoadState": "loaded", "ActiveState": "failed", "SubState": "failed",
      "ExecMainStatus": "1", "ExecMainCode": "1", "Result": "exit-code"}, 0,
     "vllm.service failed during start-up (main process exit status 1, exit-code)"),
    ({"Id": "vllm.service", "LoadState": "loaded", "ActiveState": "activating",
      "SubState": "auto-restart", "ExecMainStatus": "1", "ExecMainCode": "1", "Result": "exit-code",
      "NRestarts": "0"}, 0,
     "vllm.service exited during start-up (main process exit status 1, exit-code) and systemd is restarting it"),
    ({"Id": "u", "LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "2"}, 1,
     "u exited during start-up and systemd is restarting it"),
    ({"Id": "u", "LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead",
      "ExecMainStatus": "0", "ExecMainCode": "0"}, 0, "u stopped during start-up"),
    ({"Id": "u", "LoadState": "not-found"}, 0, "u is not loaded (LoadState=not-found)"),
])
def test_unit_problem(show, before, expected):
    assert vllm_unit_state.unit_problem(show, before) == expected


TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0B07D50A:1FA4 00000000:0000 0A 00000000:00000000 00:00000000 00000000   999        0 41234 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 41235 1 0000000000000000 100 0 0 10 0
   2: 0B07D50A:1FA4 0107D50A:C350 01 00000000:00000000 00:00000000 00000000   999        0 41299 1 0000000000000000 20 4 30 10 -1
"""
TCP6_ROWS = [
    ("00000000000000000000000000000000:1FA4", 999, 51234),
    ("00000000000000000000000001000000:0016", 0, 51235),
]
TCP6 = "  sl  local_address remote_address st tx_queue rx_queue tr tm->when retrnsmt uid timeout inode\n" + "".join(
    "   %d: %s %s:0000 0A 00000000:00000000 00:00000000 00000000 %5d 0 %d 1 0000000000000000 100 0 0 10 0\n"
    % (i, local, "0" * 32, uid, inode) for i, (local, uid, inode) in enumerate(TCP6_ROWS))


def test_parse_proc_net_tcp_lists_listeners_only():
    assert vllm_unit_state.parse_proc_net_tcp(TCP) == [
        {"address": "10.213.7.11", "port": 8100, "uid": 999, "inode": 41234},
        {"address": "127.0.0.1", "port": 8080, "uid": 0, "inode": 41235}]
    assert vllm_unit_state.parse_proc_net_tcp(TCP6, ipv6=True) == [
        {"address": "::", "port": 8100, "uid": 999, "inode": 51234},
        {"address": "::1", "port": 22, "uid": 0, "inode": 51235}]


@pytest.mark.parametrize("text, unit", [
    ("0::/system.slice/vllm.service\n", "vllm.service"),
    ("12:memory:/system.slice/vllm.service\n1:name=systemd:/system.slice/vllm.service\n0::/system.slice/vllm.service\n",
     "vllm.service"),
    # inside an nspawn container seen from its host, and a unit's sub-cgroup
    ("0::/machine.slice/msl-gpu1/system.slice/vllm.service/payload\n", "vllm.service"),
    ("0::/user.slice/user-0.slice/session-3.scope\n", "session-3.scope"),
    ("0::/\n", None),
    ("", None),
])
def test_unit_of_cgroup(text, unit):
    assert vllm_unit_state.unit_of_cgroup(text) == unit


def fake_proc(tmp_path, procs, tcp=TCP, tcp6=""):
    """A /proc tree: net/tcp*, and per pid status, cmdline, cgroup and fd links to sockets."""
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text(tcp)
    (proc / "net" / "tcp6").write_text(tcp6)
    for pid, (uid, cmd, cgroup, inodes) in procs.items():
        d = proc / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "status").write_text("Name:\t%s\nUid:\t%d\t%d\t%d\t%d\n" % (cmd.split()[0].rsplit("/", 1)[-1], uid, uid, uid, uid))
        (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0")
        (d / "cgroup").write_text(cgroup)
        for n, inode in enumerate(inodes):
            os.symlink("socket:[%d]" % inode, d / "fd" / str(n + 3))
    return str(proc)


def test_port_listeners_and_foreign_ones(tmp_path):
    proc = fake_proc(tmp_path, {
        812: (os.getuid(), "/opt/venv/bin/python3 /opt/venv/bin/vllm serve /m", "0::/system.slice/vllm.service\n", [41234]),
        900: (os.getuid(), "python3 -m http.server 8100", "0::/user.slice/session-1.scope\n", [41234]),
        950: (os.getuid(), "sleep 1", "0::/system.slice/vllm.service\n", []),
    })
    listeners = vllm_unit_state.port_listeners(8100, proc)
    assert [(e["pid"], e["unit"], e["address"]) for e in listeners] == [
        (812, "vllm.service", "10.213.7.11"), (900, "session-1.scope", "10.213.7.11")]
    foreign = vllm_unit_state.foreign_listeners(listeners, "vllm.service")
    assert [e["pid"] for e in foreign] == [900]
    assert vllm_unit_state.describe_listener(foreign[0]).startswith("pid 900, user ")
    assert "unit session-1.scope: python3 -m http.server 8100" in vllm_unit_state.describe_listener(foreign[0])
    assert vllm_unit_state.foreign_listeners(listeners, None) == listeners
    # a unit the slot replaces (set up by hand) is not foreign
    assert vllm_unit_state.foreign_listeners(listeners, "vllm.service", ["session-1.scope"]) == []
    assert vllm_unit_state.port_listeners(9999, proc) == []
    assert [p["pid"] for p in vllm_unit_state.unit_processes("vllm.service", proc)] == [812, 950]


def test_a_socket_whose_owner_is_unseen_is_still_listed(tmp_path):
    proc = fake_proc(tmp_path, {})
    listeners = vllm_unit_state.port_listeners(8080, proc)
    assert listeners == [{"pid": None, "user": "root", "name": None, "cmdline": None, "unit": None,
                          "address": "127.0.0.1"}]
    assert vllm_unit_state.describe_listener(listeners[0]) == "an unseen process, user root"


def test_port_listeners_on_the_real_proc_finds_this_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        found = vllm_unit_state.port_listeners(port)
    assert [e["pid"] for e in found] == [os.getpid()]
    assert found[0]["address"] == "127.0.0.1"
    assert vllm_unit_state.port_listeners(port) == []


def test_journal_errors_of_a_real_failed_start():
    lines = (DATA / "vllm_tiny_broken_journal.txt").read_text().splitlines()
    assert vllm_unit_state.journal_errors(lines) == [
        "WorkerProc failed to start.",
        "RuntimeError: start (0) + length (256) exceeds dimension size (128).",
        "EngineCore failed to start.",
        "Exception: WorkerProc initialization failed due to an exception in a background process. "
        "See stack trace for root cause.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        "vllm.service: Main process exited, code=exited, status=1/FAILURE",
        "vllm.service: Failed with result 'exit-code'.",
    ]
    assert vllm_unit_state.journal_errors(lines, limit=2) == [
        "vllm.service: Main process exited, code=exited, status=1/FAILURE",
        "vllm.service: Failed with result 'exit-code'."]
    # a warning that mentions "error" is not an error
    assert not any("ulimit" in x for x in vllm_unit_state.journal_errors(lines, limit=0))
    assert vllm_unit_state.journal_errors([]) == []


@pytest.mark.parametrize("text, value", [
    ('VLLM_API_KEY="abc"\n', "abc"),
    ("# c\nVLLM_API_KEY=plain\n", "plain"),
    ("VLLM_API_KEY='single'\n", "single"),
    ('VLLM_API_KEY="a\\"b\\\\c"\n', 'a"b\\c'),
    ('VLLM_API_KEY="first"\nVLLM_API_KEY="second"\n', "second"),
    ("OTHER=1\n", None),
    ("", None),
])
def test_env_file_value(text, value):
    assert vllm_ready.env_file_value(text, "VLLM_API_KEY") == value


@pytest.mark.parametrize("size_gib, parallel, eager, seconds", [
    (0, 1, True, 180),           # the lab's tiny models
    (0, 1, False, 360),
    (14, 1, False, 416),         # a 7B model in bf16
    (145, 4, False, 1030),       # 72B TP=4 (~17 min seen)
    (547, 8, False, 2758),       # Kimi-K2.5 INT4, TP=8
])
def test_startup_budget(size_gib, parallel, eager, seconds):
    assert vllm_ready.startup_budget(size_gib * (1 << 30), parallel, eager) == seconds


def test_tree_size_follows_links_and_counts_blobs_once(tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "a").write_bytes(b"x" * 100)
    snap = tmp_path / "snap"
    snap.mkdir()
    os.symlink(blobs / "a", snap / "model.safetensors")
    os.symlink(blobs / "a", snap / "copy.safetensors")
    (snap / "config.json").write_text("{}")
    assert vllm_ready.tree_size(str(snap)) == 102
