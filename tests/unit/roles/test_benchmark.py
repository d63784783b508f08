"""The benchmark role through playbooks/benchmark.yml, against the simulator on loopback: bad input
stops before any load, a run leaves the report keyed by host/model/commit/time, the next run is
compared with it, check mode starts nothing, and benchmark_skip_existing converges to changed=0."""
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.lab.simulator import SimulatorProcess
from tests.support.modules import REPO

pytestmark = pytest.mark.unit
KEY = "role-key-93ad"


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    s = SimulatorProcess(tmp_path_factory.mktemp("sim"), max_seconds=600, api_key=KEY, ttft_ms=20, chunk_ms=10,
                         slots=4).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def inventory(tmp_path_factory):
    path = tmp_path_factory.mktemp("inv") / "hosts.yml"
    path.write_text(json.dumps({"all": {"hosts": {"sim1": {
        "ansible_connection": "local", "ansible_host": "127.0.0.1",
        "ansible_python_interpreter": sys.executable}}}}))
    return path


def playbook(inventory, extra, *, check=False, cwd=REPO, host="sim1"):
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory),
            str(REPO / "playbooks/benchmark.yml"), "-e", f"benchmark_hosts={host}", "-e", json.dumps(extra)]
    if check:
        argv.append("--check")
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def settings(sim, results, **kw):
    out = {"benchmark_url": sim.url, "benchmark_model": "sim", "benchmark_api_key": KEY,
           "benchmark_concurrency": [2, 4], "benchmark_input_tokens": 48, "benchmark_output_tokens": 16,
           "benchmark_ramp_s": 0.5, "benchmark_warmup_s": 0.5, "benchmark_measure_s": 2,
           "benchmark_measure_max_s": 6, "benchmark_min_requests_per_user": 2, "benchmark_request_timeout_s": 20,
           "benchmark_results_dir": str(results), "benchmark_scheduling": "realtime",
           "benchmark_deployment": {"model": "sim", "vllm_args": {"max_model_len": 8192}}}
    out.update(kw)
    return out


def flat(text):
    """Ansible's output with the YAML callback's line wrapping and quote doubling undone."""
    return " ".join(text.split()).replace("''", "'")


def tokens_generated(sim):
    with urllib.request.urlopen(f"{sim.url}/metrics", timeout=5) as resp:
        return sum(float(line.split()[-1]) for line in resp.read().decode().splitlines()
                   if line.startswith("vllm:generation_tokens_total"))


def runs(results):
    return sorted((results / "sim1" / "sim" / "unknown-commit").glob("*/report.json"))


@pytest.mark.parametrize("over, fragment", [
    ({"benchmark_concurrency": []}, "benchmark_concurrency must be a non-empty list of positive integers"),
    ({"benchmark_concurrency": [4, 0]}, "benchmark_concurrency must be a non-empty list"),
    ({"benchmark_concurrency": [8, 2]}, "that rise from step to step"),
    ({"benchmark_api_key": "nope"}, "the API key was refused"),
    ({"benchmark_model": "other"}, "does not serve model 'other'"),
    ({"benchmark_url": "http://127.0.0.1:9"}, "cannot reach the server at http://127.0.0.1:9"),
    ({"benchmark_output_tokens": 9000}, "exceeds the server's max_model_len (8192)"),
])
def test_bad_input_fails_before_any_load(sim, inventory, tmp_path, over, fragment):
    before = tokens_generated(sim)
    proc = playbook(inventory, settings(sim, tmp_path / "results", **over))
    assert proc.returncode != 0
    assert fragment in proc.stdout, proc.stdout[-3000:]
    # at most the preflight's two one-token requests: no load was started
    assert tokens_generated(sim) - before <= 2
    assert not (tmp_path / "results").exists()
    assert KEY not in proc.stdout and "nope" not in proc.stdout.replace("'nope'", "")


def test_run_report_comparison_check_mode_and_skip(sim, inventory, tmp_path):
    results = tmp_path / "results"
    first = playbook(inventory, settings(sim, results))
    assert first.returncode == 0, first.stdout[-4000:]
    assert "report: " + str(results / "sim1" / "sim" / "unknown-commit") in first.stdout
    assert KEY not in first.stdout
    [report] = runs(results)
    doc = json.loads(report.read_text())
    assert [s["concurrency"] for s in doc["steps"]] == [2, 4]
    assert doc["tokens"]["match"] is True
    assert doc["deployment"]["vllm_version"] == "0.0.0+simulator"      # what the server said ...
    assert doc["deployment"]["vllm_args"] == {"max_model_len": 8192}    # ... and what the inventory says
    assert doc["comparison"] is None
    for name in ("steps.csv", "report.md", "throughput.png", "latency.png", "config.json", "raw/master.jsonl"):
        assert (report.parent / name).is_file(), name

    # check mode: plans, starts no load, writes no results
    check = playbook(inventory, settings(sim, results), check=True)
    assert check.returncode == 0, check.stdout[-3000:]
    assert len(runs(results)) == 1

    # converge: a complete report for this host, model and commit exists -> nothing to do
    skip = playbook(inventory, settings(sim, results, benchmark_skip_existing=True))
    assert skip.returncode == 0, skip.stdout[-3000:]
    assert "benchmark: skipped, a report exists" in skip.stdout
    assert "changed=0" in skip.stdout and len(runs(results)) == 1

    # a new run is compared with the previous one
    second = playbook(inventory, settings(sim, results))
    assert second.returncode == 0, second.stdout[-3000:]
    latest = runs(results)[-1]
    cmp = json.loads(latest.read_text())["comparison"]
    assert cmp is not None and cmp["previous_run"] == report.parent.name
    assert "## Compared with the previous run" in (latest.parent / "report.md").read_text()


def test_locust_workers_on_a_load_generator(sim, inventory, tmp_path):
    """Locust's distributed mode across hosts: the master on the controller, a worker started by
    the role on the load generator (here the same machine over a local connection), its records
    fetched back into the run's raw folder, its copies (config, the 0600 API key file) removed."""
    results = tmp_path / "results"
    workers = tmp_path / "workers"
    proc = playbook(inventory, settings(
        sim, results, benchmark_load_generators=["sim1"], benchmark_master_address="127.0.0.1",
        benchmark_master_port=15557 + os.getpid() % 1000,
        benchmark_worker_locust_command=[str(Path(sys.executable).parent / "locust")],
        benchmark_worker_dir=str(workers)))
    assert proc.returncode == 0, proc.stdout[-4000:]
    [report] = runs(results)
    fetched = list((report.parent / "raw" / "sim1").glob("worker-*.jsonl"))
    assert len(fetched) == 1
    doc = json.loads(report.read_text())
    assert doc["run"]["load"]["mode"] == "master"
    assert doc["tokens"]["match"] is True and doc["tokens"]["client_completion_tokens"] > 0
    assert all(s["requests"]["completed"] > 0 for s in doc["steps"])
    assert not any(workers.iterdir()) if workers.exists() else True
    assert KEY not in proc.stdout


def test_check_mode_shows_the_plan_without_verbosity(sim, inventory, tmp_path):
    """--check prints the plan (target, load host, ladder, windows, bounds, results folder) at the
    default verbosity, warns about windows too short for Little's law with the minimum, starts
    no load and writes nothing."""
    before = tokens_generated(sim)
    check = playbook(inventory, settings(sim, tmp_path / "results"), check=True)
    assert check.returncode == 0, check.stdout[-3000:]
    out = flat(check.stdout)
    assert "TASK [modelswap.vllm.benchmark : Show the plan]" in out
    assert f"sim1: benchmark sim at {sim.url}, the load from localhost" in out
    assert f"target: {sim.url} (chat API), model sim" in out
    assert "ladder: C=2,4 (closed loops, no wait); ~48 prompt tokens, 16 output tokens per request (ignore_eos)" in out
    assert "each step: ramp 0.5 s, warm-up 0.5 s (discarded), measured window 2 s to 6 s until it holds 2" in out
    assert "requests time out after 20 s" in out and "bounds: at most " in out
    assert f"results: {tmp_path / 'results'}/sim1/sim/unknown-commit/" in out
    assert "check mode: no load is started and nothing is written" in out
    # min_requests_per_user 2: the window may be too short, said before the run, with the minimum
    assert "WARNING: a step's measured window may close after measure_s (2 s) holding only 2 requests per user" \
        in out
    assert "[WARNING]: benchmark: a step's measured window" in out + flat(check.stderr)
    assert "needs at least 11" in out
    assert tokens_generated(sim) - before <= 2 and not (tmp_path / "results").exists()
    assert KEY not in out


def test_the_default_ladder_settings_warn_about_nothing(sim, inventory, tmp_path):
    check = playbook(inventory, settings(sim, tmp_path / "results", benchmark_min_requests_per_user=11), check=True)
    assert check.returncode == 0, check.stdout[-3000:]
    assert "until it holds 11 requests per user" in flat(check.stdout)
    assert "WARNING" not in check.stdout + check.stderr


def test_the_example_inventorys_settings_reach_the_plan(sim, tmp_path):
    """playbooks/benchmark.yml with the example inventory (its host pointed at the simulator):
    the plan shows the ladder and lengths that group_vars/all/benchmark.yml sets."""
    check = playbook(REPO / "inventory/example", {
        "benchmark_url": sim.url, "benchmark_model": "sim", "benchmark_api_key": KEY,
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "benchmark_load_generators": [], "modelswap_results_dir": str(tmp_path)}, check=True, host="gpu-a01")
    assert check.returncode == 0, check.stdout[-3000:]
    out = flat(check.stdout)
    assert "ladder: C=1,8,32,128,256,512,1024 (closed loops, no wait); ~1024 prompt tokens, 256 output tokens" in out
    assert "measured window 120 s to 300 s until it holds 11 requests per user" in out
    assert f"results: {tmp_path}/benchmark/gpu-a01/sim/unknown-commit/" in out


def test_a_relative_results_dir_is_printed_normalized(sim, inventory, tmp_path):
    """Run from another folder with modelswap_results_dir 'playbooks/../res': the report lands in
    <that folder>/res/benchmark/... and the output names it without '..'."""
    extra = settings(sim, None, benchmark_concurrency=[2], modelswap_results_dir="playbooks/../res")
    del extra["benchmark_results_dir"]
    proc = playbook(inventory, extra, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    [report] = sorted((tmp_path / "res" / "benchmark" / "sim1" / "sim" / "unknown-commit").glob("*/report.md"))
    assert f"report: {report}" in proc.stdout
    assert "/../" not in proc.stdout


def test_a_rate_ladder_previews_its_search_then_finds_the_capacity_at_the_slo(sim, inventory, tmp_path):
    """benchmark_mode rate with benchmark_slo: --check shows the rates, the arrivals and the SLO and
    starts no load; the run sweeps until a rate misses the SLO, bisects once, and the report's
    headline says the capacity (the simulator: 4 slots of 170 ms, at most 23.5 req/s)."""
    results = tmp_path / "results"
    rate = {"benchmark_mode": "rate", "benchmark_rates": [5, 10, 40], "benchmark_burstiness": 1.0,
            "benchmark_slo": {"ttft_p99": "400 ms", "error_rate": "1%"}, "benchmark_search_bisections": 1}
    before = tokens_generated(sim)
    check = playbook(inventory, settings(sim, results, **rate), check=True)
    assert check.returncode == 0, check.stdout[-3000:]
    out = flat(check.stdout)
    assert "ladder: 5,10,40 req/s (open loop, Poisson arrivals, seed 0); ~48 prompt tokens" in out
    assert ("capacity at the SLO (TTFT p99 <= 400 ms, errors <= 1%): the rates above as a sweep until one misses "
            "it, then 1 bisection step(s)") in out
    assert tokens_generated(sim) - before <= 2 and not results.exists()

    run = playbook(inventory, settings(sim, results, **rate))
    assert run.returncode == 0, run.stdout[-4000:]
    [report] = runs(results)
    doc = json.loads(report.read_text())
    offered = [s["rate"]["offered"] for s in doc["steps"]]
    assert offered[:3] == [5, 10, 40] and len(offered) == 4 and offered[3] == 25, offered
    cap = doc["capacity"]
    assert (cap["rate"], cap["first_failing_rate"]) in ((10, 25), (25, 40)), cap
    assert doc["headline"].startswith(f"sim1 holds {cap['rate']:g} req/s at TTFT p99 <= 400 ms, errors <= 1%")
    assert doc["headline"] in flat(run.stdout)
    assert all(s["concurrency"] is None and s["rate"]["dispatch_delay_ms"]["n"] > 0 for s in doc["steps"])
    assert f"**{doc['headline']}.**" in (report.parent / "report.md").read_text()
    assert KEY not in run.stdout


def test_a_replica_group_is_benchmarked_through_its_head(sim, tmp_path):
    # sim2 runs headless in the group: it has no API (its benchmark_url leads nowhere)
    local = {"ansible_connection": "local", "ansible_host": "127.0.0.1", "ansible_python_interpreter": sys.executable}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"all": {"hosts": {"sim1": local, "sim2": dict(local, benchmark_url="http://127.0.0.1:9")}}}))
    results = tmp_path / "results"
    run = playbook(inventory, settings(sim, results, modelswap_replica_groups={"pair": {"nodes": ["sim1", "sim2"]}}),
                   host="sim1,sim2")
    assert run.returncode == 0, run.stdout[-4000:]
    assert "sim2 runs headless in replica group pair; the group is benchmarked through its head sim1" in flat(run.stdout)
    [report] = runs(results)
    assert json.loads(report.read_text())["deployment"]["replica_group"] == {"name": "pair", "nodes": ["sim1", "sim2"]}
    assert "| replica group | pair: sim1 (head), sim2 |" in (report.parent / "report.md").read_text()
    assert not (results / "sim2").exists()
