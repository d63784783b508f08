"""benchmark_probe, benchmark_run and benchmark_report against the known-timing simulator on
loopback: bad input fails before any load, the ladder runs bounded, stops early when told, and
the report finds the knee where the simulator's slots run out."""
import json
import socket
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats
from tests.lab.simulator import SimulatorProcess
from tests.support.modules import REPO, run_module

pytestmark = pytest.mark.unit

LOCUSTFILE = str(REPO / "roles" / "benchmark" / "files" / "locustfile.py")
PROMPTS = str(REPO / "roles" / "benchmark" / "files" / "prompts.txt")
KEY = "sim-key-5f2c"


@pytest.fixture
def sim(tmp_path):
    """A factory of simulators; each is stopped by PID at the end of the test."""
    started = []

    def start(**settings):
        s = SimulatorProcess(tmp_path / f"sim{len(started)}", max_seconds=300, **settings).start()
        started.append(s)
        return s
    yield start
    for s in started:
        s.stop()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_args(url, run_dir, **kw):
    args = dict(url=url, model="sim", api_key=KEY, concurrency=[1, 2], input_tokens=48, output_tokens=16,
                prompt_source=PROMPTS, locustfile=LOCUSTFILE, run_dir=str(run_dir), ramp_s=0.5, warmup_s=0.5,
                measure_s=2, measure_max_s=6, min_requests_per_user=2, request_timeout_s=20,
                metrics_url=f"{url}/metrics", scheduling="realtime")
    args.update(kw)
    return args


def warnings(result):
    """Warning texts of a result (ansible-core 2.19 returns structured dicts)."""
    return [w["event"]["msg"] if isinstance(w, dict) else str(w) for w in result.get("warnings", [])]


def generation_requests(simulator):
    import urllib.request
    with urllib.request.urlopen(f"{simulator.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


# --- preflight: every bad input is a clear error, before any load ----------------------------------------
@pytest.mark.parametrize("over, kind, fragment", [
    ({"url": None}, "unreachable", "cannot reach the server at http://127.0.0.1:{port}: connection refused"),
    ({"api_key": "wrong-key"}, "auth", "the API key was refused: set benchmark_api_key"),
    ({"api_key": None}, "auth", "the server requires an API key"),
    ({"model": "kimi-k2.5"}, "model", "does not serve model 'kimi-k2.5' (it serves: sim)"),
    ({"input_tokens": 8000}, "length", "exceeds the server's max_model_len (4096)"),
])
def test_probe_bad_input_fails_clearly(sim, over, kind, fragment):
    s = sim(api_key=KEY, max_model_len=4096)
    port = free_port()
    args = dict(url=s.url, model="sim", api_key=KEY, calibration_text=PROMPTS, input_tokens=1024,
                output_tokens=128)
    args.update({k: v for k, v in over.items() if k != "url"})
    if "url" in over:
        args["url"] = f"http://127.0.0.1:{port}"
    result = run_module("benchmark_probe", args)
    assert result.get("failed") is True, result
    assert result["kind"] == kind
    assert fragment.format(port=port) in result["msg"]
    assert KEY not in json.dumps(result) and "wrong-key" not in json.dumps(result)


def test_probe_calibrates_against_the_servers_tokenizer(sim):
    s = sim(api_key=KEY)
    result = run_module("benchmark_probe", dict(url=s.url, model="sim", api_key=KEY, calibration_text=PROMPTS))
    assert result.get("failed") is not True, result
    # the simulator counts one token per 4 bytes of prompt, plus 6 for the chat template
    cal = result["calibration"]
    assert cal["overhead_tokens"] == pytest.approx(6, abs=2)
    assert 0.5 < cal["words_per_token"] < 1.2
    assert result["metrics_available"] is True and result["version"] == "0.0.0+simulator"


@pytest.mark.parametrize("ladder, fragment", [
    ([], "the concurrency list is empty"),
    ([0, 4], "must be positive integers; got 0"),
    ([-8], "must be positive integers; got -8"),
    ([8, 4], "must rise strictly"),
])
def test_run_refuses_a_bad_ladder_before_load(sim, tmp_path, ladder, fragment):
    s = sim(api_key=KEY)
    run_dir = tmp_path / "run"
    result = run_module("benchmark_run", run_args(s.url, run_dir, concurrency=ladder))
    assert result.get("failed") is True and fragment in result["msg"]
    assert not run_dir.exists()
    assert generation_requests(s) == 0


def test_check_mode_plans_and_bounds_without_load(sim, tmp_path):
    s = sim(api_key=KEY)
    run_dir = tmp_path / "run"
    result = run_module("benchmark_run", run_args(s.url, run_dir, concurrency=[1, 8, 32]), check_mode=True)
    assert result.get("failed") is not True, result
    assert result["plan"]["ladder"] == [1, 8, 32]
    assert result["bounds"]["seconds"] > 3 * (0.5 + 0.5 + 6 + 20)
    assert not run_dir.exists() and generation_requests(s) == 0


# --- a ladder: knee where the slots run out, tokens agree with the server's counters --------------
def test_ladder_report_knee_tokens_and_idempotent_report(sim, tmp_path):
    s = sim(api_key=KEY, ttft_ms=20, chunk_ms=10, slots=4)
    run_dir = tmp_path / "results" / "h1" / "sim" / "c0" / "run1"
    result = run_module("benchmark_run", run_args(s.url, run_dir, concurrency=[2, 4, 8]), timeout=300)
    assert result.get("failed") is not True, result
    assert result["status"]["complete"] and result["status"]["steps_measured"] == 3
    report = run_module("benchmark_report", dict(run_dir=str(run_dir), results_root=str(tmp_path / "results"),
                                                 host="h1", model="sim", commit="c0"))
    assert report.get("failed") is not True, report
    steps = {s_["concurrency"]: s_ for s_ in report["summary"]}
    # 4 slots, each 20 ms + 15 x 10 ms per request: the output rate doubles from 2 to 4, then stays
    assert steps[4]["output_throughput"] == pytest.approx(2 * steps[2]["output_throughput"], rel=0.1)
    assert steps[8]["output_throughput"] == pytest.approx(steps[4]["output_throughput"], rel=0.1)
    # the knee of the measured curve is where the slots run out (the report computes it over the
    # steps it trusts; a step the shared machine made the client late on is left out there)
    assert bench_stats.find_knee([(c, v["output_throughput"]) for c, v in steps.items()])["knee_concurrency"] == 4
    if all(v["valid"] for v in steps.values()):
        assert report["saturation"]["knee_concurrency"] == 4
    # beyond the slots, requests queue: TTFT grows by about one request's time
    assert steps[8]["ttft_ms_median"] > steps[4]["ttft_ms_median"] + 100
    # the server's gauges see the queue: more requests than its 4 slots, never more than the 8 streams
    # (a sampled mean; a busy machine leaves a stream between requests now and then, so not exactly 8)
    assert 5 <= steps[8]["server_concurrency"] <= 8.5
    assert report["tokens"]["match"] is True
    assert report["tokens"]["server_generation_tokens"] == report["tokens"]["client_completion_tokens"]
    for name in ("report.json", "steps.csv", "report.md", "throughput.png", "latency.png"):
        assert (run_dir / name).is_file()
    doc = json.loads((run_dir / "report.json").read_text())
    assert doc["schema"] == "modelswap.benchmark/v1" and doc["run"]["host"] == "h1"
    assert KEY not in (run_dir / "config.json").read_text() + (run_dir / "report.json").read_text()
    again = run_module("benchmark_report", dict(run_dir=str(run_dir), results_root=str(tmp_path / "results"),
                                                host="h1", model="sim", commit="c0"))
    assert again["changed"] is False and again["written"] == []


def test_stop_early_when_the_slo_breaks(sim, tmp_path):
    s = sim(api_key=KEY, ttft_ms=20, chunk_ms=10, slots=2)
    run_dir = tmp_path / "run"
    result = run_module("benchmark_run", run_args(s.url, run_dir, concurrency=[1, 2, 4, 8], slo={"ttft_ms": 100}),
                        timeout=300)
    assert result.get("failed") is not True, result
    status = result["status"]
    # at 4 streams on 2 slots every request queues for one request's time (~170 ms) before its first token
    assert status["steps_measured"] == 3
    assert "met the SLOs" in status["stopped_early"] and "concurrency 4" in status["stopped_early"]
    assert any("stopped early" in w for w in warnings(result))


def test_stop_early_on_errors_counts_them_by_kind(sim, tmp_path):
    s = sim(api_key=KEY, ttft_ms=5, chunk_ms=5, fail_every=3)
    run_dir = tmp_path / "run"
    result = run_module("benchmark_run", run_args(s.url, run_dir, concurrency=[1, 2], stop_error_rate=0.1),
                        timeout=300)
    assert result.get("failed") is not True, result
    assert result["status"]["steps_measured"] == 1
    assert result["status"]["stopped_early"].startswith("error rate 3")
    report = run_module("benchmark_report", dict(run_dir=str(run_dir), host="h1", model="sim", plots=False))
    step = json.loads((Path(run_dir) / "report.json").read_text())["steps"][0]
    assert step["requests"]["errors"] == {"http_500": step["requests"]["failed"]}
    assert step["error_rate"] == pytest.approx(1 / 3, abs=0.1)
    assert "errors" in report["summary"][0]["flags"]


def test_run_refuses_cpus_the_load_host_cannot_use(sim, tmp_path):
    import os
    s = sim(api_key=KEY)
    run_dir = tmp_path / "run"
    bad = max(os.sched_getaffinity(0)) + 64
    result = run_module("benchmark_run", run_args(s.url, run_dir, cpu_affinity=[bad]))
    assert result.get("failed") is True and f"cpu_affinity [{bad}] names CPUs" in result["msg"]
    assert not run_dir.exists() and generation_requests(s) == 0


def test_run_pins_the_load_processes_to_the_cpus_given(sim, tmp_path):
    """The load process runs on cpu_affinity's CPUs only (read by the process itself)."""
    import os
    import sys
    s = sim(api_key=KEY, ttft_ms=5, chunk_ms=2, slots=2)
    cpu = max(os.sched_getaffinity(0))
    seen = tmp_path / "affinity.txt"
    locust = [sys.executable, "-c",
              "import os, runpy, sys; "
              f"open({str(seen)!r}, 'w').write(','.join(map(str, sorted(os.sched_getaffinity(0))))); "
              "sys.argv = ['locust'] + sys.argv[1:]; runpy.run_module('locust', run_name='__main__')"]
    result = run_module("benchmark_run", run_args(s.url, tmp_path / "run", concurrency=[1], cpu_affinity=[cpu],
                                                  locust_command=locust), timeout=300)
    assert result.get("failed") is not True, result
    assert seen.read_text() == str(cpu)
