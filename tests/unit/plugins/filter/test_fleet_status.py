"""The fleet table's judges (issue 27): each host's place in the pool (lb_pool.host_pool, from
HAProxy's stats CSV), what its /v1/models says (served_model.served_reading), and where its
record, service, server and pool disagree (served_model.status_problems), through the filters
fleet_status uses; then playbooks/status.yml itself on two local hosts, against an HTTP server on
loopback that answers /v1/models and the stats CSV, with a stand-in systemctl (the container
has no systemd; the lab test runs it on real hosts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.filter.fleet_status import FilterModule
from tests.support.modules import REPO
from tests.unit.plugins.filter.test_lb_pool import csv_text

pytestmark = pytest.mark.unit

F = FilterModule().filters()
URL = "http://lb:8404/stats;csv"
REFUSED = {"status": -1, "msg": "Status code was -1 and not [200]: Request failed: <urlopen error [Errno 111] "
                                "Connection refused>"}


def pool(status=None, weight=1, check="L7OK", server="gpu2"):
    """gpu2's place in a pool of gpu1 (UP) and gpu2 with ``status`` (None: gpu2 is not listed)."""
    servers = [("gpu1", "UP")] + ([(server, status, 0, weight, check)] if status else [])
    return F["fleet_status_pool"]({"status": 200, "content": csv_text(*servers)}, "haproxy", "vllm", "gpu2", URL)


@pytest.mark.parametrize("status, weight, label, serving, admin", [
    ("UP", 1, "UP", True, "ready"),
    ("UP 1/2", 1, "UP 1/2", True, "ready"),              # a check failed: going down, still served
    ("no check", 1, "no check", True, "ready"),
    ("UP", 0, "UP, weight 0", False, "ready"),           # up but given no requests
    ("MAINT", 1, "MAINT", False, "maint"),
    ("MAINT (via vllm/gpu3)", 1, "MAINT", False, "maint"),
    ("DRAIN", 1, "DRAIN", False, "drain"),
    ("DOWN", 1, "DOWN", False, "ready"),
    ("DOWN 1/2", 1, "DOWN 1/2", False, "ready"),
    ("NOLB", 1, "NOLB", False, "ready"),
])
def test_a_hosts_place_in_haproxys_pool(status, weight, label, serving, admin):
    got = pool(status, weight)
    assert (got["type"], got["found"], got["label"], got["serving"], got["admin"]) == (
        "haproxy", True, label, serving, admin)
    assert got["status"] == status and got["text"].startswith(status)


def test_a_host_the_backend_does_not_list_is_not_in_the_pool():
    got = pool(None)
    assert (got["found"], got["label"], got["serving"]) == (False, "not in the pool", None)
    assert got["text"] == "not in the pool (pool vllm: gpu1 UP)"
    other_name = {"status": 200, "content": csv_text(("gpu-2", "UP"))}
    assert F["fleet_status_pool"](other_name, "haproxy", "vllm", "gpu2", URL)["label"] == "not in the pool"


@pytest.mark.parametrize("stats, backend, text", [
    (REFUSED, "vllm", "unreadable: cannot read http://lb:8404/stats;csv: Status code was -1 and not [200]: Request "
                      "failed: <urlopen error [Errno 111] Connection refused>"),
    ({"status": 401, "msg": ""}, "vllm", "unreadable: cannot read http://lb:8404/stats;csv: HTTP 401"),
    ({"status": 200, "content": "<html>stats</html>"}, "vllm",
     "unreadable: http://lb:8404/stats;csv is not HAProxy's stats CSV (no pxname and status columns): <html>stats</html>"),
    ({"status": 200, "content": csv_text("gpu2")}, "llm",
     "unreadable: backend 'llm' is not in http://lb:8404/stats;csv (backends there: vllm): set lb_pool_haproxy_backend"),
    ({"skipped": True, "changed": False}, "vllm", "unreadable: http://lb:8404/stats;csv was not read (the task was skipped)"),
    (None, "vllm", "unreadable: http://lb:8404/stats;csv answered nothing: is it HAProxy's stats page (its URL ends in ;csv)?"),
])
def test_an_unreadable_pool_is_a_state_of_the_table_with_its_reason(stats, backend, text):
    got = F["fleet_status_pool"](stats, "haproxy", backend, "gpu2", URL)
    assert (got["label"], got["text"], got["found"], got["serving"]) == ("unreadable", text, None, None)


@pytest.mark.parametrize("lb_type", ["none", None, "", "hooks"])
def test_no_load_balancer_and_the_hooks_show_a_dash(lb_type):
    got = F["fleet_status_pool"](None, lb_type, "vllm", "gpu2", URL)
    assert (got["label"], got["text"], got["found"]) == ("-", "-", None)
    assert got["type"] == (lb_type or "none")


@pytest.mark.parametrize("response, names, why", [
    ({"status": 200, "json": {"object": "list", "data": [{"id": "tiny-a", "root": "/m/snap"}]}}, ["tiny-a"], None),
    ({"status": 200, "json": {"data": [{"id": "a"}, {"id": "b"}]}}, ["a", "b"], None),
    ({"status": 200, "json": {"data": []}}, [], "/v1/models lists no model"),
    ({"status": 200, "content": "ok"}, [], "/v1/models answered without a model list"),
    ({"status": 401, "msg": "Status code was 401 and not [200]: HTTP Error 401: Unauthorized"}, [],
     "/v1/models answered HTTP 401"),
    (REFUSED, [], "/v1/models does not answer: [Errno 111] Connection refused"),
    ({"status": -1, "msg": "Status code was -1 and not [200]: Connection failure: timed out"}, [],
     "/v1/models does not answer: timed out"),
    ({"skipped": True}, [], "/v1/models was not asked (the task was skipped)"),
    (None, [], "/v1/models does not answer: no answer"),
])
def test_what_v1_models_says(response, names, why):
    assert F["fleet_status_served"](response) == {"names": names, "why": why}


RECORD_A = {"model": "tiny-a", "served_model_name": "tiny-a", "path": "/hub/models--lab--tiny-a/snapshots/aaa"}
RECORD_B = {"model": "tiny-b", "served_model_name": "tiny-b", "path": "/hub/models--lab--tiny-b/snapshots/bbb"}
NO_POOL = F["fleet_status_pool"](None, "none", "vllm", "gpu2")


@pytest.mark.parametrize("record, served, service, place, drained, problems", [
    # agreement: nothing to say
    (RECORD_A, ["tiny-a"], "active", "UP", False, []),
    (RECORD_A, ["tiny-a"], "active", None, False, []),
    (RECORD_A, ["tiny-a"], "active", "no check", False, []),
    (dict(RECORD_A, served_model_name="kimi-k2.5"), ["kimi-k2.5"], "active", "UP", False, []),
    (dict(RECORD_A, served_model_name=None), [RECORD_A["path"]], "active", "UP", False, []),   # no --served-model-name
    (None, [], "inactive", "DOWN", False, []),             # a host nothing was deployed on
    (None, [], "not loaded", "MAINT", True, []),
    # the record and the server disagree
    (RECORD_B, ["tiny-a"], "active", "UP", False,
     ["record names tiny-b, serves tiny-a: rerun migrate.yml to repair it"]),
    (RECORD_B, ["tiny-a", "tiny-c"], "active", None, False,
     ["record names tiny-b, serves tiny-a, tiny-c: rerun migrate.yml to repair it"]),
    (RECORD_B, [], "inactive", "DOWN", False,
     ["record names tiny-b, but vllm.service is inactive: rerun migrate.yml to repair it"]),
    (RECORD_B, [], "failed", None, False,
     ["record names tiny-b, but vllm.service is failed: rerun migrate.yml to repair it"]),
    (RECORD_B, [], None, None, False,
     ["record names tiny-b, but vllm.service is not loaded: rerun migrate.yml to repair it"]),
    (RECORD_B, ["tiny-a"], "inactive", None, False,
     ["record names tiny-b, but vllm.service is inactive and tiny-a answers on its port: rerun migrate.yml to repair it"]),
    (None, ["tiny-a"], "active", "UP", False,
     ["serves tiny-a, but no deployment record names a model: rerun migrate.yml to repair it"]),
    # the server and the pool disagree
    (RECORD_A, ["tiny-a"], "active", "MAINT", True,
     ["serves but MAINT in the pool (an interrupted migrate.yml drained it): rerun migrate.yml to rejoin it"]),
    (RECORD_A, ["tiny-a"], "active", "DRAIN", True,
     ["serves but DRAIN in the pool (an interrupted migrate.yml drained it): rerun migrate.yml to rejoin it"]),
    (RECORD_A, ["tiny-a"], "active", "MAINT", False,
     ["serves but MAINT in the pool (not drained by migrate.yml): put it back with the lb_pool role "
      "(tasks_from: rejoin) if it should serve"]),
    (RECORD_A, ["tiny-a"], "active", "DOWN", False,
     ["serves but DOWN in the pool (health check L7OK): check that HAProxy reaches its vLLM port"]),
    (RECORD_A, ["tiny-a"], "active", "not listed", False,
     ["serves but not in the pool: add it to the backend, or set lb_pool_server to its server's name there"]),
    (None, [], "inactive", "UP", False,
     ["UP in the pool but serves nothing: take it out (lb_pool tasks_from: drain) or rerun migrate.yml"]),
    # both at once, the record's first
    (RECORD_B, ["tiny-a"], "active", "MAINT", True,
     ["record names tiny-b, serves tiny-a: rerun migrate.yml to repair it",
      "serves but MAINT in the pool (an interrupted migrate.yml drained it): rerun migrate.yml to rejoin it"]),
])
def test_where_record_service_server_and_pool_disagree(record, served, service, place, drained, problems):
    where = NO_POOL if place is None else pool(None if place == "not listed" else place)
    assert F["fleet_status_problems"](record, served, service, where, None, drained) == problems


def test_a_server_that_answers_nothing_says_why_and_the_unit_by_its_name():
    why = "/v1/models does not answer: [Errno 111] Connection refused"
    assert F["fleet_status_problems"](RECORD_B, [], "active", pool("UP"), why, False, "vllm-b.service") == [
        "record names tiny-b and vllm-b.service is active, but it serves nothing (%s): wait if it is starting, "
        "else read its journal (journalctl -u vllm-b.service)" % why,
        "UP in the pool but serves nothing (%s): take it out (lb_pool tasks_from: drain) or rerun migrate.yml" % why]


@pytest.mark.parametrize("stats", [REFUSED, None])
def test_an_unreadable_pool_flags_nobody(stats):
    where = F["fleet_status_pool"](stats, "haproxy", "vllm", "gpu2", URL)
    assert F["fleet_status_problems"](RECORD_A, ["tiny-a"], "active", where) == []
    hooks = F["fleet_status_pool"](None, "hooks", "vllm", "gpu2", URL)
    assert F["fleet_status_problems"](RECORD_A, ["tiny-a"], "active", hooks) == []


# --- playbooks/status.yml on two local hosts ---------------------------------------------------

class _Server(BaseHTTPRequestHandler):
    """/v1/models of the host this port stands for, /stats;csv of the pool (server.answers)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        answers = self.server.answers
        if self.path == "/v1/models" and self.headers.get("Authorization") == "Bearer k":
            body, kind = json.dumps({"object": "list", "data": [{"id": n} for n in answers["models"]]}), "json"
        elif self.path == "/stats;csv" and answers.get("stats") is not None:
            body, kind = answers["stats"], "csv"
        else:
            self.send_error(404 if self.path != "/v1/models" else 401)
            return
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json" if kind == "json" else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def servers():
    started = []

    def start(**answers):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
        httpd.answers = answers
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return httpd

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


SYSTEMCTL = """#!/bin/sh
# stand-in for `systemctl show --property=... -- UNIT`: the unit's file in units/, else not found
for arg; do unit=$arg; done
cat "$(dirname "$0")/units/$unit" 2>/dev/null || printf 'LoadState=not-found\\nActiveState=inactive\\n'
"""


def fleet(tmp_path, servers, hosts, stats):
    """An inventory of local hosts: hosts = {name: (record model or None, served models, active)}."""
    bin_dir = tmp_path / "bin"
    (bin_dir / "units").mkdir(parents=True)
    (bin_dir / "systemctl").write_text(SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    lb = servers(models=[], stats=stats)
    inventory = {}
    for name, (model, served, active) in hosts.items():
        home = tmp_path / name
        (home / "hub" / "models--lab--tiny-a").mkdir(parents=True)
        if model:
            (home / "deployment.json").write_text(json.dumps({
                "schema": 1, "model": model, "repo_id": "lab/" + model, "commit": "c" * 40,
                "path": "/hub/models--lab--%s/snapshots/%s" % (model, "c" * 40), "served_model_name": model,
                "unit": "%s-vllm.service" % name}))
        (bin_dir / "units" / ("%s-vllm.service" % name)).write_text(
            "LoadState=loaded\nActiveState=%s\nSubState=running\nMainPID=0\n" % ("active" if active else "failed"))
        inventory[name] = {
            "ansible_connection": "local", "ansible_host": "127.0.0.1", "ansible_python_interpreter": sys.executable,
            "vllm_service_port": servers(models=served).server_address[1], "vllm_service_api_key": "k",
            "vllm_service_unit": "%s-vllm.service" % name, "modelswap_deployment_record": str(home / "deployment.json"),
            "modelswap_drain_mark_path": str(home / "lb-drained.json"),
            "modelswap_hf_cache": str(home / "hub"), "lb_pool_type": "haproxy", "lb_pool_lb_host": "localhost",
            "lb_pool_haproxy_stats_url": "http://127.0.0.1:%d/stats;csv" % lb.server_address[1]}
    path = tmp_path / "hosts.yml"
    path.write_text(json.dumps({"all": {"children": {"gpu_hosts": {"hosts": inventory}}}}))
    return path, bin_dir


def status(inventory, bin_dir, *extra):
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_SHOW_CUSTOM_STATS="1",
               ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default", ANSIBLE_CALLBACK_RESULT_FORMAT="json",
               PATH="%s:%s:%s" % (bin_dir, Path(sys.executable).parent, os.environ.get("PATH", "")))
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory),
                           str(REPO / "playbooks/status.yml"), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def table(out):
    """The table's lines as the debug task printed them (a JSON list)."""
    start = out.index('"msg": [') + len('"msg": ')
    return json.JSONDecoder().raw_decode(out[start:])[0]


def custom_stats(out):
    """set_stats's data as the default callback prints it (ANSIBLE_SHOW_CUSTOM_STATS): one JSON line."""
    return json.loads(out[out.index("CUSTOM STATS"):].split("RUN:", 1)[1].splitlines()[0])


def test_status_shows_the_pool_and_flags_the_host_that_disagrees(tmp_path, servers):
    stats = csv_text("gpu1", ("gpu2", "MAINT"))
    inventory, bin_dir = fleet(tmp_path, servers, {"gpu1": ("tiny-a", ["tiny-a"], True),
                                                   "gpu2": ("tiny-b", ["tiny-a"], True)}, stats)
    (tmp_path / "gpu2" / "lb-drained.json").write_text('{"run_id": "r1", "pool": "vllm"}\n')
    for check in ([], ["--check"]):      # the same reads in check mode: every read runs there
        out = status(inventory, bin_dir, *check)
        lines = table(out)
        assert lines[0].split() == ["host", "record", "serving", "commit", "service", "pool", "gpus", "disk",
                                    "free", "models", "on", "disk"]
        assert lines[1].split()[:6] == ["gpu1", "tiny-a", "tiny-a", "c" * 12, "active", "UP"]
        assert lines[2].split()[:6] == ["gpu2", "tiny-b", "tiny-a", "c" * 12, "active", "MAINT"]
        assert lines[3:] == [
            "! gpu2: record names tiny-b, serves tiny-a: rerun migrate.yml to repair it",
            "! gpu2: serves but MAINT in the pool (an interrupted migrate.yml drained it): rerun migrate.yml to rejoin it"]
        hosts = custom_stats(out)["modelswap_status"]      # what ansible-runner callers get
        assert {h: (s["pool"]["status"], s["pool"]["serving"], len(s["problems"])) for h, s in hosts.items()} == {
            "gpu1": ("UP", True, 0), "gpu2": ("MAINT", False, 2)}
        assert hosts["gpu2"]["problems"][0] == "record names tiny-b, serves tiny-a: rerun migrate.yml to repair it"


def test_status_says_no_problems_and_why_a_pool_is_unreadable(tmp_path, servers):
    inventory, bin_dir = fleet(tmp_path, servers, {"gpu1": ("tiny-a", ["tiny-a"], True),
                                                   "gpu2": (None, [], False)}, csv_text("gpu1", ("gpu2", "DOWN")))
    lines = table(status(inventory, bin_dir))
    assert lines[1].split()[:6] == ["gpu1", "tiny-a", "tiny-a", "c" * 12, "active", "UP"]
    assert lines[2].split()[:6] == ["gpu2", "-", "-", "-", "failed", "DOWN"]
    assert lines[3:] == ["no problems: record, service, server and pool agree on each of the 2 host(s) read"]

    inventory, bin_dir = fleet(tmp_path / "b", servers, {"gpu1": ("tiny-a", ["tiny-a"], True)}, None)
    lines = table(status(inventory, bin_dir))
    assert lines[1].split()[:6] == ["gpu1", "tiny-a", "tiny-a", "c" * 12, "active", "unreadable"]
    assert lines[2].startswith("pool: unreadable: cannot read http://127.0.0.1:")
    assert lines[2].endswith("HTTP Error 404: Not Found")
    assert lines[3:] == ["no problems: record, service and server agree on each of the 1 host(s) read"]


def test_a_worker_of_a_replica_group_is_read_through_its_head(tmp_path, servers):
    # gpu2 runs headless: nothing answers on its own port, its group serves through gpu1
    inventory, bin_dir = fleet(tmp_path, servers, {"gpu1": ("tiny-a", ["tiny-a"], True),
                                                   "gpu2": ("tiny-a", [], True)}, csv_text("gpu1", ("gpu2", "DOWN")))
    groups = json.dumps({"modelswap_replica_groups": {"pair": {"nodes": ["gpu1", "gpu2"]}}})
    out = status(inventory, bin_dir, "-e", groups)
    lines = table(out)
    assert lines[1].split()[:6] == ["gpu1", "tiny-a", "tiny-a", "c" * 12, "active", "UP"]
    assert lines[2].split()[:6] == ["gpu2", "tiny-a", "tiny-a", "c" * 12, "active", "-"]
    assert lines[3:] == [
        "replica group pair: gpu1 serves the API; gpu2 runs headless (their rows read the group through gpu1)",
        "no problems: record, service, server and pool agree on each of the 2 host(s) read"]
    hosts = custom_stats(out)["modelswap_status"]
    assert hosts["gpu2"]["replica"] == {"group": "pair", "rank": 1, "head": "gpu1", "nodes": ["gpu1", "gpu2"]}
    assert hosts["gpu1"]["replica"]["rank"] == 0 and hosts["gpu2"]["pool"] is None
    # without the group the same worker is flagged: its own port answers nothing
    lines = table(status(inventory, bin_dir))
    assert any(line.startswith("! gpu2: record names tiny-a and") for line in lines), lines
