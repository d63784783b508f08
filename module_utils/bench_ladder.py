# -*- coding: utf-8 -*-
"""The benchmark ladder's plan: validated settings, the locustfile's config, the Locust command
line and the run's bounds in time and requests (pure stdlib)."""
from __future__ import annotations

import json
import os

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
