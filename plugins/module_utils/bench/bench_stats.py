# -*- coding: utf-8 -*-
"""Benchmark statistics from raw per-request records, by vLLM's definitions (pure stdlib).

The locustfile of the benchmark role writes one JSONL file per load process (`worker-*.jsonl`)
and one for the ladder's clock (`master.jsonl`). This module turns them into per-step metrics
that compare 1:1 with `vllm bench serve` (vllm/benchmarks/serve.py, lib/endpoint_request_func.py):

- TTFT = first choice-bearing SSE message − st (st: monotonic clock just before the POST);
- ITL = gaps between consecutive choice-bearing messages (per chunk, not per token), pooled
  over all requests before the statistics;
- E2EL = last choice-bearing message − st;
- output tokens = usage.completion_tokens;
- TPOT = (E2EL − TTFT) / (output tokens − 1), for requests with more than one output token;
- mean, median, population std and percentiles by linear interpolation (numpy.percentile).

Throughput is measured over each step's steady-state window [t0, t1) (each load process's own
clock readings of the window's start and end): output tokens that arrived in the window / window,
requests that completed in the window / window. vLLM's own figure for the window's requests
(completed / (end of the last request − t0)) is reported beside it as `vllm_duration`.

Record keys (written by the locustfile): k kind (req, phase, cpu, srv, start, done), w worker,
s step, p phase (ramp, warmup, measure, drain, end), st send time (s, perf_counter), c chunk
arrival offsets from st (s), u [prompt_tokens, completion_tokens], f finish reason, h HTTP status,
e error kind, m error message, d [DONE] seen, r first chunk was a role-only delta.
"""
from __future__ import annotations

import json
import math
import os

from ansible_collections.modelswap.vllm.plugins.module_utils.bench import rate_ladder

SCHEMA = "modelswap.benchmark/v1"

DEFINITIONS = {
    "ttft_ms": "first choice-bearing SSE message − st (st = monotonic clock just before the POST)",
    "itl_ms": "gap between consecutive choice-bearing messages of a request (per chunk), pooled",
    "tpot_ms": "(E2EL − TTFT) / (usage.completion_tokens − 1), requests with > 1 output token",
    "e2el_ms": "last choice-bearing message − st",
    "output_throughput": "Σ usage.completion_tokens arriving in the window / window length "
                         "(a request's tokens are spread evenly over its token-bearing chunks)",
    "request_throughput": "requests completed in the window / window length",
    "total_token_throughput": "output_throughput + Σ prompt tokens of requests completed in the window / window",
    "request_goodput": "request_throughput × share of completed requests meeting every SLO",
    "vllm_duration": "vllm bench serve's figures for the window's requests: completed / "
                     "(end of the last request − window start)",
    "server_concurrency": "mean of vllm:num_requests_running + vllm:num_requests_waiting sampled in the window",
    "littles_law_concurrency": "request_throughput × mean E2EL (should equal the offered concurrency)",
    "rate": "a rate ladder's step: the offered rate, the achieved one (measured requests / window), "
            "the dispatch delay (send − scheduled time, less the wait at the in-flight cap) and that wait",
    "statistics": "mean, median, population std; percentiles by linear interpolation (numpy.percentile)",
}

DEFAULT_CHECKS = {
    "client_cpu_max": 0.85,         # a load process above this share of one core is saturated
    # The event loop's lag (a 20 ms timer probe, 50 per second) is how late the client notices a chunk.
    # A step is invalid when the lag could move ITL p99 or mean TTFT by more than the larger of an
    # absolute bound and a share of the measured value (the benchmark promises 5 % or 2 ms; the
    # share is half that because at 1,024 streams the probe under-read bursts: probe p99 10.8 ms with
    # chunks 20 ms late at p99). Calibrated against the simulator's record: probe p99 <= 4.4 ms went
    # with ITL p99 errors <= 1.4 ms, 8 ms with +3.6 ms.
    "client_lag_p99_max_ms": 5.0,
    "client_lag_mean_max_ms": 1.5,
    "client_lag_relative_max": 0.025,
    "concurrency_min_ratio": 0.9,   # offered concurrency seen by the server / client below this ...
    "outside_engine_max_ms": 50.0,  # ... and requests spent this long in flight outside the engine
    "littles_law_tolerance": 0.1,   # |L / C − 1| above this: the client did not keep C in flight
    "knee_fraction": 0.9,           # knee: the lowest concurrency reaching this share of the peak
    "knee_min_efficiency": 0.5,     # ... unless throughput still grew this well at the last step
    "prefix_hit_max": 0.05,         # prefix-cache hit rate above this: the nonce did not work
    "min_requests_per_user": 3,
    # rate ladders: a request sent later than this after its scheduled time (at p99, its wait at the
    # in-flight cap aside) means the client did not offer the process it promised
    "dispatch_delay_p99_max_ms": 10.0,
    "rate_tolerance": 0.1,          # achieved / offered rate off by more (and by more than chance)
    "min_requests_rate_step": 20,   # fewer completed requests in a rate step: noisy figures
}


def littles_law_window(tolerance, e2el_s=None):
    """The shortest measured window in which Little's law can be checked within ±tolerance.

    A closed loop of C users whose requests last E completes floor(W/E) or ceil(W/E) requests per
    user in a window W, so throughput × E is off C by up to E/W: the check can only hold when
    W ≥ E / tolerance. A window of n requests sent per user lasts more than (n − 1) × E, so
    n ≥ ceil(1 / tolerance) + 1 requests per user guarantee it. Returns {"requests_per_user": n,
    "e2el_multiple": 1 / tolerance, "seconds": E / tolerance (None without e2el_s)}: the pre-run
    check of the ladder (bench_ladder.window_warnings) and the littles_law flag both use it.
    """
    if tolerance is None or not tolerance > 0:
        raise ValueError(f"littles_law_tolerance must be above 0; got {tolerance!r}")
    multiple = 1.0 / tolerance
    return {"requests_per_user": int(math.ceil(multiple - 1e-9)) + 1, "e2el_multiple": multiple,
            "seconds": (e2el_s * multiple) if e2el_s else None}


INVALIDATING = {"client_cpu_saturated", "client_lag", "concurrency_not_reached",
                "client_concurrency_low", "littles_law", "ramp_incomplete", "no_completed_requests",
                "dispatch_late"}


# --- statistics ---------------------------------------------------------------------------------
def percentile(sorted_values, p):
    """numpy.percentile(values, p) with the default linear interpolation, on a sorted list."""
    n = len(sorted_values)
    if n == 0:
        return None
    if n == 1:
        return float(sorted_values[0])
    rank = (n - 1) * (p / 100.0)
    lo = int(math.floor(rank))
    hi = min(lo + 1, n - 1)
    frac = rank - lo
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac)


def summarize(values, scale=1.0):
    """mean, median, population std, p90, p99, min, max (values × scale), like vLLM's report."""
    vals = sorted(v * scale for v in values)
    n = len(vals)
    if n == 0:
        return {"n": 0, "mean": None, "median": None, "std": None, "p90": None, "p99": None,
                "min": None, "max": None}
    mean = math.fsum(vals) / n
    var = math.fsum((v - mean) ** 2 for v in vals) / n
    return {"n": n, "mean": mean, "median": percentile(vals, 50), "std": math.sqrt(var),
            "p90": percentile(vals, 90), "p99": percentile(vals, 99), "min": vals[0], "max": vals[-1]}


# --- one request ----------------------------------------------------------------------------------
def request_success(rec):
    """vLLM counts a request as successful when its stream carried a choice-bearing chunk and
    nothing failed; an HTTP error, a broken stream or an in-stream error is a failure."""
    return rec.get("e") is None and rec.get("h") == 200 and bool(rec.get("c"))


def output_tokens(rec):
    """usage.completion_tokens; without usage, the number of token-bearing chunks (a fallback that
    counts chunks, not tokens: the report flags it)."""
    u = rec.get("u")
    if u and u[1] is not None:
        return int(u[1])
    n = len(rec.get("c") or [])
    return max(0, n - (1 if rec.get("r") else 0))


def prompt_tokens(rec):
    u = rec.get("u")
    return int(u[0]) if u and u[0] is not None else None


def request_metrics(rec):
    """TTFT, E2EL (s), the ITL gaps (s) and TPOT (s) of one record, by vLLM's definitions."""
    c = rec.get("c") or []
    if not c:
        return None
    ttft = c[0]
    e2el = c[-1]
    itl = [b - a for a, b in zip(c, c[1:])]
    out = output_tokens(rec)
    tpot = (e2el - ttft) / (out - 1) if out > 1 else None
    return {"ttft": ttft, "e2el": e2el, "itl": itl, "tpot": tpot, "output_tokens": out}


def token_arrivals(rec):
    """(absolute arrival time, tokens) of each token-bearing chunk: usage.completion_tokens spread
    evenly over the chunks (a chat stream's leading role-only delta carries none)."""
    c = rec.get("c") or []
    st = rec["st"]
    chunks = c[1:] if rec.get("r") else c
    if not chunks:
        return []
    per = output_tokens(rec) / len(chunks)
    return [(st + off, per) for off in chunks]


# --- loading raw files ------------------------------------------------------------------------
def read_jsonl(path):
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                continue           # a line cut by a killed process: skip it
    return out


def load_raw(raw_dir):
    """{'master': [records], 'workers': {file stem: [records]}} from a raw folder (or its
    sub-folders, where remote load generators' files were fetched)."""
    master, workers = [], {}
    for root, _dirs, files in os.walk(raw_dir):
        for name in sorted(files):
            path = os.path.join(root, name)
            if name == "master.jsonl":
                master.extend(read_jsonl(path))
            elif name.startswith("worker-") and name.endswith(".jsonl"):
                workers[os.path.relpath(path, raw_dir)] = read_jsonl(path)
    return {"master": master, "workers": workers}


# --- a step ------------------------------------------------------------------------------------
def _windows(raw, step):
    """Per load process: (t0, t1) of the step's measured window in its own clock."""
    out = {}
    for wid, recs in raw["workers"].items():
        t0 = t1 = None
        for r in recs:
            if r.get("k") == "phase" and r.get("s") == step:
                if r["p"] == "measure":
                    t0 = r["t"]
                elif r["p"] in ("drain", "end") and t0 is not None and t1 is None:
                    t1 = r["t"]
        if t0 is not None and t1 is not None and t1 > t0:
            out[wid] = (t0, t1)
    return out


def _master_phase(raw, step, phase):
    for r in raw["master"]:
        if r.get("k") == "phase" and r.get("s") == step and r.get("p") == phase:
            return r
    return None


def _master_window(raw, step):
    start = _master_phase(raw, step, "measure")
    if start is None:
        return None
    for r in raw["master"]:
        if r.get("k") == "phase" and r.get("t", 0) > start["t"] and r.get("p") in ("drain", "end"):
            return (start["t"], r["t"])
    return None


def _good(m, slo):
    checks = ((slo.get("ttft_ms"), m["ttft"]), (slo.get("tpot_ms"), m["tpot"]), (slo.get("e2el_ms"), m["e2el"]))
    return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)


def server_stats(samples, window):
    """Mean/min/max of server concurrency and KV use from /metrics samples inside `window`, and the
    generation-token rate from the counter's change between the first and last of them."""
    inside = [s for s in samples if s.get("ok") and window[0] <= s["t"] <= window[1]]
    if not inside:
        return None
    conc = [s.get("running", 0.0) + s.get("waiting", 0.0) for s in inside]
    running = [s.get("running", 0.0) for s in inside]
    waiting = [s.get("waiting", 0.0) for s in inside]
    kv = [s["kv"] for s in inside if "kv" in s]
    out = {"samples": len(inside),
           "concurrency_mean": math.fsum(conc) / len(conc), "concurrency_min": min(conc),
           "concurrency_max": max(conc),
           "running_mean": math.fsum(running) / len(running), "waiting_mean": math.fsum(waiting) / len(waiting),
           "kv_cache_usage_mean": (math.fsum(kv) / len(kv)) if kv else None,
           "kv_cache_usage_max": max(kv) if kv else None,
           "generation_throughput": None, "prefix_cache_hit_rate": None}
    first, last = inside[0], inside[-1]
    if last["t"] > first["t"] and "gen" in first and "gen" in last:
        out["generation_throughput"] = (last["gen"] - first["gen"]) / (last["t"] - first["t"])
    if "pfx_q" in first and "pfx_q" in last and last["pfx_q"] > first["pfx_q"]:
        out["prefix_cache_hit_rate"] = (last.get("pfx_h", 0) - first.get("pfx_h", 0)) / (last["pfx_q"] - first["pfx_q"])
    return out


def client_stats(raw, step):
    """Per load process in the window: CPU share (mean, max), event-loop lag (every 20 ms probe:
    mean, p99, max) and involuntary context switches per second, mean requests in flight."""
    out = {}
    for wid, recs in raw["workers"].items():
        rows = [r for r in recs if r.get("k") == "cpu" and r.get("s") == step and r.get("p") == "measure"]
        if not rows:
            continue
        cpu = [r["cpu"] for r in rows]
        lags = sorted(x for r in rows for x in r.get("lags", ()))
        out[wid] = {"cpu_mean": math.fsum(cpu) / len(cpu), "cpu_max": max(cpu),
                    "lag_mean_ms": (math.fsum(lags) / len(lags)) if lags else None,
                    "lag_p99_ms": percentile(lags, 99), "lag_max_ms": lags[-1] if lags else None,
                    "preempted_per_s": math.fsum(r.get("preempted", 0) for r in rows) / len(rows),
                    "steal": (math.fsum(r["steal"] for r in rows if "steal" in r) / len(rows))
                    if any("steal" in r for r in rows) else None,
                    "inflight_mean": math.fsum(r["inflight"] for r in rows) / len(rows)}
    return out


def step_metrics(raw, step, concurrency, slo=None, checks=None, rate=None, limits=None):
    """Every figure of one ladder step (see DEFINITIONS), with its validity flags. A rate ladder's
    step has no concurrency (None) but its offered ``rate`` (requests per second), and with a
    capacity SLO (``limits``, rate_ladder.parse_slo) the share of its samples over each limit."""
    slo = slo or {}
    chk = dict(DEFAULT_CHECKS, **(checks or {}))
    windows = _windows(raw, step)
    measured, ttft, tpot, itl, e2el, itl_n = [], [], [], [], [], 0
    dispatch, cap_waits = [], []
    errors = {}
    n_good = n_completed = 0
    in_tok = out_tok = 0
    no_usage = 0
    last_end = {}
    throughput_out = throughput_req = throughput_in = 0.0
    window_len = []
    per_worker_lengths = {}
    chunk_rates = {}         # per load process: chunks it received per second of its window
    for wid, recs in raw["workers"].items():
        reqs = [r for r in recs if r.get("k") == "req"]
        win = windows.get(wid)
        tok_in_window = req_in_window = prompt_in_window = 0.0
        chunks_in_window = 0
        for r in reqs:
            if r.get("s") == step and r.get("p") == "measure":
                measured.append(r)
                if r.get("q") is not None:      # an open loop's request: how late it left
                    dispatch.append(r["q"] - (r.get("qw") or 0.0))
                    cap_waits.append(r.get("qw") or 0.0)
                if request_success(r):
                    m = request_metrics(r)
                    n_completed += 1
                    ttft.append(m["ttft"])
                    e2el.append(m["e2el"])
                    itl.extend(m["itl"])
                    if m["tpot"] is not None:
                        tpot.append(m["tpot"])
                    if not r.get("u"):
                        no_usage += 1
                    out_tok += m["output_tokens"]
                    in_tok += prompt_tokens(r) or 0
                    if _good(m, slo):
                        n_good += 1
                    end = r["st"] + m["e2el"]
                    last_end[wid] = max(last_end.get(wid, end), end)
                else:
                    kind = r.get("e") or "failed"
                    errors[kind] = errors.get(kind, 0) + 1
            if win is None:
                continue
            # window throughput: everything that arrived or completed inside [t0, t1), any phase
            for t, n in token_arrivals(r):
                if win[0] <= t < win[1]:
                    tok_in_window += n
            chunks_in_window += sum(1 for off in r.get("c") or () if win[0] <= r["st"] + off < win[1])
            if request_success(r):
                end = r["st"] + r["c"][-1]
                if win[0] <= end < win[1]:
                    req_in_window += 1
                    prompt_in_window += prompt_tokens(r) or 0
        if win is not None:
            length = win[1] - win[0]
            per_worker_lengths[wid] = length
            chunk_rates[wid] = chunks_in_window / length
            window_len.append(length)
            throughput_out += tok_in_window / length
            throughput_req += req_in_window / length
            throughput_in += prompt_in_window / length
    n_measured = len(measured)
    n_failed = n_measured - n_completed
    window_s = (math.fsum(window_len) / len(window_len)) if window_len else None
    ttft_s, e2el_s = summarize(ttft, 1000.0), summarize(e2el, 1000.0)
    result = {
        "step": step, "concurrency": concurrency,
        "window_s": window_s,
        "requests": {"measured": n_measured, "completed": n_completed, "failed": n_failed,
                     "errors": errors, "good": n_good if slo else None},
        "error_rate": (n_failed / n_measured) if n_measured else None,
        "request_throughput": throughput_req if windows else None,
        "output_throughput": throughput_out if windows else None,
        "total_token_throughput": (throughput_out + throughput_in) if windows else None,
        "request_goodput": (throughput_req * n_good / n_completed) if (slo and n_completed and windows) else None,
        "ttft_ms": ttft_s, "tpot_ms": summarize(tpot, 1000.0), "itl_ms": summarize(itl, 1000.0),
        "e2el_ms": e2el_s,
        "input_tokens_mean": (in_tok / n_completed) if n_completed else None,
        "output_tokens_mean": (out_tok / n_completed) if n_completed else None,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
    }
    # vLLM's own arithmetic for these requests: duration = window start → end of the last one
    if windows and last_end:
        durations = [last_end[w] - windows[w][0] for w in last_end if w in windows]
        dur = max(durations) if durations else None
        result["vllm_duration"] = {
            "duration_s": dur,
            "request_throughput": (n_completed / dur) if dur else None,
            "output_throughput": (out_tok / dur) if dur else None,
            "total_token_throughput": ((in_tok + out_tok) / dur) if dur else None}
    else:
        result["vllm_duration"] = None
    # what the server saw, what the client did
    mwin = _master_window(raw, step)
    samples = [r for r in raw["master"] if r.get("k") == "srv"]
    result["server"] = server_stats(samples, mwin) if mwin else None
    clients = client_stats(raw, step)
    result["client"] = {
        "processes": len(clients),
        "cpu_mean_max": max((c["cpu_mean"] for c in clients.values()), default=None),
        "cpu_max": max((c["cpu_max"] for c in clients.values()), default=None),
        "lag_mean_ms": max((c["lag_mean_ms"] for c in clients.values() if c["lag_mean_ms"] is not None),
                           default=None),
        "lag_p99_ms": max((c["lag_p99_ms"] for c in clients.values() if c["lag_p99_ms"] is not None),
                          default=None),
        "lag_max_ms": max((c["lag_max_ms"] for c in clients.values() if c["lag_max_ms"] is not None),
                          default=None),
        "preempted_per_s": max((c["preempted_per_s"] for c in clients.values()), default=None),
        "steal": max((c["steal"] for c in clients.values() if c["steal"] is not None), default=None),
        "inflight_mean": math.fsum(c["inflight_mean"] for c in clients.values()) if clients else None,
        "per_process": clients,
        # what one load process handled: the figure the flags size more processes by
        "chunks_per_s": {wid: chunk_rates[wid] for wid in sorted(chunk_rates)},
        "chunks_per_s_total": math.fsum(chunk_rates.values()) if chunk_rates else None}
    if limits:
        result["slo_over"] = {key: rate_ladder.over_share((v * 1000.0 for v in values), limits[key + "_ms"])
                              for key, values in (("ttft_p99", ttft), ("itl_p99", itl), ("e2el_p99", e2el))
                              if limits.get(key + "_ms") is not None}
    if rate is not None:
        result["rate"] = {"offered": rate,
                          "achieved": (n_measured / window_s) if window_s else None,
                          "dispatch_delay_ms": summarize(dispatch, 1000.0),
                          "cap_wait_ms": summarize(cap_waits, 1000.0)}
    little = None
    if concurrency and result["request_throughput"] and e2el_s["mean"] is not None:
        L = result["request_throughput"] * e2el_s["mean"] / 1000.0
        little = {"concurrency": L, "ratio": L / concurrency}
    result["littles_law"] = little
    ramp = _master_phase(raw, step, "warmup")
    result["ramp"] = {"seconds": ramp.get("ramp_s"), "users_reached": ramp.get("users_reached"),
                      "users": ramp.get("users")} if ramp else None
    drain = None
    for r in raw["master"]:
        next_ramp = r.get("s") == step + 1 and r.get("p") == "ramp" and "prev_drained" in r
        this_end = r.get("s") == step and r.get("p") in ("end", "rest")      # rest: a rate ladder's
        if r.get("k") == "phase" and (next_ramp or this_end):
            drain = r.get("prev_drained", r.get("drained"))
            break
    result["drained"] = drain
    result["flags"] = step_flags(result, concurrency, chk, no_usage)
    result["valid"] = not any(f["code"] in INVALIDATING for f in result["flags"])
    return result


def step_flags(m, c, chk, no_usage=0):
    """Why a step cannot be trusted (invalid) or should be read with care (warning)."""
    flags = []

    def add(code, message):
        flags.append({"code": code, "severity": "invalid" if code in INVALIDATING else "warning",
                      "message": message})

    cl = m["client"]
    if cl["cpu_mean_max"] is not None and cl["cpu_mean_max"] >= chk["client_cpu_max"]:
        add("client_cpu_saturated", f"a load process used {cl['cpu_mean_max']:.0%} of a core on average "
            f"(limit {chk['client_cpu_max']:.0%}): the client, not the server, set the pace"
            + processes_needed(cl, chk["client_cpu_max"]))
    itl_med = (m["itl_ms"] or {}).get("median") or 0.0
    ttft_mean = (m["ttft_ms"] or {}).get("mean") or 0.0
    p99_limit = max(chk["client_lag_p99_max_ms"], chk["client_lag_relative_max"] * itl_med)
    mean_limit = max(chk["client_lag_mean_max_ms"], chk["client_lag_relative_max"] * ttft_mean)
    if cl["lag_p99_ms"] is not None and cl["lag_p99_ms"] > p99_limit:
        add("client_lag", f"the load process's event loop was {cl['lag_p99_ms']:.1f} ms late at p99 (limit "
            f"{p99_limit:.1f} ms; {cl['preempted_per_s'] or 0:.0f} preemptions/s, {(cl['steal'] or 0):.0%} of "
            "its CPUs stolen by the hypervisor): chunk timings, ITL p99 first, are off by as much"
            + processes_needed(cl, chk["client_cpu_max"] / 2))
    elif cl["lag_mean_ms"] is not None and cl["lag_mean_ms"] > mean_limit:
        add("client_lag", f"the load process's event loop was {cl['lag_mean_ms']:.1f} ms late on average "
            f"(limit {mean_limit:.1f} ms): TTFT and ITL are late by as much")
    srv = m["server"]
    if c is None:
        rate_flags(m, chk, add)
    if c is not None and srv is not None and srv["concurrency_mean"] < chk["concurrency_min_ratio"] * c:
        # Requests the client had in flight but the engine did not hold were somewhere else: in a
        # hidden client-side queue (a connection cap), in transit, or in the server's frontend
        # (HTTP, chat template, tokenizing, streaming). Little's law turns the missing concurrency
        # into time per request; a few ms is the frontend's normal share for short requests.
        outside = ((c - srv["concurrency_mean"]) / m["request_throughput"] * 1000.0
                   if m["request_throughput"] else None)
        srv["outside_engine_ms"] = outside
        if outside is None or outside > chk["outside_engine_max_ms"]:
            add("concurrency_not_reached", f"the server's engine held {srv['concurrency_mean']:.1f} requests "
                f"(running + waiting) on average, not the {c} offered: each request spent "
                f"{'?' if outside is None else f'{outside:.0f}'} ms in flight outside the engine (a client-side "
                "connection cap, the network, or an overloaded server frontend)")
        else:
            add("frontend_share", f"the server's engine held {srv['concurrency_mean']:.1f} of {c} requests on "
                f"average: {outside:.0f} ms per request went to the frontend and transit (short requests)")
    if c is not None and cl["inflight_mean"] is not None and cl["inflight_mean"] < chk["concurrency_min_ratio"] * c:
        add("client_concurrency_low", f"the client kept {cl['inflight_mean']:.1f} requests in flight on "
            f"average, not {c}")
    lit = m["littles_law"]
    if lit is not None and abs(lit["ratio"] - 1.0) > chk["littles_law_tolerance"]:
        message = (f"Little's law: throughput × mean E2EL = {lit['concurrency']:.1f}, "
                   f"not the offered {c} (±{chk['littles_law_tolerance']:.0%})")
        per_user = m["requests"]["measured"] / c if c else None
        need = littles_law_window(chk["littles_law_tolerance"], (m["e2el_ms"]["mean"] or 0) / 1000.0)
        if per_user is not None and per_user < need["requests_per_user"]:
            message += (f"; the window held {per_user:.1f} requests per user, too few to tell: the check "
                        f"needs at least {need['requests_per_user']} (a window of {need['e2el_multiple']:g} × "
                        f"the mean E2EL, {need['seconds']:.1f} s here) - raise benchmark_min_requests_per_user "
                        f"to {need['requests_per_user']} (and benchmark_measure_max_s to at least "
                        f"{math.ceil(need['requests_per_user'] * (m['e2el_ms']['mean'] or 0) / 1000.0)} s)")
        add("littles_law", message)
    ramp = m.get("ramp")
    users = c if c is not None else (ramp or {}).get("users")
    if ramp and ramp.get("users_reached") is not None and users is not None and ramp["users_reached"] < users:
        add("ramp_incomplete", f"only {ramp['users_reached']} of {users} users were started")
    req = m["requests"]
    if req["completed"] == 0:
        add("no_completed_requests", "no request of the measured window completed")
    elif c is not None and req["completed"] < chk["min_requests_per_user"] * c:
        add("few_requests", f"{req['completed']} requests completed in the window, fewer than "
            f"{chk['min_requests_per_user']} per user: the figures are noisy")
    elif c is None and req["completed"] < chk["min_requests_rate_step"]:
        add("few_requests", f"{req['completed']} requests completed in the window, fewer than "
            f"{chk['min_requests_rate_step']}: the figures are noisy (a longer window or a higher rate)")
    if req["failed"]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(req["errors"].items()))
        add("errors", f"{req['failed']} of {req['measured']} measured requests failed ({kinds})")
    if m.get("drained") is False:
        add("not_drained", "some measured requests were still running when the drain timed out")
    if srv is None:
        add("no_server_metrics", "no /metrics samples in the window: server concurrency unconfirmed")
    elif srv.get("prefix_cache_hit_rate") is not None and srv["prefix_cache_hit_rate"] > chk["prefix_hit_max"]:
        add("prefix_cache_hits", f"prefix-cache hit rate {srv['prefix_cache_hit_rate']:.0%}: prompts share "
            "prefixes, throughput may be inflated")
    if no_usage:
        add("no_usage", f"{no_usage} responses carried no usage: their output tokens are chunk counts")
    return flags


def processes_needed(cl, cpu_share):
    """'; ...' saying what one load process handled and how many this step needs for each to stay at
    ``cpu_share`` of a core ('' without the figures). A lagging loop is sized at half the CPU limit:
    its lateness grows well before the core is full."""
    busiest = max(cl.get("per_process") or {}, key=lambda w: cl["per_process"][w]["cpu_mean"], default=None)
    rate = (cl.get("chunks_per_s") or {}).get(busiest)
    total = cl.get("chunks_per_s_total")
    cpu = (cl.get("per_process") or {}).get(busiest, {}).get("cpu_mean")
    if not rate or not total or not cpu:
        return ""
    per_process = rate * cpu_share / cpu
    needed = max(len(cl["per_process"]) + 1, math.ceil(total / per_process))
    return (f"; one load process received {rate:,.0f} chunks/s at {cpu:.0%} of a core, and this step's "
            f"{total:,.0f} chunks/s need about {needed} processes at {cpu_share:.0%} each: set "
            f"benchmark_processes to {needed} (on this host) or spread the load over benchmark_load_generators")


def rate_capacity(steps, limits, top):
    """A rate ladder's answer: each valid step judged on the SLO with its exact percentiles
    (rate_ladder.judge, the verdict kept on the step), and the highest rate that met it below every
    rate that did not (rate_ladder.capacity); None without an SLO."""
    if not limits:
        return None
    results = []
    for st in steps:
        if not st["valid"]:
            continue
        st["slo_verdict"] = rate_ladder.judge(st, limits)
        results.append((st["rate"]["offered"], st["slo_verdict"]["passed"]))
    return rate_ladder.capacity(results, limits, top)


def rate_flags(m, chk, add):
    """A rate step's own checks: the client sent on schedule, and offered the rate it promised."""
    rate = m.get("rate") or {}
    late = (rate.get("dispatch_delay_ms") or {}).get("p99")
    if late is not None and late > chk["dispatch_delay_p99_max_ms"]:
        add("dispatch_late", f"the client sent its requests {late:.1f} ms after their scheduled time at p99 "
            f"(limit {chk['dispatch_delay_p99_max_ms']:g} ms): it did not offer the arrival process it promised; "
            "more load processes (benchmark_processes) or a lower rate")
    offered, achieved, n = rate.get("offered"), rate.get("achieved"), m["requests"]["measured"]
    if offered and achieved is not None and n:
        # a Poisson count of n varies by sqrt(n): only a gap beyond chance and the tolerance is told
        allowed = max(chk["rate_tolerance"], 3.0 / math.sqrt(n))
        if abs(achieved / offered - 1.0) > allowed:
            add("rate_off", f"the window's requests arrived at {achieved:.2f} req/s, not the {offered:g} offered "
                f"(±{allowed:.0%})")


# --- the whole run --------------------------------------------------------------------------------
def find_knee(points, fraction=0.9, min_efficiency=0.5):
    """The saturation knee of a throughput curve.

    points: [(concurrency, throughput)] of valid steps. The knee is the lowest concurrency whose
    throughput reaches `fraction` of the peak: beyond it, more concurrency buys latency rather
    than throughput. When that point is the last one and throughput was still growing at least
    `min_efficiency` as fast as concurrency into it, the server is not saturated yet: no knee.
    Efficiency between steps = (X2/X1 − 1) / (C2/C1 − 1) (1 = linear scaling, 0 = flat).
    """
    pts = sorted((c, x) for c, x in points if x is not None)
    eff = []
    for (c1, x1), (c2, x2) in zip(pts, pts[1:]):
        if x1 > 0 and c2 > c1:
            eff.append({"from": c1, "to": c2, "efficiency": (x2 / x1 - 1.0) / (c2 / c1 - 1.0)})
    if not pts:
        return {"knee_concurrency": None, "peak_throughput": None, "peak_concurrency": None,
                "saturated": False, "reason": "no valid step", "efficiency": eff}
    peak_c, peak_x = max(pts, key=lambda p: p[1])
    knee_c, knee_x = next(p for p in pts if p[1] >= fraction * peak_x)
    last = knee_c == pts[-1][0]
    into = next((e["efficiency"] for e in eff if e["to"] == knee_c), None)
    if len(pts) == 1 or (last and into is not None and into >= min_efficiency):
        return {"knee_concurrency": None, "peak_throughput": peak_x, "peak_concurrency": peak_c,
                "saturated": False, "efficiency": eff,
                "reason": "throughput was still rising at the highest valid concurrency: no knee yet"}
    reason = f"the lowest concurrency reaching {fraction:.0%} of the peak output throughput"
    if last and into is not None:
        reason += (f"; it is the highest concurrency measured and throughput grew only {into:.0%} as fast as "
                   "concurrency into it, so a higher step may still add a little")
    return {"knee_concurrency": knee_c, "knee_throughput": knee_x, "peak_throughput": peak_x,
            "peak_concurrency": peak_c, "saturated": True, "efficiency": eff, "reason": reason}


def _count_range(values):
    """{n, min, max, mean} of token counts, or None without any."""
    if not values:
        return None
    return {"n": len(values), "min": min(values), "max": max(values), "mean": math.fsum(values) / len(values)}


def token_accounting(raw):
    """Client-side usage totals over every request of the run against the server's counters
    (vllm:generation_tokens_total / prompt_tokens_total, first to last /metrics sample)."""
    comp = prompt = 0
    missing = 0
    per_output, per_prompt = [], []
    for recs in raw["workers"].values():
        for r in recs:
            if r.get("k") != "req":
                continue
            u = r.get("u")
            if u:
                comp += u[1] or 0
                prompt += u[0] or 0
                if request_success(r):
                    if u[1] is not None:
                        per_output.append(int(u[1]))
                    if u[0] is not None:
                        per_prompt.append(int(u[0]))
            elif r.get("c"):
                missing += 1
    samples = [s for s in raw["master"] if s.get("k") == "srv" and s.get("ok") and "gen" in s]
    out = {"client_completion_tokens": comp, "client_prompt_tokens": prompt,
           "requests_without_usage": missing,
           # what usage said per completed request (the settings say what was asked for)
           "output_tokens_per_request": _count_range(per_output),
           "prompt_tokens_per_request": _count_range(per_prompt),
           "server_generation_tokens": None,
           "server_prompt_tokens": None, "match": None}
    if len(samples) >= 2:
        first, last = samples[0], samples[-1]
        out["server_generation_tokens"] = int(round(last["gen"] - first["gen"]))
        if "prompt" in first and "prompt" in last:
            out["server_prompt_tokens"] = int(round(last["prompt"] - first["prompt"]))
        out["match"] = out["server_generation_tokens"] == comp and missing == 0
    return out


def analyze(raw, *, slo=None, checks=None):
    """The report's measured part: per-step metrics, saturation, token accounting, run status."""
    chk = dict(DEFAULT_CHECKS, **(checks or {}))
    start = next((r for r in raw["master"] if r.get("k") == "start"), None)
    if start is None:
        raise ValueError("the raw folder has no master.jsonl start record: the load run did not start")
    cfg = start["config"]
    ladder = cfg["ladder"]
    by_rate = cfg.get("mode") == "rate"
    if cfg.get("workload") == "shared_prefix":
        chk["prefix_hit_max"] = 1.0        # its prompts share a prefix on purpose: hits are the point
    run_steps = sorted({r["s"] for r in raw["master"] if r.get("k") == "phase" and r.get("s", -1) >= 0})
    steps = []
    for i in run_steps:
        measure = _master_phase(raw, i, "measure")
        if measure is None:
            continue
        # a rate step's rate is the master's (the sweep's, or the capacity search's choice)
        steps.append(step_metrics(raw, i, None if by_rate else ladder[i],
                                  slo=slo if slo is not None else cfg.get("slo"), checks=chk,
                                  rate=measure.get("rate") if by_rate else None,
                                  limits=(cfg.get("limits") or None) if by_rate else None))
    end = next((r for r in raw["master"] if r.get("k") == "phase" and r.get("p") == "end"), None)
    done = next((r for r in raw["master"] if r.get("k") == "done"), None)
    if by_rate:
        knee = {"knee_concurrency": None, "peak_throughput": None, "peak_concurrency": None,
                "reason": "a rate ladder: see its capacity at the SLO"}
    else:
        knee = find_knee([(s["concurrency"], s["output_throughput"]) for s in steps if s["valid"]],
                         chk["knee_fraction"], chk["knee_min_efficiency"])
    return {"steps": steps, "saturation": knee, "tokens": token_accounting(raw),
            "mode": "rate" if by_rate else "concurrency",
            "capacity": rate_capacity(steps, cfg.get("limits") or {}, ladder[-1]) if by_rate else None,
            "stopped_early": end.get("stop_reason") if end else None,
            "complete": done is not None,
            "steps_planned": len(ladder), "steps_run": len(steps), "config": cfg,
            "started_wall": start.get("wall"), "finished_wall": done.get("wall") if done else None,
            "load_mode": start.get("mode"), "load_host": start.get("host")}


# --- comparison with the previous run ---------------------------------------------------------------
COMPARED = (("output_throughput", None, True), ("request_throughput", None, True),
            ("ttft_ms", "median", False), ("ttft_ms", "p99", False), ("tpot_ms", "median", False),
            ("itl_ms", "p99", False), ("e2el_ms", "median", False))


def _metric(step, key, stat):
    v = step.get(key)
    if stat is not None:
        v = (v or {}).get(stat)
    return v


def compare(current_steps, previous_steps, noise=0.05):
    """Per concurrency present and valid in both runs: each metric's change, and whether it is
    better, worse or the same (within ±noise). Higher throughput, lower latency is better."""
    prev = {s["concurrency"]: s for s in previous_steps if s.get("valid")}
    rows = []
    for s in current_steps:
        p = prev.get(s["concurrency"])
        if p is None or not s.get("valid"):
            continue
        for key, stat, higher_better in COMPARED:
            a, b = _metric(s, key, stat), _metric(p, key, stat)
            if a is None or b is None or b == 0:
                continue
            change = a / b - 1.0
            if abs(change) <= noise:
                verdict = "same"
            else:
                verdict = "better" if (change > 0) == higher_better else "worse"
            rows.append({"concurrency": s["concurrency"], "metric": key + (f".{stat}" if stat else ""),
                         "previous": b, "current": a, "change": change, "verdict": verdict})
    return rows
