"""Run the benchmark's locustfile against the known-timing simulator and compare what the client
reported with the simulator's own record of when it wrote each chunk (the truth).

Used by tests/unit/roles/test_benchmark_accuracy.py and by hand:
    .venv/bin/python -m tests.support.bench_accuracy --concurrency 128 --chunk-ms 20 --chunks 64
Both processes are children started and stopped by PID; the simulator is pinned to one core and
the client to the other (on a 2-core machine), and each run is bounded in time.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats
from tests.lab.simulator import SimulatorProcess, set_priority

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = REPO / "roles" / "benchmark" / "files" / "locustfile.py"
PROMPTS = REPO / "roles" / "benchmark" / "files" / "prompts.txt"


def cpu_split():
    """(simulator cpus, client cpus): one core each when there are two or more."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        return {cpus[-1]}, {cpus[0]}
    return None, None


def write_config(run_dir: Path, target: str, ladder, **over) -> Path:
    cfg = {"schema": 1, "target": target, "api": "chat", "model": "sim", "input_tokens": 64,
           "output_tokens": 64, "prompt_source": str(PROMPTS), "words_per_token": 0.75,
           "prompt_overhead_tokens": 0, "ladder": list(ladder), "ramp_s": 2, "warmup_s": 2,
           "measure_s": 10, "measure_max_s": 30, "min_requests_per_user": 1,
           "max_requests_per_step": 200000, "request_timeout_s": 60, "drain_timeout_s": 65,
           "metrics_url": f"{target}/metrics", "metrics_interval_s": 1.0, "out_dir": str(run_dir / "raw"),
           "slo": {}, "stop_error_rate": None, "stop_min_good_ratio": None, "seed": 1}
    cfg.update(over)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def run_locust(config: Path, *, cpus=None, nice=0, timeout=300, processes=None, api_key=None):
    """Run the locustfile headless until the ladder ends (bounded by `timeout`); returns rc."""
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
            "--loglevel", "WARNING", "--exit-code-on-error", "0", "--stop-timeout", "60"]
    if processes:
        argv += ["--processes", str(processes)]
    env = dict(os.environ, MODELSWAP_BENCH_CONFIG=str(config))
    if api_key:
        env["MODELSWAP_BENCH_API_KEY"] = api_key

    def pin():
        os.setsid()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        set_priority(nice)

    log = open(config.parent / "locust.log", "ab")
    proc = subprocess.Popen(argv, cwd=config.parent, env=env, preexec_fn=pin, stdout=log, stderr=log)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise
    finally:
        log.close()


def truth_of(sim: dict) -> dict:
    """The simulator's record as a client would ideally have measured it (from receipt)."""
    w = sim["writes"]
    return {"ttft": w[0] - sim["recv"], "e2el": w[-1] - sim["recv"],
            "itl": [b - a for a, b in zip(w, w[1:])], "writes": w, "tokens": sum(sim["tokens"])}


def compare(raw_dir: Path, sim_records: list[dict], step: int = 0) -> dict:
    """Client-reported figures of `step` against the simulator's truth, request by request."""
    raw = bench_stats.load_raw(raw_dir)
    analysis = bench_stats.analyze(raw)
    st = next(s for s in analysis["steps"] if s["step"] == step)
    sims = {r["id"]: r for r in sim_records if not r["aborted"]}
    ttft_err, e2el_err, lag, t_ttft, t_itl, t_tpot, t_e2el = [], [], [], [], [], [], []
    truth_tokens_in_window = 0.0
    windows = bench_stats._windows(raw, step)
    for wid, recs in raw["workers"].items():
        win = windows[wid]
        for r in recs:
            if r.get("k") != "req":
                continue
            sim = sims.get(r["id"])
            if sim is None:
                continue
            for t, n in zip(sim["writes"], sim["tokens"]):
                if win[0] <= t < win[1]:
                    truth_tokens_in_window += n / (win[1] - win[0])
            if r.get("s") != step or r.get("p") != "measure" or not bench_stats.request_success(r):
                continue
            tr = truth_of(sim)
            m = bench_stats.request_metrics(r)
            ttft_err.append(m["ttft"] - tr["ttft"])
            e2el_err.append(m["e2el"] - tr["e2el"])
            lag.extend(r["st"] + off - w for off, w in zip(r["c"], tr["writes"]))
            t_ttft.append(tr["ttft"])
            t_e2el.append(tr["e2el"])
            t_itl.extend(tr["itl"])
            if tr["tokens"] > 1:
                t_tpot.append((tr["e2el"] - tr["ttft"]) / (tr["tokens"] - 1))
    # window throughput counts tokens per worker window; with one process the sum above is exact
    truth = {"ttft_ms": bench_stats.summarize(t_ttft, 1000), "itl_ms": bench_stats.summarize(t_itl, 1000),
             "tpot_ms": bench_stats.summarize(t_tpot, 1000), "e2el_ms": bench_stats.summarize(t_e2el, 1000),
             "output_throughput": truth_tokens_in_window}
    return {"step": st, "truth": truth, "matched": len(ttft_err), "truth_ttfts_ms": [x * 1000.0 for x in t_ttft],
            "ttft_err_ms": bench_stats.summarize(ttft_err, 1000), "e2el_err_ms": bench_stats.summarize(e2el_err, 1000),
            "chunk_lag_ms": bench_stats.summarize(lag, 1000), "analysis": analysis}


def run_case(workdir: Path, *, concurrency, ttft_ms=50.0, chunk_ms=20.0, chunks=64, tokens_per_chunk=1,
             slots=0, measure_s=10, warmup_s=2, ramp_s=2, nice=0, timeout=240, api="chat",
             processes=None, config=None) -> dict:
    """One load run against a fresh simulator; ``config``: more of the locustfile's settings (a
    rate ladder's mode, rates, burstiness, limits, search)."""
    sim_cpus, client_cpus = cpu_split()
    with SimulatorProcess(workdir / "sim", cpus=sim_cpus, nice=nice, max_seconds=timeout + 30,
                          ttft_ms=ttft_ms, chunk_ms=chunk_ms, tokens_per_chunk=tokens_per_chunk,
                          slots=slots) as sim:
        cfg = write_config(workdir / "run", sim.url, [concurrency] if isinstance(concurrency, int)
                           else concurrency, output_tokens=chunks * tokens_per_chunk,
                           measure_s=measure_s, warmup_s=warmup_s, ramp_s=ramp_s, api=api,
                           measure_max_s=max(30, measure_s * 3), **(config or {}))
        t = time.monotonic()
        rc = run_locust(cfg, cpus=client_cpus, nice=nice, timeout=timeout, processes=processes)
        took = time.monotonic() - t
    records = sim.records()
    return {"rc": rc, "seconds": took, "raw": workdir / "run" / "raw", "sim_records": records}


def report(cmp: dict) -> str:
    s, t = cmp["step"], cmp["truth"]

    def f(x):
        return "-" if x is None else f"{x:.2f}"
    lines = [
        f"{'C=%s' % s['concurrency'] if s['concurrency'] is not None else '%g req/s' % s['rate']['offered']} "
        f"matched={cmp['matched']} valid={s['valid']} flags={[x['code'] for x in s['flags']]}",
        f"TTFT ms  client mean {f(s['ttft_ms']['mean'])} p99 {f(s['ttft_ms']['p99'])} | truth mean "
        f"{f(t['ttft_ms']['mean'])} p99 {f(t['ttft_ms']['p99'])} | per-request error mean "
        f"{f(cmp['ttft_err_ms']['mean'])} p99 {f(cmp['ttft_err_ms']['p99'])}",
        f"ITL ms   client mean {f(s['itl_ms']['mean'])} p50 {f(s['itl_ms']['median'])} p99 {f(s['itl_ms']['p99'])}"
        f" | truth mean {f(t['itl_ms']['mean'])} p50 {f(t['itl_ms']['median'])} p99 {f(t['itl_ms']['p99'])}",
        f"TPOT ms  client mean {f(s['tpot_ms']['mean'])} | truth mean {f(t['tpot_ms']['mean'])}",
        f"out tok/s client {f(s['output_throughput'])} | truth {f(t['output_throughput'])}",
        f"chunk lag ms mean {f(cmp['chunk_lag_ms']['mean'])} p99 {f(cmp['chunk_lag_ms']['p99'])} max "
        f"{f(cmp['chunk_lag_ms']['max'])}; client cpu {f(s['client']['cpu_mean_max'])} lag mean "
        f"{f(s['client']['lag_mean_ms'])} p99 {f(s['client']['lag_p99_ms'])} max {f(s['client']['lag_max_ms'])} ms "
        f"preempted/s {f(s['client']['preempted_per_s'])}; server conc {f((s['server'] or {}).get('concurrency_mean'))}",
    ]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default="/tmp/modelswap-bench-accuracy")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--ttft-ms", type=float, default=50)
    p.add_argument("--chunk-ms", type=float, default=20)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--slots", type=int, default=0)
    p.add_argument("--measure-s", type=float, default=10)
    p.add_argument("--nice", default=0)
    p.add_argument("--processes", type=int)
    a = p.parse_args()
    wd = Path(a.workdir)
    import shutil
    shutil.rmtree(wd, ignore_errors=True)
    res = run_case(wd, concurrency=a.concurrency, ttft_ms=a.ttft_ms, chunk_ms=a.chunk_ms, chunks=a.chunks,
                   tokens_per_chunk=a.tokens_per_chunk, slots=a.slots, measure_s=a.measure_s, nice=a.nice,
                   processes=a.processes)
    cmp = compare(res["raw"], res["sim_records"])
    print(f"rc={res['rc']} took {res['seconds']:.1f}s")
    print(report(cmp))


if __name__ == "__main__":
    main()
