"""The rate ladder's arithmetic: the SLO with its units, the arrivals, the capacity search."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import rate_ladder as R

pytestmark = pytest.mark.unit


def test_the_slo_is_read_with_its_units():
    assert R.parse_slo({"ttft_p99": "2 s", "itl_p99": "80ms", "e2el_p99": "1.5 min", "error_rate": "0.5%"}) == {
        "ttft_p99_ms": 2000.0, "itl_p99_ms": 80.0, "e2el_p99_ms": 90000.0, "error_rate": 0.005}
    assert R.parse_slo({}) == {} and R.parse_slo(None) == {}
    assert R.slo_words(R.parse_slo({"ttft_p99": "2 s", "itl_p99": "80 ms", "error_rate": "1%"})) == \
        "TTFT p99 <= 2 s, ITL p99 <= 80 ms, errors <= 1%"


@pytest.mark.parametrize("slo, words", [
    ({"ttft_p99": 2}, "slo.ttft_p99 is 2: give a duration with its unit, e.g. '2 s' or '80 ms'"),
    ({"itl_p99": "80"}, "slo.itl_p99 is '80': give a duration with its unit"),
    ({"itl_p99": "80 furlongs"}, "give a duration with its unit"),
    ({"e2el_p99": "0 s"}, "slo.e2el_p99 is '0 s': a limit must be above 0"),
    ({"error_rate": 0.01}, "slo.error_rate is 0.01: give a percentage, e.g. '1%'"),
    ({"error_rate": "100%"}, "a share of errors must be at least 0% and below 100%"),
    ({"ttft_p95": "1 s"}, "the SLO has unknown key(s) ttft_p95: use ttft_p99, itl_p99, e2el_p99, error_rate"),
    ("2 s", "the SLO must be a mapping"),
])
def test_an_slo_that_cannot_be_read_is_named(slo, words):
    with pytest.raises(R.SloError) as exc:
        R.parse_slo(slo)
    assert words in str(exc.value)


@pytest.mark.parametrize("rates, words", [
    ([], "the rate list is empty"),
    ([1, 0, 2], "rates must be above 0 requests per second; got 0 in [1, 0, 2]"),
    ([1, -2.5], "got -2.5"),
    ([True], "got True"),
    ([2, 2], "rates must rise strictly"),
    ([4, 2], "rates must rise strictly"),
    ([1, float("nan")], "got nan"),
])
def test_a_rate_ladder_that_cannot_run_is_refused(rates, words):
    assert words in R.validate_rates(rates)


def test_a_usable_rate_ladder_and_burstiness():
    assert R.validate_rates([0.5, 1, 2.5, 10]) == ""
    assert R.burstiness_problem(1) == "" and R.burstiness_problem(0.25) == ""
    for bad in (0, -1, True, "1", float("inf")):
        assert "burstiness must be above 0" in R.burstiness_problem(bad)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_rates_mean_and_the_gamma_shapes_spread(burstiness):
    rate, n = 8.0, 40_000
    rng = random.Random(7)
    gaps = [R.interarrival(rng, rate, burstiness) for _unused in range(n)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    # a gamma of shape k has a coefficient of variation of 1/sqrt(k): Poisson's is 1
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    # seeded: the same seed gives the same schedule
    again = random.Random(7)
    assert [R.interarrival(again, rate, burstiness) for _unused in range(5)] == gaps[:5]


def step(ttft=None, itl=None, e2el=None, error_rate=0.0, over=None):
    return {"ttft_ms": {"p99": ttft}, "itl_ms": {"p99": itl}, "e2el_ms": {"p99": e2el}, "error_rate": error_rate,
            "slo_over": over or {}}


def test_a_step_is_judged_on_the_share_of_samples_over_each_limit():
    limits = R.parse_slo({"ttft_p99": "2 s", "itl_p99": "80 ms", "error_rate": "1%"})
    ok = R.judge(step(ttft=1999.0, itl=81.0, error_rate=0.01, over={"ttft_p99": 0.0, "itl_p99": 0.01}), limits)
    # 1 % of the gaps over 80 ms: the nearest-rank p99 is at the limit (the interpolated one may be past it)
    assert ok["passed"] is True and [c["check"] for c in ok["checks"]] == ["ttft_p99", "itl_p99", "error_rate"]
    slow = R.judge(step(ttft=2100.0, itl=12.0, over={"ttft_p99": 0.02, "itl_p99": 0.0}), limits)
    assert slow["passed"] is False
    assert [c for c in slow["checks"] if not c["passed"]] == [
        {"check": "ttft_p99", "value": 2100.0, "over": 0.02, "limit": 2000.0, "passed": False}]
    assert R.judge(step(), limits)["passed"] is False                 # nothing completed: no share
    assert R.judge(step(over={"ttft_p99": 0.0, "itl_p99": 0.0}, error_rate=0.02), limits)["passed"] is False


def test_the_share_over_a_limit():
    assert R.over_share([1, 2, 3, 4], 2) == 0.5 and R.over_share([], 2) is None
    assert R.over_share(iter([5.0] * 99 + [7.0]), 5.0) == 0.01


def test_the_runs_own_verdict_counts_what_exceeds_each_limit():
    limits = R.parse_slo({"ttft_p99": "2 s", "itl_p99": "80 ms", "error_rate": "1%"})
    base = {"sent": 1000, "err": 0, "ok": 1000, "ttft_over": 10, "e2el_over": 500, "itl_over": 100,
            "itl_n": 10_000}
    assert R.judge_counts(base, limits) is True                          # 1 % over: p99 still at the limit
    assert R.judge_counts(dict(base, ttft_over=11), limits) is False
    assert R.judge_counts(dict(base, itl_over=101), limits) is False
    assert R.judge_counts(dict(base, err=11, ok=989), limits) is False
    assert R.judge_counts(dict(base, ok=0), limits) is False


def test_the_search_sweeps_until_a_rate_fails_then_bisects():
    sweep = [1, 2, 4, 8, 16]
    capacity_true = 5.2            # a server that holds the SLO up to this rate

    def run(bisections):
        results = []
        while True:
            rate = R.next_rate(sweep, results, bisections)
            if rate is None:
                return results
            results.append((rate, rate <= capacity_true))
    swept = run(0)
    assert [r for r, _ok in swept] == [1, 2, 4, 8]
    assert R.capacity(swept, {})["rate"] == 4 and R.capacity(swept, {})["first_failing_rate"] == 8
    refined = run(3)
    assert [r for r, _ok in refined] == [1, 2, 4, 8, 6, 5, 5.5]
    cap = R.capacity(refined, {})
    assert cap["rate"] == 5 and cap["first_failing_rate"] == 5.5
    assert cap["rate"] <= capacity_true < cap["first_failing_rate"]


def test_the_search_at_the_edges_of_the_sweep():
    assert R.next_rate([1, 2], [(1, False)], 3) is None                  # below every rate
    below = R.capacity([(1, False)], R.parse_slo({"ttft_p99": "1 s"}))
    assert below["below_every_rate"] and R.headline("gpu1", below) == (
        "gpu1 misses TTFT p99 <= 1 s already at 1 req/s, the lowest rate offered: lower the rates")
    assert R.next_rate([1, 2], [(1, True), (2, True)], 3) is None        # above every rate
    above = R.capacity([(1, True), (2, True)], R.parse_slo({"ttft_p99": "1 s"}), top=2)
    assert R.headline("gpu1", above) == ("gpu1 holds 2 req/s at TTFT p99 <= 1 s (every rate offered passed: "
                                         "its capacity may be higher)")
    # a search that never reached the sweep's top does not claim it
    short = R.capacity([(1, True), (2, True)], R.parse_slo({"ttft_p99": "1 s"}), top=4)
    assert not short["above_every_rate"] and R.headline("gpu1", short) == \
        "gpu1 holds 2 req/s at TTFT p99 <= 1 s (the highest rate measured that met it)"
    # a noisy pass above a failure does not count
    noisy = R.capacity([(1, True), (2, False), (3, True)], {})
    assert noisy["rate"] == 1 and noisy["first_failing_rate"] == 2
    assert R.headline("gpu1", dict(noisy, slo="TTFT p99 <= 1 s")) == \
        "gpu1 holds 1 req/s at TTFT p99 <= 1 s (misses it at 2 req/s)"
