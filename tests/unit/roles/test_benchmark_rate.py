"""The rate ladder against the known-timing simulator: an open loop on schedule, its figures
against the simulator's own record, and the capacity search against a capacity known by design.

The simulator serves 4 slots, each request 50 ms to its first chunk and 15 more chunks 20 ms
apart: 350 ms a slot, so 4 / 0.35 = 11.4 requests per second is the most it sustains. With
arrivals almost regular (burstiness 1000) no request waits below that rate, and the queue grows
without bound above it: TTFT p99 <= 150 ms holds up to 11.4 req/s and not beyond. The truth of
each step is the simulator's record (receipt to first chunk written), judged by the same rule.
"""
from __future__ import annotations

import os

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import rate_ladder
from tests.support import bench_accuracy

# serial: a test beside these would delay the client's event loop they measure
pytestmark = [pytest.mark.unit, pytest.mark.serial]

SLOTS, TTFT_MS, CHUNK_MS, CHUNKS = 4, 50, 20, 16
CAPACITY = SLOTS / ((TTFT_MS + (CHUNKS - 1) * CHUNK_MS) / 1000.0)        # 11.43 req/s
LIMITS = rate_ladder.parse_slo({"ttft_p99": "150 ms"})
ATTEMPTS = 3
PRIORITY = "rt" if os.geteuid() == 0 else 0


def within(client, truth, rel=0.02, abs_ms=2.0):
    return abs(client - truth) <= max(abs_ms, rel * abs(truth))


def truth_verdict(cmp):
    """The simulator's own TTFTs of the step's matched requests, judged by the SLO's rule."""
    ttfts = cmp["truth_ttfts_ms"]
    return rate_ladder.over_share(ttfts, LIMITS["ttft_p99_ms"]) <= 0.01 + 1e-12


def run_search(tmp_path, name):
    res = bench_accuracy.run_case(
        tmp_path / name, nice=PRIORITY, concurrency=[4, 8, 16], slots=SLOTS, ttft_ms=TTFT_MS,
        chunk_ms=CHUNK_MS, chunks=CHUNKS, measure_s=8, warmup_s=2, ramp_s=1, timeout=280,
        config={"mode": "rate", "burstiness": 1000.0, "max_inflight": 0, "limits": LIMITS, "search_bisections": 2})
    assert res["rc"] == 0, (tmp_path / name / "run" / "locust.log").read_text()[-3000:]
    return res, bench_stats.analyze(bench_stats.load_raw(res["raw"]))


def test_the_capacity_search_brackets_the_simulators_capacity_and_each_step_is_accurate(tmp_path):
    notes = []
    for attempt in range(ATTEMPTS):
        res, analysis = run_search(tmp_path, f"search-{attempt}")
        steps = analysis["steps"]
        # the sweep until a rate fails, then two bisections: 4, 8 pass; 16 fails; 12 fails; 10 passes
        assert [s["rate"]["offered"] for s in steps] == [4, 8, 16, 12, 10], [s["rate"] for s in steps]
        cap = analysis["capacity"]
        assert cap["rate"] == 10 and cap["first_failing_rate"] == 12, cap
        assert cap["rate"] <= CAPACITY < cap["first_failing_rate"]
        assert rate_ladder.headline("sim", cap) == "sim holds 10 req/s at TTFT p99 <= 150 ms (misses it at 12 req/s)"
        bad = []
        for st in steps:
            cmp = bench_accuracy.compare(res["raw"], res["sim_records"], st["step"])
            rate = st["rate"]
            print(f"\n[{attempt + 1}] {rate['offered']:g} req/s: achieved {rate['achieved']:.2f}, dispatch delay p99 "
                  f"{rate['dispatch_delay_ms']['p99']:.2f} ms, verdict {st.get('slo_verdict')}\n"
                  f"{bench_accuracy.report(cmp)}")
            if not st["valid"]:
                bad.append(f"{rate['offered']:g} req/s flagged " + ", ".join(
                    f["code"] for f in st["flags"] if f["severity"] == "invalid"))
                continue
            # the client's verdict is the truth's
            if st["slo_verdict"]["passed"] != truth_verdict(cmp):
                bad.append(f"{rate['offered']:g} req/s: verdict {st['slo_verdict']} against the truth's")
            s, t = cmp["step"], cmp["truth"]
            for what, c, tr in (("TTFT mean", s["ttft_ms"]["mean"], t["ttft_ms"]["mean"]),
                                ("TTFT p99", s["ttft_ms"]["p99"], t["ttft_ms"]["p99"]),
                                ("ITL mean", s["itl_ms"]["mean"], t["itl_ms"]["mean"]),
                                ("ITL p99", s["itl_ms"]["p99"], t["itl_ms"]["p99"]),
                                ("E2EL mean", s["e2el_ms"]["mean"], t["e2el_ms"]["mean"]),
                                ("E2EL p99", s["e2el_ms"]["p99"], t["e2el_ms"]["p99"])):
                if not within(c, tr):
                    bad.append(f"{rate['offered']:g} req/s {what}: client {c:.2f} ms, truth {tr:.2f} ms")
        if not bad:
            return
        notes.append(f"attempt {attempt + 1}: {bad}")
    pytest.fail(f"no attempt was both valid and accurate at every rate: {notes}")
