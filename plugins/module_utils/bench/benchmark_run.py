# -*- coding: utf-8 -*-
"""The benchmark ladder's plan: validated settings, the locustfile's config, the Locust command
line and the run's bounds in time and requests (pure stdlib)."""
from __future__ import annotations

import json
import os

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import bench_stats
from ansible_collections.modelswap.vllm.plugins.module_utils.bench import rate_ladder

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


def by_rate(p):
    return p.get("mode") == "rate"


def search_on(p):
    """A rate ladder with an SLO searches for the capacity (the sweep, then bisections)."""
    return by_rate(p) and bool(p.get("capacity_slo"))


def steps_at_most(p):
    if by_rate(p):
        return len(p.get("rates") or []) + (int(p.get("bisections") or 0) if search_on(p) else 0)
    return len(p["concurrency"])


def validate(p):
    """Every cross-field problem of the run's settings, as messages (empty when fine)."""
    problems = []
    if by_rate(p):
        err = rate_ladder.validate_rates(p.get("rates"))
        err = err or rate_ladder.burstiness_problem(p.get("burstiness"))
        if p.get("max_inflight") is None or p["max_inflight"] < 0:
            problems.append(f"max_inflight must be 0 (no cap) or more; got {p.get('max_inflight')}")
        if p.get("bisections") is None or p["bisections"] < 0:
            problems.append(f"bisections must be 0 (the sweep alone) or more; got {p.get('bisections')}")
    else:
        err = validate_ladder(p["concurrency"])
    try:
        rate_ladder.parse_slo(p.get("capacity_slo"))
    except rate_ladder.SloError as exc:
        problems.append(str(exc))
    problems += workload_problems(p)
    if p.get("capacity_slo") and not by_rate(p):
        problems.append("capacity_slo is for a rate ladder (mode: rate), which searches the highest rate that "
                        "meets it; a concurrency ladder's SLO is slo (ttft_ms, tpot_ms, e2el_ms)")
    if err:
        problems.insert(0, err)
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


def workload_problems(p):
    """Why the workload's settings cannot run (messages); ``prompt_format`` is already decided."""
    workload = p.get("workload") or "fixed"
    jsonl = p.get("prompt_format") == "jsonl"
    out = []
    if jsonl and workload != "fixed":
        out.append(f"workload {workload} cuts prompts from prose; a JSONL prompt file brings its own prompts: "
                   "use workload fixed with it, or a text prompt_source")
    ratio = p.get("range_ratio")
    if workload == "random" and (ratio is None or not 0 < ratio < 1):
        out.append(f"range_ratio must be above 0 and below 1 for workload random (lengths drawn within ± that "
                   f"share of input_tokens and output_tokens); got {ratio}")
    prefix = p.get("prefix_tokens")
    if workload == "shared_prefix" and (prefix is None or not 0 < prefix < (p.get("input_tokens") or 0)):
        out.append(f"prefix_tokens must be above 0 and below input_tokens ({p.get('input_tokens')}) for workload "
                   f"shared_prefix; got {prefix}")
    return out


def workload_words(p):
    """The request lengths of the plan, in words."""
    workload = p.get("workload") or "fixed"
    eos = " (ignore_eos)" if p.get("ignore_eos") else ""
    if workload == "random":
        r = p["range_ratio"]
        return (f"~{p['input_tokens']} prompt tokens and {p['output_tokens']} output tokens per request, each drawn "
                f"within ±{r:.0%}{eos}")
    words = f"~{p['input_tokens']} prompt tokens, {p['output_tokens']} output tokens per request{eos}"
    if workload == "shared_prefix":
        words += f"; every prompt starts with the same {p['prefix_tokens']} tokens (prefix caching)"
    return words


def drain_timeout(p):
    return float(p["request_timeout_s"]) + 5.0


def bounds(p):
    """The most the run can take: seconds (every step at its longest, plus start-up and the final
    drain) and measured requests. Locust is killed at the time bound."""
    steps = steps_at_most(p)
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
    if by_rate(p):
        return []               # an open loop's window holds what its rate sends: no Little's law check
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
    if search_on(p):
        stops = ["nothing (the capacity search runs past a step that misses the SLO)"]
    if p.get("expect_workers"):
        load = f"a Locust master for {p['expect_workers']} worker host(s)"
    elif p.get("processes"):
        load = ("one Locust process per core" if p["processes"] == -1
                else f"{p['processes']} Locust worker processes")
    else:
        load = "one Locust process"
    tokens = workload_words(p)
    if by_rate(p):
        rates = ",".join(f"{r:g}" for r in p["rates"])
        arrivals = ("Poisson arrivals" if p["burstiness"] == 1 else f"gamma arrivals of burstiness {p['burstiness']:g}")
        cap = f", at most {p['max_inflight']} in flight" if p.get("max_inflight") else ""
        ladder_line = f"  ladder: {rates} req/s (open loop, {arrivals}, seed {p.get('seed') or 0}{cap}); {tokens}"
        window = (f"a measured window of {p['measure_s']:g} s (at most {p['max_requests_per_step']:,} requests), "
                  f"then a drain of at most {drain_timeout(p):g} s")
    else:
        ladder_line = f"  ladder: C={ladder} (closed loops, no wait); {tokens}"
        window = (f"measured window {p['measure_s']:g} s to {p['measure_max_s']:g} s until it holds "
                  f"{p['min_requests_per_user']:g} requests per user (at most {p['max_requests_per_step']:,}), "
                  f"then a drain of at most {drain_timeout(p):g} s")
    lines = [
        f"  target: {p['url'].rstrip('/')} ({p['api']} API), model {p['model']}",
        ladder_line,
        f"  each step: ramp {p['ramp_s']:g} s, warm-up {p['warmup_s']:g} s (discarded), {window}",
        f"  requests time out after {p['request_timeout_s']:g} s; SLOs: {slo or 'none'}; stops early on: "
        f"{' or '.join(stops) or 'nothing'}",
        f"  bounds: at most {bounds['seconds']:,} s in all ({_duration(bounds['seconds'])}; Locust is killed "
        f"past it), {bounds['seconds_per_step_max']:,} s per step, {bounds['measured_requests']:,} measured requests",
        f"  load: {load}, scheduling {p.get('scheduling') or 'normal'}",
    ]
    if search_on(p):
        limits = rate_ladder.parse_slo(p["capacity_slo"])
        lines.append(f"  capacity at the SLO ({rate_ladder.slo_words(limits)}): the rates above as a sweep until "
                     f"one misses it, then {p['bisections']} bisection step(s) between the highest that met it "
                     f"and the lowest that did not")
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
        "workload": p.get("workload") or "fixed", "range_ratio": p.get("range_ratio") or 0.0,
        "prefix_tokens": p.get("prefix_tokens") or 0,
        "words_per_token": p["words_per_token"], "prompt_overhead_tokens": p["prompt_overhead_tokens"],
        "mode": "rate" if by_rate(p) else "concurrency",
        "ladder": list(p["rates"]) if by_rate(p) else list(p["concurrency"]),
        "burstiness": float(p.get("burstiness") or 1.0), "max_inflight": int(p.get("max_inflight") or 0),
        "limits": rate_ladder.parse_slo(p.get("capacity_slo")),
        "search_bisections": int(p.get("bisections") or 0) if search_on(p) else None,
        "ramp_s": p["ramp_s"], "warmup_s": p["warmup_s"],
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
