"""Benchmark: the load client's accuracy at the ladder's top (1,024 streams, a chunk every 256 ms
per stream: 4,000 chunks/s), against the known-timing simulator's own record.

    .venv/bin/python tests/bench/bench_client_accuracy.py [--concurrency 1024 512] [--attempts 5]
                                                          [--json FILE]

Each concurrency runs --attempts times (the simulator pinned to one core, the client to the
other, SCHED_RR when root, as in tests/unit/roles/test_benchmark_accuracy.py). For each attempt
it prints whether the report called the step valid, its flags, the client's figures against the
simulator's and the client's event-loop lag; then per concurrency how many attempts were valid
and the worst TTFT-mean and ITL-p99 error among them.

Why it is not in `make test`: at 1,024 streams one load process's event loop runs at its lag limit
on a 2-core machine (p99 5.8-11 ms against 5-6.4 ms), so whether an attempt is valid depends on
the machine of the day; the report flags those steps (`client_lag`), which is the behaviour to
keep, but a test cannot demand a valid one. `make test` runs 512 streams at 2,000 chunks/s (p99
2-3.5 ms here) instead.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from tests.support import bench_accuracy  # noqa: E402


def attempt_figures(cmp: dict) -> dict:
    step, truth, client = cmp["step"], cmp["truth"], cmp["step"]["client"]
    return {"valid": step["valid"], "flags": [f["code"] for f in step["flags"]],
            "ttft_mean_err_ms": step["ttft_ms"]["mean"] - truth["ttft_ms"]["mean"],
            "itl_p99_err_ms": step["itl_ms"]["p99"] - truth["itl_ms"]["p99"],
            "client_lag_p99_ms": client["lag_p99_ms"], "chunk_lag_p99_ms": cmp["chunk_lag_ms"]["p99"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1024, 512])
    ap.add_argument("--attempts", type=int, default=5)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    nice = "rt" if os.geteuid() == 0 else 0
    work = Path(tempfile.mkdtemp(prefix="bench-client-accuracy-"))
    results = {}
    try:
        for c in args.concurrency:
            rows = []
            for attempt in range(args.attempts):
                res = bench_accuracy.run_case(work / f"c{c}-{attempt}", nice=nice, concurrency=c, ttft_ms=50,
                                              chunk_ms=256, chunks=32, measure_s=15, warmup_s=5, ramp_s=10,
                                              timeout=240)
                if res["rc"] != 0:
                    print(f"C={c} attempt {attempt + 1}: the load run failed (rc {res['rc']})")
                    continue
                cmp = bench_accuracy.compare(res["raw"], res["sim_records"])
                print(f"\n[C={c} attempt {attempt + 1}]\n{bench_accuracy.report(cmp)}", flush=True)
                rows.append(attempt_figures(cmp))
            valid = [r for r in rows if r["valid"]]
            results[c] = {"attempts": rows, "valid": len(valid)}
            worst = (f"; worst valid TTFT mean error {max(r['ttft_mean_err_ms'] for r in valid):+.2f} ms, ITL p99 "
                     f"error {max(r['itl_p99_err_ms'] for r in valid):+.2f} ms" if valid else "")
            print(f"\nC={c}: {len(valid)} of {len(rows)} attempts valid{worst}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
