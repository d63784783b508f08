"""The API key on every route of real vLLM 0.32 (CPU) deployed by the vllm_service role with its
defaults (vllm_service_guard_routes), and the serving side's bad inputs refused before anything
changes. One vLLM on gpu1 serves every check (a start costs about a minute here).

vLLM 0.32's own --api-key / VLLM_API_KEY check guards only /v1, /v2, /inference and /cohere;
measured on this lab without the guard: /invocations answered a completion, /tokenize and
/detokenize answered, /generative_scoring reached the engine (and crashed it), /scale_elastic_ep
reached its handler, all without a key. With the role's guard every route but GET/HEAD of the
open probes answers 401 without the key and works with it.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration import vllm_lab as V
from tests.unit.roles.test_bad_inputs_serving import MARKER, ROLE_ROWS

pytestmark = [pytest.mark.lab, pytest.mark.vllm]

HOST = "gpu1"
OPEN = ["/health", "/ping", "/metrics", "/version"]
# Inference, tokenization and state-changing routes of vLLM 0.32 (whether this model registers
# them or not: an unregistered one must be refused without the key all the same).
ROUTES = [
    ("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/pooling"),
    ("POST", "/classify"), ("POST", "/score"), ("POST", "/rerank"), ("POST", "/generative_scoring"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
    ("POST", "/v1/score"), ("POST", "/v1/rerank"), ("POST", "/v2/rerank"), ("POST", "/v1/responses"),
    ("POST", "/v1/messages"), ("POST", "/inference/v1/generate"), ("POST", "/scale_elastic_ep"),
    ("POST", "/is_scaling_elastic_ep"), ("POST", "/pause"), ("POST", "/resume"), ("POST", "/sleep"),
    ("POST", "/wake_up"), ("POST", "/reset_prefix_cache"), ("POST", "/start_profile"), ("POST", "/ping"),
    ("GET", "/load"), ("GET", "/server_info"), ("GET", "/is_sleeping"), ("GET", "/kv_event_sources"),
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/v1/models"),
]
COMPLETION = {"model": "tiny-a", "prompt": "Hi", "max_tokens": 2}


def request(lab, method, path, key=None, body=None, headers=None):
    """(status, body bytes) of one request to gpu1's vLLM."""
    hdrs = dict(headers or {})
    if body is not None:
        hdrs["Content-Type"] = "application/json"
    if key is not None:
        hdrs["Authorization"] = "Bearer " + key
    data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
    if method == "POST":
        hdrs.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(V.url(lab, HOST, path), method=method, headers=hdrs, data=data)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def sums(lab):
    return lab.ssh(HOST, "sha256sum /etc/systemd/system/vllm.service /etc/modelswap/vllm.env "
                         "/etc/modelswap/vllm.secret.env %s" % V.RECORD).stdout


def main_pid(lab):
    return int(V.unit_show(lab, HOST, "MainPID")["MainPID"])


class Ctx:
    def __init__(self, lab):
        self.lab = lab
        self.key = V.new_api_key()
        self.runs = []

    def run(self, models=None, serve="tiny-a", **extra):
        extra.setdefault("modelswap_serve", serve)
        variables = V.role_vars(self.lab, self.key, **extra)
        if models is not None:
            variables["modelswap_models"] = models
        result = self.lab.playbook(V.DEPLOY, variables, limit=HOST)
        self.runs.append(result)
        return result


@pytest.fixture(scope="module")
def ctx(lab):
    V.reset_host(lab, HOST)
    c = Ctx(lab)
    V.prepare(lab, [HOST], c.key)          # vLLM from the wheelhouse, models (no-ops when there)
    c.deploy = c.run()                     # the role's defaults: the guard is on
    assert c.deploy.rc == 0, c.deploy.stdout[-6000:]
    c.spec = json.loads(request(lab, "GET", "/openapi.json", key=c.key)[1])
    yield c
    V.stop(lab, HOST)


def test_the_default_deployment_loads_the_guard(ctx):
    lab = ctx.lab
    unit = lab.ssh(HOST, "cat /etc/systemd/system/vllm.service").stdout
    [exec_start] = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert "--middleware modelswap_vllm_guard.RequireApiKey" in exec_start
    env = lab.ssh(HOST, "cat /etc/modelswap/vllm.env").stdout
    assert 'PYTHONPATH="/opt/modelswap/lib/python"' in env.splitlines()
    assert 'MODELSWAP_VLLM_OPEN_ROUTES="/health,/ping,/metrics,/version"' in env.splitlines()
    assert lab.ssh(HOST, "stat -c '%a %U' /opt/modelswap/lib/python/modelswap_vllm_guard.py").stdout.strip() \
        == "644 root"
    # the readiness gates passed through the guard: /health open, the rest with the key
    [ok] = [r for r in ctx.deploy.task_results("Report the outcome", HOST) if r["_event"] == "runner_on_ok"]
    assert set(ok["ansible_facts"]["vllm_service_result"]["gates"]) == {"port", "health", "models", "completion"}


def test_every_route_of_the_served_openapi_needs_the_key(ctx):
    """Every path and method vLLM lists, and the known inference routes, without the key."""
    lab = ctx.lab
    listed = [(m.upper(), p) for p, methods in ctx.spec["paths"].items() for m in methods
              if m.upper() in ("GET", "POST")]
    assert ("POST", "/invocations") in listed and ("POST", "/tokenize") in listed
    checked = sorted(set(listed) | set(ROUTES))
    opened = []
    for method, path in checked:
        path = path.replace("{response_id}", "resp_x")
        status, body = request(lab, method, path)
        if method in ("GET", "HEAD") and path in OPEN:
            opened.append(path)
            continue
        assert (status, body) == (401, b'{"error":"Unauthorized"}'), (method, path, status, body[:200])
        assert request(lab, method, path, key="wrong-" + ctx.key)[0] == 401, (method, path)
        assert request(lab, method, path, headers={"Authorization": "Basic " + ctx.key})[0] == 401
    assert sorted(opened) == sorted(p for p in OPEN if ("GET", p) in checked)
    assert len(checked) >= 40, checked


def test_with_the_key_inference_works(ctx):
    lab, key = ctx.lab, ctx.key
    status, body = request(lab, "POST", "/invocations", key, COMPLETION)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    status, body = request(lab, "POST", "/invocations", key,
                           {"model": "tiny-a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert status == 200 and json.loads(body)["object"] == "chat.completion"
    status, body = request(lab, "POST", "/tokenize", key, {"model": "tiny-a", "prompt": "Hi"})
    tokens = json.loads(body)["tokens"]
    assert status == 200 and tokens
    status, body = request(lab, "POST", "/detokenize", key, {"model": "tiny-a", "tokens": tokens})
    assert status == 200 and "Hi" in json.loads(body)["prompt"]
    status, body = request(lab, "POST", "/v1/completions", key, COMPLETION)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    status, body = request(lab, "POST", "/v1/chat/completions", key,
                           {"model": "tiny-a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    assert request(lab, "GET", "/v1/models", key)[0] == 200
    assert request(lab, "GET", "/openapi.json", key)[0] == 200
    # routes a generative model does not register: not there, with or without the key
    for path in ("/pooling", "/classify", "/score", "/rerank"):
        assert request(lab, "POST", path, key, {"model": "tiny-a", "input": "Hi"})[0] == 404, path
    # the server still serves after all the refused requests
    assert V.served_names(lab, HOST, key) == ["tiny-a"]


def test_the_probes_answer_without_the_key(ctx):
    lab = ctx.lab
    assert request(lab, "GET", "/health") == (200, b"")
    assert request(lab, "GET", "/ping")[0] == 200
    assert json.loads(request(lab, "GET", "/version")[1])["version"] == "0.32.0"
    status, body = request(lab, "GET", "/metrics")
    assert status == 200 and b"vllm:num_requests_running" in body      # the benchmark's gauge
    # HEAD passes the guard too; vLLM's /health route has no HEAD (405, not the guard's 401)
    assert request(lab, "HEAD", "/health")[0] == 405
    # an open path with another method is not open
    assert request(lab, "POST", "/ping")[0] == 401


def test_the_benchmark_runs_through_the_guard(ctx, tmp_path):
    """The benchmark role: its preflight and load use /v1 with the key, its server samples read
    /metrics without one."""
    lab = ctx.lab
    results = tmp_path / "results"
    run = lab.playbook("playbooks/benchmark.yml", {
        "benchmark_hosts": HOST, "benchmark_port": V.PORT, "benchmark_model": "tiny-a",
        "benchmark_api_key": ctx.key, "benchmark_concurrency": [1, 2], "benchmark_input_tokens": 32,
        "benchmark_output_tokens": 8, "benchmark_ramp_s": 1, "benchmark_warmup_s": 1,
        "benchmark_measure_s": 4, "benchmark_measure_max_s": 20, "benchmark_min_requests_per_user": 1,
        "benchmark_request_timeout_s": 60, "benchmark_results_dir": str(results),
        "benchmark_deployment": {"model": "tiny-a", "commit": lab.models["tiny-a"]["commit"]},
    })
    ctx.runs.append(run)
    assert run.rc == 0, run.stdout[-5000:]
    [report] = sorted(results.glob("%s/tiny-a/*/*/report.json" % HOST))
    doc = json.loads(report.read_text())
    assert doc["run"]["complete"]
    for step in doc["steps"]:
        assert step["requests"]["failed"] == 0, step["requests"]
        assert step["server"] is not None and step["server"]["samples"] >= 1


def test_a_second_run_changes_nothing(ctx):
    pid = main_pid(ctx.lab)
    run = ctx.run()
    assert run.rc == 0, run.stdout[-6000:]
    assert run.changed(HOST) == 0, run.stdout[-6000:]
    assert main_pid(ctx.lab) == pid


def row_vars(lab, change):
    models = V.catalog(lab)
    entry = dict(models["tiny-a"], **change.get("entry", {}))
    name = change.get("name", "tiny-a")
    models[name] = entry
    return models, name, change.get("vars", {})


@pytest.fixture(scope="module")
def refused(ctx):
    """Every ROLE_ROWS row through the role on gpu1 (4 at a time), then the host's state."""
    lab = ctx.lab
    before = (main_pid(lab), sums(lab))

    def one(row):
        models, name, variables = row_vars(lab, row[1])
        return ctx.run(models=models, serve=name, **variables)
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = dict(zip([r[0] for r in ROLE_ROWS], pool.map(one, ROLE_ROWS)))
    injected = lab.ssh(HOST, "ls /tmp/modelswap-injected 2>&1; true").stdout
    return runs, before, (main_pid(lab), sums(lab)), injected


@pytest.mark.parametrize("row, change, message", ROLE_ROWS, ids=[r[0] for r in ROLE_ROWS])
def test_role_refuses_before_anything_changes(ctx, refused, row, change, message):
    runs, before, after, injected = refused
    run = runs[row]
    assert run.rc != 0 and run.failed(HOST) == 1, run.stdout[-4000:]
    failed = [ev["event_data"] for ev in run.events if ev.get("event") == "runner_on_failed"]
    assert len(failed) == 1, run.stdout[-4000:]
    msg = failed[0]["res"].get("msg", "")
    task = failed[0]["task"]
    assert message in msg, (task, msg)
    assert "nothing was changed" in msg.lower() or "vllm_service_open_routes" in msg
    # refused in the validate step (or the argument spec before it): no task changed anything,
    # the unit, its environment files and the record are the same, the same process serves
    assert task.startswith(("Check ", "Validating arguments")), task
    assert run.changed(HOST) == 0
    assert after == before
    assert "No such file" in injected
    dump = run.stdout + json.dumps(run.events)
    assert MARKER not in dump and ctx.key not in dump
    assert V.served_names(ctx.lab, HOST, ctx.key) == ["tiny-a"]
