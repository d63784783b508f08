# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""The rate ladder's arithmetic: arrivals, the SLO, the capacity search.

Standard library only: the benchmark role ships this file beside the locustfile to load hosts
that have Locust but not this collection (roles/benchmark/files/rate_ladder.py links here), and
the module and the report read the same rules.

- Arrivals: an open loop sends each request at a scheduled time, the gaps drawn from a seeded
  gamma process of mean 1/rate and shape ``burstiness`` (1 is Poisson; below 1 burstier, above
  1 more regular), the definition of ``vllm bench serve --burstiness``.
- The SLO: TTFT p99, ITL p99 and E2EL p99 with their units (``"2 s"``, ``"80 ms"``) and an error
  rate (``"1%"``). A p99 limit holds when at most 1 % of the samples (requests; for ITL, the gaps
  between chunks) exceed it - the nearest-rank p99 - counted alike by the load run, which picks
  the next rate from it, and by the report, which shows the interpolated p99 beside it.
- The capacity search: the operator's rates are a sweep, run from the lowest up until one
  fails; then each further step bisects between the highest passing rate and the lowest failing
  one. The capacity is the highest rate that passed below every rate that failed.
"""
from __future__ import annotations

import math
import re

SLO_LATENCIES = ("ttft_p99", "itl_p99", "e2el_p99")
SLO_KEYS = SLO_LATENCIES + ("error_rate",)
# the figure of a step each SLO key is judged on (bench_stats' step metrics)
SLO_FIGURES = {"ttft_p99": ("ttft_ms", "p99"), "itl_p99": ("itl_ms", "p99"), "e2el_p99": ("e2el_ms", "p99")}
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|min)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")
_MS_PER = {"ms": 1.0, "s": 1000.0, "min": 60000.0}


class SloError(ValueError):
    """An SLO that cannot be read (the message names the key, the value and the fix)."""


def duration_ms(value, name: str) -> float:
    """Milliseconds of ``"80 ms"``, ``"2 s"``, ``"1.5s"`` or ``"1 min"``: a bare number is refused
    (a limit without a unit is a guess)."""
    match = _DURATION.match(value) if isinstance(value, str) else None
    if match is None:
        raise SloError(f"{name} is {value!r}: give a duration with its unit, e.g. '2 s' or '80 ms'")
    ms = float(match.group(1)) * _MS_PER[match.group(2)]
    if ms <= 0:
        raise SloError(f"{name} is {value!r}: a limit must be above 0")
    return ms


def ratio(value, name: str) -> float:
    """The share ``"1%"`` (or ``"0.5 %"``) as 0.01: a bare number is refused."""
    match = _PERCENT.match(value) if isinstance(value, str) else None
    if match is None:
        raise SloError(f"{name} is {value!r}: give a percentage, e.g. '1%'")
    share = float(match.group(1)) / 100.0
    if not 0 <= share < 1:
        raise SloError(f"{name} is {value!r}: a share of errors must be at least 0% and below 100%")
    return share


def parse_slo(slo) -> dict:
    """``{ttft_p99_ms, itl_p99_ms, e2el_p99_ms, error_rate}`` (the ones given) from the operator's
    SLO; SloError names the first problem. An empty SLO is {}."""
    if slo in (None, {}):
        return {}
    if not isinstance(slo, dict):
        raise SloError(f"the SLO must be a mapping of {', '.join(SLO_KEYS)}; got {slo!r}")
    unknown = sorted(set(slo) - set(SLO_KEYS))
    if unknown:
        raise SloError(f"the SLO has unknown key(s) {', '.join(map(str, unknown))}: use {', '.join(SLO_KEYS)}")
    out = {}
    for key in SLO_LATENCIES:
        if slo.get(key) is not None:
            out[key + "_ms"] = duration_ms(slo[key], f"slo.{key}")
    if slo.get("error_rate") is not None:
        out["error_rate"] = ratio(slo["error_rate"], "slo.error_rate")
    return out


def slo_words(limits: dict) -> str:
    """``TTFT p99 <= 2 s, ITL p99 <= 80 ms`` for a headline."""
    parts = []
    for key in SLO_LATENCIES:
        ms = limits.get(key + "_ms")
        if ms is not None:
            shown = f"{ms / 1000.0:g} s" if ms >= 1000 else f"{ms:g} ms"
            parts.append(f"{key[:-4].upper()} p99 <= {shown}")
    if limits.get("error_rate") is not None:
        parts.append(f"errors <= {limits['error_rate']:.2%}".replace(".00%", "%"))
    return ", ".join(parts)


def validate_rates(values) -> str:
    """'' or why ``values`` is not a usable rate ladder (requests per second: positive, rising)."""
    if not isinstance(values, (list, tuple)) or not values:
        return "the rate list is empty: give at least one rate in requests per second, e.g. [1, 2, 4, 8]"
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))
           or not math.isfinite(v) or v <= 0]
    if bad:
        return f"rates must be above 0 requests per second; got {', '.join(map(repr, bad))} in {list(values)}"
    if any(b <= a for a, b in zip(values, values[1:])):
        return f"rates must rise strictly from step to step; got {list(values)}"
    return ""


def burstiness_problem(value) -> str:
    """'' or why ``value`` is not a gamma shape (above 0; 1 is Poisson)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return (f"burstiness must be above 0 (1 is a Poisson process, below 1 burstier, above 1 more "
                f"regular); got {value!r}")
    return ""


def interarrival(rng, rate: float, burstiness: float) -> float:
    """Seconds to the next arrival: gamma of shape ``burstiness`` and mean 1/``rate``."""
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


# --- judging a step ---------------------------------------------------------------------------
def count_over(values, limit) -> int:
    """How many of ``values`` are above ``limit`` (the run counts with it, the report shares)."""
    return sum(1 for v in values if v > limit)


def over_share(values, limit):
    """The share of ``values`` above ``limit`` (None without values)."""
    values = list(values)
    if not values:
        return None
    return count_over(values, limit) / len(values)


def judge(step: dict, limits: dict, quantile: float = 0.99) -> dict:
    """Whether a measured step meets the SLO: ``{passed, checks: [{check, value, over, limit,
    passed}]}``. A p99 check passes when the share of samples over its limit (``step["slo_over"]``,
    bench_stats) is at most 1 - ``quantile``; ``value`` is the step's p99 for the reader. A figure
    the step lacks (no completed request) fails its check."""
    checks = []
    shares = step.get("slo_over") or {}
    for key in SLO_LATENCIES:
        limit = limits.get(key + "_ms")
        if limit is None:
            continue
        metric, stat = SLO_FIGURES[key]
        over = shares.get(key)
        checks.append({"check": key, "value": (step.get(metric) or {}).get(stat), "over": over, "limit": limit,
                       "passed": over is not None and over <= 1.0 - quantile + 1e-12})
    if limits.get("error_rate") is not None:
        value = step.get("error_rate")
        checks.append({"check": "error_rate", "value": value, "limit": limits["error_rate"],
                       "passed": value is not None and value <= limits["error_rate"]})
    return {"passed": all(c["passed"] for c in checks), "checks": checks}


def judge_counts(counts: dict, limits: dict, quantile: float = 0.99) -> bool:
    """The load run's own verdict on a step while it runs (the capacity search's next rate), from
    counts the load processes keep: a p99 limit holds when at most 1 - ``quantile`` of the samples
    exceed it. ``counts``: sent, err, ok (completed), ttft_over, e2el_over, itl_over, itl_n. The
    report judges the step again with its exact percentiles (``judge``)."""
    allowed = 1.0 - quantile + 1e-12
    ok = counts.get("ok", 0)
    if limits.get("error_rate") is not None and counts.get("sent", 0):
        if counts.get("err", 0) / counts["sent"] > limits["error_rate"]:
            return False
    if not ok:
        return False
    for key, total in (("ttft", ok), ("e2el", ok), ("itl", counts.get("itl_n", 0))):
        if limits.get(f"{key}_p99_ms") is None or not total:
            continue
        if counts.get(f"{key}_over", 0) / total > allowed:
            return False
    return True


# --- the capacity search ------------------------------------------------------------------------
def bracket(results):
    """(highest passing rate below every failing one, lowest failing rate) of ``results`` [(rate,
    passed)]; either is None when no step is on that side."""
    failing = [r for r, ok in results if not ok]
    low_fail = min(failing) if failing else None
    passing = [r for r, ok in results if ok and (low_fail is None or r < low_fail)]
    return (max(passing) if passing else None), low_fail


def next_rate(sweep, results, bisections: int):
    """The rate of the next step, or None when the search is done. ``sweep``: the operator's
    rising rates; ``results``: [(rate, passed)] of the steps run so far, in order. The sweep runs
    until a rate fails (all of it when none does); then at most ``bisections`` steps halve the gap
    between the highest passing and the lowest failing rate. A sweep whose first rate fails ends
    there: the capacity is below the lowest rate offered."""
    done = len(results)
    high_pass, low_fail = bracket(results)
    if low_fail is None:
        return sweep[done] if done < len(sweep) else None
    swept = sum(1 for r, _ok in results if r in sweep)
    if high_pass is None or done - swept >= bisections:
        return None
    middle = (high_pass + low_fail) / 2.0
    return float(f"{middle:.4g}")


def capacity(results, limits: dict, top=None) -> dict:
    """The search's answer from judged steps [(rate, passed)]: the highest passing rate below every
    failing one, the lowest failing rate, and whether the capacity lies beyond the rates offered
    (``top``: the sweep's highest rate, passed)."""
    high_pass, low_fail = bracket(results)
    return {"rate": high_pass, "first_failing_rate": low_fail, "slo": slo_words(limits),
            "above_every_rate": low_fail is None and high_pass is not None and high_pass == top,
            "below_every_rate": high_pass is None and low_fail is not None}


def headline(host: str, cap: dict) -> str:
    """``gpu1 holds 12.4 req/s at TTFT p99 <= 2 s, ITL p99 <= 80 ms`` (or why it cannot say)."""
    if cap["rate"] is None and cap["first_failing_rate"] is None:
        return f"{host}: no step was measured against the SLO"
    if cap["below_every_rate"]:
        return (f"{host} misses {cap['slo']} already at {cap['first_failing_rate']:g} req/s, the lowest rate "
                "offered: lower the rates")
    line = f"{host} holds {cap['rate']:g} req/s at {cap['slo']}"
    if cap["above_every_rate"]:
        return line + " (every rate offered passed: its capacity may be higher)"
    if cap["first_failing_rate"] is None:
        return line + " (the highest rate measured that met it)"
    return line + f" (misses it at {cap['first_failing_rate']:g} req/s)"
