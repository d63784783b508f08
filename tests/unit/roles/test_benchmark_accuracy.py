"""Accuracy of the benchmark's client against the known-timing simulator's own record.

The truth is the simulator's record of when it wrote each chunk (and when it received each
request), matched to the client's records by request id - not its nominal settings. The
simulator and the client are pinned to different cores and run with SCHED_RR priority 1 where
the OS allows (root): other processes on this shared 2-core machine then cannot preempt the
timing. What they cannot stop is the hypervisor taking a core away (steal, a few % here): when
it takes the client's core, the client's event loop runs late and the report flags the step
(`client_lag`); when it takes the simulator's core right after a write, the chunk reaches the
client late although the record says it was written on time. Either can spoil one attempt, so a
case passes when one of three attempts is reported valid and is accurate; each attempt's figures
are printed, and a case fails with all of them when none is.
"""
from __future__ import annotations

import os
import shutil

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats
from tests.support import bench_accuracy

# serial: a test beside these would delay the client's event loop they measure
pytestmark = [pytest.mark.unit, pytest.mark.serial]

PRIORITY = "rt" if os.geteuid() == 0 else 0
ATTEMPTS = 3


def within(client, truth, abs_ms=2.0, rel=0.05):
    return abs(client - truth) <= max(abs_ms, rel * abs(truth))


def check_accuracy(cmp, *, ttft_mean_bar=None, itl_p99_bar=None, ttft_abs_ms=2.0):
    """The client's figures against the truth: list of failures (empty when accurate). Every figure
    within 5 % or 2 ms of the truth (TTFT within `ttft_abs_ms` when a case sets a looser bar), and
    the case's own bars on the mean TTFT error and the ITL p99 error."""
    s, t = cmp["step"], cmp["truth"]
    bad = []
    pairs = [("TTFT mean", s["ttft_ms"]["mean"], t["ttft_ms"]["mean"], ttft_abs_ms),
             ("TTFT median", s["ttft_ms"]["median"], t["ttft_ms"]["median"], ttft_abs_ms),
             ("ITL mean", s["itl_ms"]["mean"], t["itl_ms"]["mean"], 2.0),
             ("ITL median", s["itl_ms"]["median"], t["itl_ms"]["median"], 2.0),
             ("ITL p99", s["itl_ms"]["p99"], t["itl_ms"]["p99"], 2.0),
             ("TPOT mean", s["tpot_ms"]["mean"], t["tpot_ms"]["mean"], 2.0)]
    for name, c, tr, abs_ms in pairs:
        if not within(c, tr, abs_ms=abs_ms):
            bad.append(f"{name}: client {c:.2f} ms, truth {tr:.2f} ms")
    if not within(s["output_throughput"], t["output_throughput"], abs_ms=0.0):
        bad.append(f"output throughput: client {s['output_throughput']:.1f}, truth {t['output_throughput']:.1f} tok/s")
    if ttft_mean_bar is not None and cmp["ttft_err_ms"]["mean"] > ttft_mean_bar:
        bad.append(f"TTFT mean error +{cmp['ttft_err_ms']['mean']:.2f} ms > +{ttft_mean_bar} ms")
    if itl_p99_bar is not None and s["itl_ms"]["p99"] - t["itl_ms"]["p99"] > itl_p99_bar:
        bad.append(f"ITL p99 error +{s['itl_ms']['p99'] - t['itl_ms']['p99']:.2f} ms > +{itl_p99_bar} ms")
    return bad


def measure(tmp_path, name, *, bars=None, attempts=ATTEMPTS, also=None, **case):
    """Run a case until an attempt is reported valid and is accurate (at most `attempts`);
    `also(cmp)` lists a case's own failures beyond check_accuracy's."""
    notes = []
    for attempt in range(attempts):
        wd = tmp_path / f"{name}-{attempt}"
        shutil.rmtree(wd, ignore_errors=True)
        res = bench_accuracy.run_case(wd, nice=PRIORITY, **case)
        assert res["rc"] == 0, (wd / "run" / "locust.log").read_text()[-3000:]
        cmp = bench_accuracy.compare(res["raw"], res["sim_records"])
        print(f"\n[{name} attempt {attempt + 1}]\n{bench_accuracy.report(cmp)}")
        assert cmp["matched"] >= 20, "too few measured requests matched the simulator's record"
        step = cmp["step"]
        lag = cmp["chunk_lag_ms"]
        where = (f"chunk delivery (client arrival - simulator write) p99 {lag['p99']:.1f} ms, max "
                 f"{lag['max']:.1f} ms")
        if not step["valid"]:
            notes.append(f"attempt {attempt + 1} flagged: " + ", ".join(
                f["message"] for f in step["flags"] if f["severity"] == "invalid") + f"; {where}")
            continue
        bad = check_accuracy(cmp, **(bars or {})) + (also(cmp) if also else [])
        if not bad:
            return cmp
        notes.append(f"attempt {attempt + 1} valid but off: {bad}; {where}")
    pytest.fail(f"{name}: no attempt was both reported valid and accurate: {notes}")


def test_one_token_chunks_chat(tmp_path):
    cmp = measure(tmp_path, "c16", concurrency=16, ttft_ms=50, chunk_ms=20, chunks=32, measure_s=8)
    assert cmp["step"]["server"]["concurrency_mean"] == pytest.approx(16, abs=0.5)


def test_multi_token_chunks_completions(tmp_path):
    # 4 tokens per chunk: ITL is per chunk (25 ms), TPOT per token (~6.25 ms), usage counts tokens
    cmp = measure(tmp_path, "multi", concurrency=24, ttft_ms=40, chunk_ms=25, chunks=24, tokens_per_chunk=4,
                  measure_s=8, api="completions")
    s = cmp["step"]
    assert s["output_tokens_mean"] == 96
    assert s["itl_ms"]["median"] == pytest.approx(25, abs=2)
    assert s["tpot_ms"]["mean"] == pytest.approx(cmp["truth"]["tpot_ms"]["mean"], abs=0.5)
    assert s["tpot_ms"]["mean"] < s["itl_ms"]["median"] / 3


def test_saturated_server_with_queueing(tmp_path):
    # 48 streams on 16 slots: every request waits about two requests' time for a slot
    cmp = measure(tmp_path, "queue", concurrency=48, slots=16, ttft_ms=30, chunk_ms=10, chunks=32, measure_s=8)
    s, t = cmp["step"], cmp["truth"]
    assert t["ttft_ms"]["median"] > 500                       # the truth includes the queue
    assert s["server"]["waiting_mean"] == pytest.approx(32, abs=2)
    assert s["littles_law"]["ratio"] == pytest.approx(1.0, abs=0.1)


def test_c128_at_20ms_chunks_meets_the_bar(tmp_path):
    # 6.4k chunks/s: the bar measured here is +7 ms TTFT mean and +2 ms ITL p99 (docs/benchmarking.md)
    cmp = measure(tmp_path, "c128", bars={"ttft_mean_bar": 7.0, "itl_p99_bar": 2.0}, concurrency=128,
                  ttft_ms=50, chunk_ms=20, chunks=64, measure_s=10)
    assert cmp["step"]["requests"]["completed"] > 500


def _server_saw(streams):
    def check(cmp):
        seen = cmp["step"]["server"]["concurrency_mean"]
        return [] if seen == pytest.approx(streams, abs=5) else [f"the server saw {seen:.1f} streams, not {streams}"]
    return check


def test_512_streams_a_sample_of_the_ladders_top(tmp_path):
    # 512 streams, 2,000 chunks/s in all (a chunk every 256 ms per stream): at most +10 ms TTFT mean.
    # The ladder's top, 1,024 streams, puts one load process's event loop at its lag limit on a 2-core machine
    # (p99 5.8-11 ms against 5 ms): whether such a step is valid depends on the machine of the day, so
    # that scale is measured by tests/bench/bench_client_accuracy.py; here the loop's p99 is 2-3.5 ms.
    measure(tmp_path, "c512", bars={"ttft_mean_bar": 10.0, "ttft_abs_ms": 10.0},
            also=_server_saw(512), concurrency=512, ttft_ms=50, chunk_ms=256, chunks=32, measure_s=15,
            warmup_s=5, ramp_s=10, timeout=240)


def test_knee_is_where_the_slots_run_out(tmp_path):
    for attempt in range(ATTEMPTS):
        wd = tmp_path / f"knee-{attempt}"
        res = bench_accuracy.run_case(wd, nice=PRIORITY, concurrency=[4, 8, 16, 32], slots=16, ttft_ms=20, chunk_ms=10,
                                      chunks=16, measure_s=4, warmup_s=1, ramp_s=1)
        analysis = bench_stats.analyze(bench_stats.load_raw(res["raw"]))
        steps = {s["concurrency"]: s for s in analysis["steps"]}
        print({c: (round(s["output_throughput"]), s["valid"]) for c, s in steps.items()})
        # linear up to the slots, flat beyond (at exactly 16 a slot idles for the client's turnaround
        # after each request; with a queue it never does, so 32 may be a few % above 16)
        assert steps[16]["output_throughput"] == pytest.approx(4 * steps[4]["output_throughput"], rel=0.1)
        assert steps[32]["output_throughput"] == pytest.approx(steps[16]["output_throughput"], rel=0.1)
        assert steps[8]["output_throughput"] < 0.6 * steps[32]["output_throughput"]
        if all(s["valid"] for s in steps.values()):
            assert analysis["saturation"]["knee_concurrency"] == 16
            assert analysis["saturation"]["saturated"] is True
            return
    pytest.fail("every attempt had a step flagged invalid: the knee was not checked on trusted steps")


def test_a_saturated_client_is_flagged_not_reported(tmp_path):
    # ~100k chunks/s: far beyond one load process; the step must be flagged invalid
    res = bench_accuracy.run_case(tmp_path / "sat", nice=0, concurrency=96, ttft_ms=1, chunk_ms=1, chunks=64, measure_s=5,
                                  warmup_s=1, ramp_s=1)
    analysis = bench_stats.analyze(bench_stats.load_raw(res["raw"]))
    step = analysis["steps"][0]
    codes = {f["code"] for f in step["flags"]}
    assert step["valid"] is False
    assert codes & {"client_cpu_saturated", "client_lag"}
    assert analysis["saturation"]["knee_concurrency"] is None
    # the flag says by how much: what one process received, and the processes the step needs
    cl = step["client"]
    [message] = [f["message"] for f in step["flags"] if f["code"] in ("client_cpu_saturated", "client_lag")][:1]
    assert f"one load process received {cl['chunks_per_s_total']:,.0f} chunks/s at " in message, message
    needed = int(message.split("need about ")[1].split()[0])
    assert needed >= 2 and f"set benchmark_processes to {needed}" in message
