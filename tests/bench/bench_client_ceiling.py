"""Benchmark: how many streamed chunks per second each load client can take, side by side in one
run, against the known-timing simulator with zero delay (it writes chunks as fast as it can).

    .venv/bin/python tests/bench/bench_client_ceiling.py [--concurrency 64] [--chunks 256] [--seconds 15]

Clients, each alone in turn against the same simulator, closed loop at --concurrency streams of
--chunks one-token chunks (/v1/completions, stream, include_usage, ignore_eos):

  locust (benchmark role)   the role's locustfile (FastHttpUser's HTTP stack, one SSE line at a
                            time), one process; its own window throughput from its raw records
  locust --processes N      the same with N worker processes (--processes, optional)
  vllm bench serve          `vllm bench serve --backend openai --max-concurrency C`, from the vLLM
                            virtualenv at --vllm-venv (/tmp/vllm-offline, built from the lab's
                            wheelhouse); skipped, and said so, when absent
  aiohttp (+uvloop)         a plain asyncio client doing the same work (parse every chunk's JSON,
                            stamp its arrival), run with the vLLM virtualenv's Python (it has
                            aiohttp and uvloop); skipped when neither it nor this Python has aiohttp

The simulator is pinned to the last core and every client to the first (2-core machine: one core
each); every process is a child stopped by PID and bounded in time. Prints chunks/s, requests/s and
the client's CPU share; --json writes them too. Run by hand, not in the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats  # noqa: E402
from tests.lab.simulator import SimulatorProcess  # noqa: E402
from tests.support import bench_accuracy  # noqa: E402

AIOHTTP_CLIENT = textwrap.dedent('''
    import asyncio, json, sys, time
    import aiohttp
    try:
        import uvloop
        uvloop.install()
        LOOP = "uvloop"
    except ImportError:
        LOOP = "asyncio"

    URL, C, N, SECONDS, WARMUP = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])

    async def user(session, stats, t_end, t0, t1):
        body = {"model": "sim", "prompt": "hello " * 32, "max_tokens": N, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        while time.perf_counter() < t_end:
            st = time.perf_counter()
            arrivals = []
            async with session.post(URL + "/v1/completions", json=body) as resp:
                buf = b""
                async for data in resp.content.iter_any():      # what vllm bench serve does
                    now = time.perf_counter()
                    buf += data
                    *events, buf = buf.split(b"\\n\\n")
                    for ev in events:
                        ev = ev.strip()
                        if not ev.startswith(b"data:"):
                            continue
                        payload = ev[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        obj = json.loads(payload)
                        if obj.get("choices"):
                            arrivals.append(now)
            stats["chunks"] += sum(1 for a in arrivals if t0 <= a < t1)
            if arrivals and t0 <= arrivals[-1] < t1:
                stats["requests"] += 1

    async def main():
        stats = {"chunks": 0, "requests": 0}
        start = time.perf_counter()
        t0, t1 = start + WARMUP, start + WARMUP + SECONDS
        conn = aiohttp.TCPConnector(limit=C)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
            await asyncio.gather(*(user(s, stats, t1, t0, t1) for _ in range(C)))
        print(json.dumps({"chunks_per_s": stats["chunks"] / SECONDS, "requests_per_s": stats["requests"] / SECONDS,
                          "loop": LOOP}))

    asyncio.run(main())
''')


def pinned(cpus):
    def pre():
        os.setsid()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    return pre


def run_child(argv, *, cpus, timeout, env=None, cwd=None):
    """Run a client; return (stdout, cpu share of one core over its wall time)."""
    t = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=pinned(cpus), env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{argv[0]} passed its {timeout} s bound and was killed")
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} exited {proc.returncode}: {err[-2000:]}")
    return out, cpu / wall


def locust_client(url, work, args, client_cpus, processes=None):
    name = f"locust{'-p' + str(processes) if processes else ''}"
    cfg = bench_accuracy.write_config(work / name, url, [args.concurrency], api="completions", output_tokens=args.chunks,
                                      input_tokens=32, ramp_s=1, warmup_s=2, measure_s=args.seconds,
                                      measure_max_s=args.seconds, min_requests_per_user=0, metrics_url=None)
    t = time.monotonic()
    rc = bench_accuracy.run_locust(cfg, cpus=client_cpus, timeout=args.seconds + 120, processes=processes)
    wall = time.monotonic() - t
    if rc != 0:
        raise RuntimeError(f"locust exited {rc}: {(cfg.parent / 'locust.log').read_text()[-2000:]}")
    raw = bench_stats.load_raw(cfg.parent / "raw")
    step = bench_stats.analyze(raw)["steps"][0]
    cpu = step["client"]["cpu_mean_max"]
    return {"client": f"locust (benchmark role){' --processes ' + str(processes) if processes else ''}",
            "chunks_per_s": step["output_throughput"], "requests_per_s": step["request_throughput"],
            "cpu": cpu if not processes else None, "valid": step["valid"], "wall_s": wall}


def vllm_bench(url, work, args, client_cpus, tokenizer):
    vllm = Path(args.vllm_venv) / "bin" / "vllm"
    if not vllm.exists():
        return {"client": "vllm bench serve", "skipped": f"no vLLM at {args.vllm_venv}"}
    n = int(args.expect_rps * args.seconds) or 1000
    result_dir = work / "vllm-bench"
    result_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", "sim", "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", str(args.chunks), "--num-prompts", str(n), "--max-concurrency",
            str(args.concurrency), "--request-rate", "inf", "--ignore-eos", "--disable-tqdm", "--save-result",
            "--result-dir", str(result_dir), "--result-filename", "result.json"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=str(work / "vllm-cache"), HF_HOME=str(work / "hf"))
    _out, cpu = run_child(argv, cpus=client_cpus, timeout=args.seconds * 6 + 180, env=env)
    res = json.loads((result_dir / "result.json").read_text())
    return {"client": "vllm bench serve", "chunks_per_s": res["output_throughput"],
            "requests_per_s": res["request_throughput"], "cpu": cpu, "duration_s": res["duration"],
            "completed": res["completed"], "note": f"{n} prompts, its own duration (incl. start and drain); "
                                                   "CPU over its whole process life (start-up included)"}


def aiohttp_client(url, work, args, client_cpus):
    candidates = [Path(args.vllm_venv) / "bin" / "python", Path(sys.executable)]
    for py in candidates:
        if py.exists() and subprocess.run([str(py), "-c", "import aiohttp"], capture_output=True).returncode == 0:
            script = work / "aiohttp_client.py"
            script.write_text(AIOHTTP_CLIENT)
            out, cpu = run_child([str(py), str(script), url, str(args.concurrency), str(args.chunks),
                                  str(args.seconds), "2"], cpus=client_cpus, timeout=args.seconds + 60)
            res = json.loads(out.strip().splitlines()[-1])
            return {"client": f"aiohttp + {res['loop']}", "chunks_per_s": res["chunks_per_s"],
                    "requests_per_s": res["requests_per_s"], "cpu": cpu, "python": str(py)}
    return {"client": "aiohttp", "skipped": "no Python with aiohttp (the vLLM virtualenv has it)"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--processes", type=int, default=0, help="also run Locust with --processes N")
    p.add_argument("--vllm-venv", default="/tmp/vllm-offline")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    sim_cpus, client_cpus = bench_accuracy.cpu_split()
    work = Path(tempfile.mkdtemp(prefix="modelswap-ceiling-"))
    rows = []
    try:
        from tests.lab.models.make_models import build_model
        tokenizer = build_model("tiny-a", work / "tiny-a")      # vllm bench serve needs a tokenizer
        with SimulatorProcess(work / "sim", cpus=sim_cpus, ttft_ms=0, chunk_ms=0, max_seconds=1800) as sim:
            print(f"simulator on CPUs {sim_cpus}, clients on {client_cpus}; C={args.concurrency}, "
                  f"{args.chunks} chunks per request, {args.seconds:.0f} s each", flush=True)
            loc = locust_client(sim.url, work, args, client_cpus)
            rows.append(loc)
            print(rows[-1], flush=True)
            args.expect_rps = loc["requests_per_s"]
            if args.processes:
                rows.append(locust_client(sim.url, work, args, client_cpus=None, processes=args.processes))
                print(rows[-1], flush=True)
            rows.append(vllm_bench(sim.url, work, args, client_cpus, tokenizer))
            print(rows[-1], flush=True)
            rows.append(aiohttp_client(sim.url, work, args, client_cpus))
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{'client':38} {'chunks/s':>10} {'req/s':>8} {'CPU':>6}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['client']:38} skipped: {r['skipped']}")
            continue
        cpu = "-" if r.get("cpu") is None else f"{r['cpu']:.0%}"
        print(f"{r['client']:38} {r['chunks_per_s']:>10,.0f} {r['requests_per_s']:>8,.1f} {cpu:>6}")
    ref = next((r for r in rows if r["client"] == "vllm bench serve" and "skipped" not in r), None)
    if ref:
        ratio = rows[0]["chunks_per_s"] / ref["chunks_per_s"]
        print(f"\nLocust / vllm bench serve: {ratio:.2f} ({'meets' if ratio >= 1 else 'below'} the goal)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
