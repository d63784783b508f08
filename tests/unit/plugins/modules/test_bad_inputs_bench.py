"""Bad inputs of the benchmark modules (benchmark_probe, benchmark_run, benchmark_report) and of
roles/benchmark (issue 14): one row per input tried, the error it must give (a substring naming the
problem and the fix), and proof that nothing changed - no load reached the server (its token
counters), no run or results folder was created, an existing run's files are byte for byte the same,
and the API key is in no message.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.lab.simulator import SimulatorProcess
from tests.support.modules import REPO, run_module
from tests.unit.roles.test_benchmark import inventory, playbook, settings  # noqa: F401 (fixture)

pytestmark = pytest.mark.unit

KEY = "bad-input-key-41c7"
LOCUSTFILE = str(REPO / "roles" / "benchmark" / "files" / "locustfile.py")
PROMPTS = str(REPO / "roles" / "benchmark" / "files" / "prompts.txt")


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    s = SimulatorProcess(tmp_path_factory.mktemp("sim"), max_seconds=900, api_key=KEY, max_model_len=4096,
                         ttft_ms=5, chunk_ms=2).start()
    yield s
    s.stop()


def counters(sim) -> tuple[float, float]:
    """(prompt, generation) tokens the simulator has served so far."""
    import urllib.request
    with urllib.request.urlopen(f"{sim.url}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()

    def total(name):
        return sum(float(line.split()[-1]) for line in lines if line.startswith(name))
    return total("vllm:prompt_tokens_total"), total("vllm:generation_tokens_total")


def tree(folder: Path) -> dict:
    """Every file under `folder` and the sha256 of its bytes (empty when the folder is absent)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- benchmark_probe ---------------------------------------------------------------------------------
PROBE_ROWS = [
    ("url without a scheme", {"url": "127.0.0.1:8000"}, "is not an http(s) URL; set benchmark_url"),
    ("url of another scheme", {"url": "ftp://127.0.0.1/"}, "is not an http(s) URL"),
    ("unknown api", {"api": "grpc"}, "value of api must be one of: chat, completions"),
    ("no model", {"model": None}, "missing required arguments: model"),
    ("timeout not a number", {"timeout": "soon"}, "argument 'timeout' is of type str and we were unable to convert to float"),
    ("missing prompt source", {"calibration_text": "/nonexistent/prompts.txt"},
     "cannot read the prompt source /nonexistent/prompts.txt"),
    ("prompt + output beyond max_model_len", {"input_tokens": 4000, "output_tokens": 200},
     "exceeds the server's max_model_len (4096)"),
    ("wrong API key", {"api_key": "not-the-key"}, "the API key was refused: set benchmark_api_key"),
    ("no API key", {"api_key": None}, "the server requires an API key"),
    ("model not served", {"model": "kimi-k2.5"}, "does not serve model 'kimi-k2.5' (it serves: sim)"),
]


@pytest.mark.parametrize("what, over, fragment", PROBE_ROWS, ids=[r[0] for r in PROBE_ROWS])
def test_benchmark_probe_bad_input(sim, what, over, fragment):
    args = {"url": sim.url, "model": "sim", "api_key": KEY, "calibration_text": PROMPTS,
            "input_tokens": 64, "output_tokens": 16}
    args.update(over)
    args = {k: v for k, v in args.items() if v is not None}
    before = counters(sim)
    result = run_module("benchmark_probe", args)
    assert result.get("failed") is True, result
    assert fragment in result["msg"], result["msg"]
    # nothing changed: the probe sends at most its two one-token requests, never load
    _unused, gen = counters(sim)
    assert gen - before[1] <= 2
    assert KEY not in json.dumps(result) and "not-the-key" not in json.dumps(result)


# --- benchmark_run -------------------------------------------------------------------------------------
RUN_ROWS = [
    ("empty ladder", {"concurrency": []}, "the concurrency list is empty: give at least one concurrency"),
    ("zero concurrency", {"concurrency": [0, 4]}, "concurrency values must be positive integers; got 0"),
    ("falling ladder", {"concurrency": [8, 2]}, "must rise strictly from step to step"),
    ("repeated step", {"concurrency": [2, 2]}, "must rise strictly from step to step"),
    ("input_tokens 0", {"input_tokens": 0}, "input_tokens must be above 0; got 0"),
    ("output_tokens negative", {"output_tokens": -5}, "output_tokens must be above 0; got -5"),
    ("request timeout 0", {"request_timeout_s": 0}, "request_timeout_s must be above 0"),
    ("max requests per step 0", {"max_requests_per_step": 0}, "max_requests_per_step must be above 0"),
    ("negative ramp", {"ramp_s": -1}, "ramp_s must not be negative; got -1"),
    ("negative warm-up", {"warmup_s": -0.5}, "warmup_s must not be negative"),
    ("measure_max_s below measure_s", {"measure_s": 10, "measure_max_s": 5},
     "measure_max_s (5.0) must be at least measure_s (10.0)"),
    ("error rate 1.5", {"stop_error_rate": 1.5}, "stop_error_rate must be in [0, 1); got 1.5"),
    ("good ratio 0", {"stop_min_good_ratio": 0}, "stop_min_good_ratio must be in (0, 1]; got 0"),
    ("unknown SLO", {"slo": {"ttfb_ms": 100}}, "slo accepts ttft_ms, tpot_ms and e2el_ms; unknown: ttfb_ms"),
    ("negative SLO", {"slo": {"ttft_ms": -1}}, "slo.ttft_ms must be above 0 ms; got -1"),
    ("processes below -1", {"processes": -2}, "processes must be -1 (one per core), 0 (one process) or more"),
    ("processes and remote workers", {"processes": 2, "expect_workers": 1},
     "use either processes (workers on this host) or expect_workers (workers on other hosts), not both"),
    ("missing prompt source", {"prompt_source": "/nonexistent/p.txt"}, "prompt_source /nonexistent/p.txt is not a file"),
    ("missing locustfile", {"locustfile": "/nonexistent/locustfile.py"}, "is not a file"),
    ("unknown scheduling", {"scheduling": "fifo"}, "value of scheduling must be one of: normal, nice, realtime"),
    ("unknown api", {"api": "embeddings"}, "value of api must be one of: chat, completions"),
    ("ladder of words", {"concurrency": ["many"]}, "option 'concurrency' is of type str and we were unable to convert to int"),
    ("empty rate ladder", {"mode": "rate", "rates": []}, "the rate list is empty: give at least one rate"),
    ("rate 0", {"mode": "rate", "rates": [0, 2]}, "rates must be above 0 requests per second; got 0.0 in [0.0, 2.0]"),
    ("falling rates", {"mode": "rate", "rates": [4, 2]}, "rates must rise strictly from step to step"),
    ("burstiness 0", {"mode": "rate", "rates": [1], "burstiness": 0}, "burstiness must be above 0 (1 is a Poisson"),
    ("negative in-flight cap", {"mode": "rate", "rates": [1], "max_inflight": -1}, "max_inflight must be 0 (no cap)"),
    ("SLO without a unit", {"mode": "rate", "rates": [1], "capacity_slo": {"ttft_p99": "2"}},
     "slo.ttft_p99 is '2': give a duration with its unit, e.g. '2 s' or '80 ms'"),
    ("error rate without %", {"mode": "rate", "rates": [1], "capacity_slo": {"error_rate": 0.01}},
     "slo.error_rate is 0.01: give a percentage, e.g. '1%'"),
    ("capacity SLO on a concurrency ladder", {"capacity_slo": {"ttft_p99": "2 s"}},
     "capacity_slo is for a rate ladder (mode: rate)"),
    ("random lengths without a range", {"workload": "random"},
     "range_ratio must be above 0 and below 1 for workload random"),
    ("a prefix as long as the prompt", {"workload": "shared_prefix", "prefix_tokens": 48},
     "prefix_tokens must be above 0 and below input_tokens (48) for workload shared_prefix; got 48"),
    ("a prompt file with random lengths", {"workload": "random", "range_ratio": 0.3, "prompt_format": "jsonl"},
     "a JSONL prompt file brings its own prompts: use workload fixed with it"),
]


def run_args(url, run_dir, **kw):
    args = dict(url=url, model="sim", api_key=KEY, concurrency=[1, 2], input_tokens=48, output_tokens=16,
                prompt_source=PROMPTS, locustfile=LOCUSTFILE, run_dir=str(run_dir), ramp_s=0.5, warmup_s=0.5,
                measure_s=2, measure_max_s=6, min_requests_per_user=2, request_timeout_s=20)
    args.update(kw)
    return args


@pytest.mark.parametrize("what, over, fragment", RUN_ROWS, ids=[r[0] for r in RUN_ROWS])
def test_benchmark_run_bad_input(sim, tmp_path, what, over, fragment):
    run_dir = tmp_path / "run"
    before = counters(sim)
    result = run_module("benchmark_run", run_args(sim.url, run_dir, **over))
    assert result.get("failed") is True, result
    assert fragment in result["msg"], result["msg"]
    assert not run_dir.exists()                  # nothing written
    assert counters(sim) == before               # no load, not even a probe
    assert KEY not in json.dumps(result)


def test_benchmark_run_refuses_a_folder_that_holds_a_run(sim, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "raw").mkdir(parents=True)
    (run_dir / "raw" / "master.jsonl").write_text('{"k": "start"}\n')
    (run_dir / "config.json").write_text('{"schema": 1}\n')
    files = tree(run_dir)
    before = counters(sim)
    result = run_module("benchmark_run", run_args(sim.url, run_dir))
    assert result.get("failed") is True
    assert "already holds a run (raw/master.jsonl); give each run its own folder" in result["msg"]
    assert tree(run_dir) == files and counters(sim) == before


# --- benchmark_report ----------------------------------------------------------------------------------
def report_args(run_dir, **kw):
    args = dict(run_dir=str(run_dir), host="h1", model="sim", plots=False)
    args.update(kw)
    return args


REPORT_ROWS = [
    ("no raw folder", "absent", {}, "does not exist: run modelswap.vllm.benchmark_run with this run_dir first"),
    ("unknown check", "good", {"checks": {"bogus_check": 1}}, "benchmark report: unknown checks bogus_check; known:"),
    ("raw record not JSON", "garbage", {}, "benchmark report: cannot read the run in"),
    ("no host", "good", {"host": None}, "missing required arguments: host"),
    ("noise not a number", "good", {"noise": "some"}, "argument 'noise' is of type str and we were unable to convert to float"),
    ("checks not a mapping", "good", {"checks": "strict"}, "argument 'checks' is of type str and we were unable to convert to dict"),
]


@pytest.mark.parametrize("what, raw, over, fragment", REPORT_ROWS, ids=[r[0] for r in REPORT_ROWS])
def test_benchmark_report_bad_input(tmp_path, what, raw, over, fragment):
    run_dir = tmp_path / "run"
    if raw != "absent":
        (run_dir / "raw").mkdir(parents=True)
        (run_dir / "raw" / "master.jsonl").write_text(
            '{"k": "start", "t": 0' if raw == "garbage" else '{"k": "start", "t": 0, "wall": 0}\n')
    files = tree(run_dir)
    args = {k: v for k, v in report_args(run_dir, **over).items() if v is not None}
    result = run_module("benchmark_report", args)
    assert result.get("failed") is True, result
    assert fragment in result["msg"], result["msg"]
    assert tree(run_dir) == files                       # no report written, nothing removed
    assert raw != "absent" or not run_dir.exists()


# --- roles/benchmark (playbooks/benchmark.yml) ---------------------------------------------------------
ROLE_ROWS = [
    ("no model", {"benchmark_model": ""}, "set benchmark_model to the served model name"),
    ("URL of another scheme", {"benchmark_url": "ftp://127.0.0.1:9/"}, "benchmark_url to an http(s) URL"),
    ("processes and load generators", {"benchmark_processes": 2, "benchmark_load_generators": ["sim1"]},
     "use either benchmark_processes or benchmark_load_generators"),
    ("repeated step", {"benchmark_concurrency": [2, 2]}, "that rise from step to step"),
    ("unknown api", {"benchmark_api": "grpc"}, "value of benchmark_api must be one of: chat, completions"),
    ("wrong API key", {"benchmark_api_key": "not-the-key"}, "the API key was refused"),
    ("rate 0", {"benchmark_mode": "rate", "benchmark_rates": [0, 2]}, "rates must be above 0 requests per second"),
    ("SLO without a unit", {"benchmark_mode": "rate", "benchmark_slo": {"ttft_p99": 2}},
     "slo.ttft_p99 is 2: give a duration with its unit"),
    ("burstiness 0", {"benchmark_mode": "rate", "benchmark_burstiness": 0}, "burstiness must be above 0"),
]


@pytest.mark.parametrize("what, over, fragment", ROLE_ROWS, ids=[r[0] for r in ROLE_ROWS])
def test_benchmark_role_bad_input(sim, inventory, tmp_path, what, over, fragment):  # noqa: F811
    results = tmp_path / "results"
    workers = tmp_path / "workers"
    extra = settings(sim, results, benchmark_worker_dir=str(workers), **over)
    extra["benchmark_api_key"] = over.get("benchmark_api_key", KEY)
    before = counters(sim)
    proc = playbook(inventory, extra)
    assert proc.returncode != 0
    assert fragment in proc.stdout, proc.stdout[-3000:]
    assert counters(sim)[1] - before[1] <= 2             # at most the probe's one-token requests
    assert not results.exists() and not workers.exists()
    assert KEY not in proc.stdout and "not-the-key" not in proc.stdout.replace("'not-the-key'", "")


def test_the_table_counts():
    """The closing notes count these rows (issue 14: 45; the rate ladder's and workloads', issue 30: 14 more)."""
    assert len(PROBE_ROWS) + len(RUN_ROWS) + 1 + len(REPORT_ROWS) + len(ROLE_ROWS) == 59
