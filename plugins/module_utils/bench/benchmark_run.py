# -*- coding: utf-8 -*-
"""The benchmark ladder's plan: validated settings, the locustfile's config, the Locust command
line and the run's bounds in time and requests (pure stdlib)."""
from __future__ import annotations

import json
import os

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats

CONFIG_SCHEMA = 1
RAMP_GRACE_S = 30          # the ladder moves on when a ramp has not finished this long after ramp_s
START_GRACE_S = 120        # Locust start-up, workers connecting, the final sample


def validate_ladder(values):
    """None, or why `values` is not a usable concurrency ladder (non-empty, positive, rising)."""
    if not isinstance(values, (list, tuple)) or not values:
        return "the concurrency list is empty: give at least one concurrency, e.g. [1, 8, 32]"
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
    if bad:
        return (f"concurrency values must be positive integers; got {', '.join(map(repr, bad))} "
                f"in {list(values)}")
    if any(b <= a for a, b in zip(values, values[1:])):
        return f"concurrency values must rise strictly from step to step; got {list(values)}"
    return None


def validate(p):
    """Every cross-field problem of the run's settings, as messages (empty when fine)."""
    problems = []
    err = validate_ladder(p["concurrency"])
    if err:
        problems.append(err)
    for key in ("input_tokens", "output_tokens", "measure_s", "measure_max_s", "request_timeout_s",
                "max_requests_per_step"):
        if p[key] is None or p[key] <= 0:
            problems.append(f"{key} must be above 0; got {p[key]}")
    for key in ("ramp_s", "warmup_s", "min_requests_per_user"):
        if p[key] is None or p[key] < 0:
            problems.append(f"{key} must not be negative; got {p[key]}")
    if p["measure_max_s"] is not None and p["measure_s"] is not None and p["measure_max_s"] < p["measure_s"]:
        problems.append(f"measure_max_s ({p['measure_max_s']}) must be at least measure_s ({p['measure_s']})")
    rate = p.get("stop_error_rate")
    if rate is not None and not 0 <= rate < 1:
        problems.append(f"stop_error_rate must be in [0, 1); got {rate}")
    good = p.get("stop_min_good_ratio")
    if good is not None and not 0 < good <= 1:
        problems.append(f"stop_min_good_ratio must be in (0, 1]; got {good}")
    for key, value in (p.get("slo") or {}).items():
        if value is not None and value <= 0:
            problems.append(f"slo.{key} must be above 0 ms; got {value}")
    if p.get("processes") is not None and p["processes"] < -1:
        problems.append(f"processes must be -1 (one per core), 0 (one process) or more; got {p['processes']}")
    return problems


def drain_timeout(p):
    return float(p["request_timeout_s"]) + 5.0


def bounds(p):
    """The most the run can take: seconds (every step at its longest, plus start-up and the final
    drain) and measured requests. Locust is killed at the time bound."""
    steps = len(p["concurrency"])
    per_step = (float(p["ramp_s"]) + RAMP_GRACE_S + float(p["warmup_s"]) + float(p["measure_max_s"])
                + drain_timeout(p) + 2.0)
    seconds = START_GRACE_S + steps * per_step + drain_timeout(p)
    return {"seconds": int(seconds), "measured_requests": steps * int(p["max_requests_per_step"]),
            "seconds_per_step_max": int(per_step)}


def window_warnings(p, tolerance=None):
    """Why the measured windows of these settings may be too short for the report's Little's law
    check (bench_stats.littles_law_window, the rule the littles_law flag states), as messages;
    empty when every window is sure to hold enough requests per user. Before the run the E2E
    latency is unknown, so only the request counts can be checked."""
    tolerance = tolerance or bench_stats.DEFAULT_CHECKS["littles_law_tolerance"]
    need = bench_stats.littles_law_window(tolerance)
    n, multiple = need["requests_per_user"], need["e2el_multiple"]
    top = max(p["concurrency"])
    out = []
    if p["min_requests_per_user"] < n:
        out.append(
            f"a step's measured window may close after measure_s ({p['measure_s']:g} s) holding only "
            f"{p['min_requests_per_user']:g} requests per user; Little's law (±{tolerance:.0%}) needs at least {n} "
            f"(a window of {multiple:g} × the step's E2E latency), so such steps are flagged littles_law and "
            f"invalid: set min_requests_per_user (benchmark_min_requests_per_user) to {n}, or measure_s to at "
            f"least {multiple:g} × the E2E latency expected at C={top}")
    if p["max_requests_per_step"] < n * top:
        out.append(
            f"max_requests_per_step ({p['max_requests_per_step']}) closes the window at C={top} after "
            f"{p['max_requests_per_step'] / top:.1f} requests per user, fewer than the {n} that Little's law "
            f"(±{tolerance:.0%}) needs: raise it to at least {n * top}")
    return out


def _duration(seconds):
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plan_lines(p, bounds, warnings=()):
    """The run's plan as an operator reads it (the role shows it, in check mode too)."""
    ladder = ",".join(str(c) for c in p["concurrency"])
    slo = ", ".join(f"{k[:-3].upper()} <= {v:g} ms" for k, v in sorted((p.get("slo") or {}).items())
                    if v is not None)
    stops = []
    if p.get("stop_error_rate") is not None:
        stops.append(f"a step's error rate above {p['stop_error_rate']:.1%}")
    if slo and p.get("stop_min_good_ratio") is not None:
        stops.append(f"fewer than {p['stop_min_good_ratio']:.0%} of a step's requests meeting the SLOs")
    if p.get("expect_workers"):
        load = f"a Locust master for {p['expect_workers']} worker host(s)"
    elif p.get("processes"):
        load = ("one Locust process per core" if p["processes"] == -1
                else f"{p['processes']} Locust worker processes")
    else:
        load = "one Locust process"
    lines = [
        f"  target: {p['url'].rstrip('/')} ({p['api']} API), model {p['model']}",
        f"  ladder: C={ladder} (closed loops, no wait); ~{p['input_tokens']} prompt tokens, "
        f"{p['output_tokens']} output tokens per request{' (ignore_eos)' if p.get('ignore_eos') else ''}",
        f"  each step: ramp {p['ramp_s']:g} s, warm-up {p['warmup_s']:g} s (discarded), measured window "
        f"{p['measure_s']:g} s to {p['measure_max_s']:g} s until it holds {p['min_requests_per_user']:g} requests "
        f"per user (at most {p['max_requests_per_step']:,}), then a drain of at most {drain_timeout(p):g} s",
        f"  requests time out after {p['request_timeout_s']:g} s; SLOs: {slo or 'none'}; stops early on: "
        f"{' or '.join(stops) or 'nothing'}",
        f"  bounds: at most {bounds['seconds']:,} s in all ({_duration(bounds['seconds'])}; Locust is killed "
        f"past it), {bounds['seconds_per_step_max']:,} s per step, {bounds['measured_requests']:,} measured requests",
        f"  load: {load}, scheduling {p.get('scheduling') or 'normal'}",
    ]
    lines += [f"  WARNING: {w}" for w in warnings]
    return lines


def config(p, raw_dir):
    """The locustfile's config (no secret: the API key reaches Locust apart, in its environment on the
    load host, in a 0600 file on a remote worker)."""
    slo = {k: v for k, v in (p.get("slo") or {}).items() if v is not None}
    return {
        "schema": CONFIG_SCHEMA, "target": p["url"].rstrip("/"), "api": p["api"], "model": p["model"],
        "served_model_name": p["model"],
        "input_tokens": p["input_tokens"], "output_tokens": p["output_tokens"], "ignore_eos": p["ignore_eos"],
        "prompt_source": p["prompt_source"], "prompt_format": p["prompt_format"],
        "words_per_token": p["words_per_token"], "prompt_overhead_tokens": p["prompt_overhead_tokens"],
        "ladder": list(p["concurrency"]), "ramp_s": p["ramp_s"], "warmup_s": p["warmup_s"],
        "measure_s": p["measure_s"], "measure_max_s": p["measure_max_s"],
        "min_requests_per_user": p["min_requests_per_user"], "max_requests_per_step": p["max_requests_per_step"],
        "request_timeout_s": p["request_timeout_s"], "drain_timeout_s": drain_timeout(p),
        "slo": slo, "stop_error_rate": p.get("stop_error_rate"),
        "stop_min_good_ratio": p.get("stop_min_good_ratio") if slo else None,
        "metrics_url": p.get("metrics_url") or None, "metrics_interval_s": 1.0,
        "extra_body": p.get("extra_body") or {}, "out_dir": raw_dir, "seed": p.get("seed") or 0,
        "validate_certs": p.get("validate_certs", True),
    }


def locust_argv(command, locustfile, log_file, *, processes=0, expect_workers=0, master_bind_host=None,
                master_bind_port=None, stop_timeout=60):
    """The Locust command line: headless, the ladder's LoadTestShape, no exit code for failed
    requests (they are data), Locust's own summary off (the report has the figures)."""
    argv = list(command) + ["-f", locustfile, "--headless", "--only-summary", "--loglevel", "WARNING",
                            "--logfile", log_file, "--exit-code-on-error", "0",
                            "--stop-timeout", str(int(stop_timeout))]
    if processes:
        argv += ["--processes", str(processes)]
    elif expect_workers:
        argv += ["--master", "--expect-workers", str(expect_workers), "--expect-workers-max-wait", "120"]
        if master_bind_host:
            argv += ["--master-bind-host", master_bind_host]
        if master_bind_port:
            argv += ["--master-bind-port", str(master_bind_port)]
    return argv


def run_status(raw_dir):
    """What master.jsonl says about a run: started, finished, stop reason, steps measured."""
    path = os.path.join(raw_dir, "master.jsonl")
    out = {"started": False, "complete": False, "stopped_early": None, "steps_measured": 0,
           "last_phase": None}
    if not os.path.exists(path):
        return out
    measured = set()
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            kind = rec.get("k")
            if kind == "start":
                out["started"] = True
            elif kind == "done":
                out["complete"] = True
            elif kind == "phase":
                out["last_phase"] = {"step": rec.get("s"), "phase": rec.get("p"), "users": rec.get("users")}
                if rec.get("p") == "measure":
                    measured.add(rec.get("s"))
                if rec.get("p") == "end":
                    out["stopped_early"] = rec.get("stop_reason")
    out["steps_measured"] = len(measured)
    return out
