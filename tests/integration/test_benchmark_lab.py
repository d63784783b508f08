"""The benchmark role against real vLLM (CPU) on a lab host, over SSH: a short ladder run from the
controller through playbooks/benchmark.yml; the report's token counts agree with vLLM's own
/metrics counters, and its figures follow the stream vLLM really sent.

vLLM is brought up by the lab smoke playbook (tests/lab/playbooks/lab_serve.yml) on one host and
stopped after; gpu2 by default, so it does not collide with the vllm_service tests on gpu1
(MODELSWAP_BENCH_LAB_HOST overrides).
"""
from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.vllm]

SERVE = "tests/lab/playbooks/lab_serve.yml"
HOST = os.environ.get("MODELSWAP_BENCH_LAB_HOST", "gpu2")
OUTPUT_TOKENS = 32


def generation_tokens(url: str) -> float:
    """vllm:generation_tokens_total of tiny-a, read directly from the server."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return sum(float(line.split()[-1]) for line in resp.read().decode().splitlines()
                   if line.startswith("vllm:generation_tokens_total{") and 'model_name="tiny-a"' in line)


@pytest.fixture(scope="module")
def vllm(lab):
    started = lab.playbook(SERVE, {"lab_serve_hosts": HOST, "lab_serve_model": "tiny-a"})
    try:
        assert started.rc == 0, started.stdout[-4000:]
        yield f"http://{lab.address(HOST)}:8000"
    finally:
        stopped = lab.playbook(SERVE, {"lab_serve_hosts": HOST, "lab_serve_state": "stopped"})
        assert stopped.rc == 0, stopped.stdout[-3000:]


def test_short_ladder_against_real_vllm(lab, vllm, tmp_path):
    results = tmp_path / "results"
    before = generation_tokens(vllm)      # read here, independently of the benchmark
    run = lab.playbook("playbooks/benchmark.yml", {
        "benchmark_hosts": HOST, "benchmark_port": 8000, "benchmark_model": "tiny-a",
        "benchmark_concurrency": [1, 4, 16], "benchmark_input_tokens": 64, "benchmark_output_tokens": OUTPUT_TOKENS,
        "benchmark_ramp_s": 2, "benchmark_warmup_s": 3, "benchmark_measure_s": 10, "benchmark_measure_max_s": 30,
        "benchmark_min_requests_per_user": 2, "benchmark_request_timeout_s": 120,
        "benchmark_results_dir": str(results), "benchmark_scheduling": "realtime",
        "benchmark_deployment": {"model": "tiny-a", "commit": lab.models["tiny-a"]["commit"],
                                 "vllm_args": {"dtype": "float32", "max_model_len": 512, "enforce_eager": True}},
    })
    assert run.rc == 0, run.stdout[-5000:]
    [report] = sorted((results / HOST / "tiny-a" / lab.models["tiny-a"]["commit"]).glob("*/report.json"))
    doc = json.loads(report.read_text())

    # the ladder ran to its end, every step measured
    assert doc["run"]["complete"] and doc["run"]["stopped_early"] is None
    assert [s["concurrency"] for s in doc["steps"]] == [1, 4, 16]
    # token counts: the client's usage sums equal vLLM's counter over the run (first sample before
    # any load, last after every request ended) ...
    tok = doc["tokens"]
    assert tok["match"] is True, tok
    assert tok["server_generation_tokens"] == tok["client_completion_tokens"] > 0
    # ... and the benchmark's first sample is the counter this test read, plus the preflight's
    # two one-token requests (other lab tests may stop this vLLM once the run is over, so the
    # counter is not read again here)
    samples = [json.loads(line) for line in (report.parent / "raw" / "master.jsonl").open()]
    first = next(s for s in samples if s["k"] == "srv" and s["ok"])
    assert first["gen"] - before == 2
    for s in doc["steps"]:
        assert s["requests"]["failed"] == 0, s["requests"]
        assert s["output_tokens_mean"] == OUTPUT_TOKENS                     # ignore_eos, usage counts
        assert 40 <= s["input_tokens_mean"] <= 90                          # calibrated from natural text
        assert s["ttft_ms"]["median"] > 0 and s["itl_ms"]["median"] > 0
        assert s["server"] is not None and s["server"]["samples"] >= 3
        # the engine saw the offered load arrive (running + waiting): most of it at low C; at 16
        # this CPU lab's frontend holds a large, load-dependent share (the report says so)
        if s["concurrency"] <= 4:
            assert s["server"]["concurrency_mean"] >= 0.5 * s["concurrency"]
        assert s["client"]["inflight_mean"] == pytest.approx(s["concurrency"], rel=0.1)
    server = [s["server"]["concurrency_mean"] for s in doc["steps"]]
    assert server == sorted(server) and server[-1] > server[0], server
    # the deployment record: what the inventory says and what vLLM says about itself
    dep = doc["deployment"]
    assert dep["vllm_version"].startswith("0.32.0") and dep["commit"] == lab.models["tiny-a"]["commit"]
    assert dep["max_model_len"] == 512
    for name in ("steps.csv", "report.md", "throughput.png", "latency.png"):
        assert (report.parent / name).is_file()
    # raw records are the stream vLLM sent: the role delta first, then one chunk per token
    raw = [json.loads(line) for f in (report.parent / "raw").glob("worker-*.jsonl") for line in f.open()]
    reqs = [r for r in raw if r["k"] == "req" and r["p"] == "measure"]
    assert reqs and all(r["r"] and r["d"] and r["f"] == "length" for r in reqs)
    assert all(2 <= len(r["c"]) <= OUTPUT_TOKENS + 1 for r in reqs)
    print(Path(report.parent / "report.md").read_text())
