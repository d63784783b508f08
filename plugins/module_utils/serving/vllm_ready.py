# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""vllm_ready's logic: its options, the wait's budget, the three waits with their results and messages.

The module vllm_ready is a thin shell over ``wait_until_ready`` / ``wait_until_stopped`` /
``wait_until_idle``: they take plain option values, a ``UnitReader`` (serving/vllm_unit_state.py:
systemctl and journalctl through a ``HostCommands``) and the clock.

- ``wait_until_ready`` walks the gates (serving/vllm_gates.py), stopping early when the unit
  fails or a process outside it owns the port, and on failure quotes the unit's journal;
- ``wait_until_stopped`` waits until no process of the old unit is left and nothing listens on
  the port (the port owners and unit of each process, read from /proc);
- ``wait_until_idle``, before a server is stopped behind a load balancer, waits until it has no
  request in flight: ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` of the served
  model, read from ``/metrics``, stay 0 for a settle time.

The budget of a start is derived from the model's size on disk and its parallelism
(``startup_budget``) unless a timeout is given. Every function that touches the system takes a
clock, a HostCommands or a callable, so the tests drive it with fakes.
"""
from __future__ import annotations

import os
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_startup
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_gates import GateError, read_in_flight, wait_ready
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_unit_state import (
    JOURNAL_SCAN, ReadyError, describe_listener, foreign_listeners, journal_errors, port_listeners, unit_problem,
    unit_processes)


# --------------------------------------------------------------------------------------------
# budget
# --------------------------------------------------------------------------------------------
BUDGET_BASE_S = 180          # interpreter, imports, engine and API server start, one process
BUDGET_PER_GIB_S = 4         # weight loading, pessimistic (~0.25 GiB/s from disk to devices)
BUDGET_PER_EXTRA_GPU_S = 30  # worker processes, NCCL init, the P2P check, per extra GPU
BUDGET_COMPILE_S = 180       # torch.compile and CUDA graph capture (skipped with enforce_eager)


def startup_budget(size_bytes: int = 0, parallel: int = 1, enforce_eager: bool = False) -> int:
    """Seconds to allow a vLLM start, from the model's size on disk and its parallelism.

    Calibrated on the start-up times seen in practice (docs/vllm-operations.md): 7B ~40 s,
    Llama-70B-FP8 TP=8 several minutes, 72B TP=4 ~17 min, Llama-4-Scout TP=4 ~10 min; the
    budget is generous for small models and close to those for the large ones.
    """
    gib = max(0, int(size_bytes or 0)) / float(1 << 30)
    budget = BUDGET_BASE_S + BUDGET_PER_GIB_S * gib + BUDGET_PER_EXTRA_GPU_S * max(0, int(parallel or 1) - 1)
    if not enforce_eager:
        budget += BUDGET_COMPILE_S
    return int(round(budget))


def tree_size(path: str) -> int:
    """Bytes of the files under ``path`` (symlinks followed: a cache snapshot links to blobs)."""
    total = 0
    seen = set()
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


# --------------------------------------------------------------------------------------------
# the module's logic: options, the budget, the three waits and their results
# --------------------------------------------------------------------------------------------
# An unspecified or all-addresses bind is probed on the loopback address of its family.
_PROBE_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


# state=idle: the default budget, and how long running + waiting must stay 0.
IDLE_TIMEOUT_S = 300.0


def format_seconds(value) -> str:
    """Seconds for a message: whole above 10 s, one decimal below."""
    return "%.0f" % value if value >= 10 else "%.1f" % value


def probe_host(host: str) -> str:
    return _PROBE_HOSTS.get(host, host)


def options_problem(params: dict):
    """What is wrong with the module's options (the message it fails with), or None."""
    if params.get("idle_settle") is not None and params["idle_settle"] < 0:
        return "vllm_ready: idle_settle must be >= 0 seconds"
    if not 0 < params["port"] < 65536:
        return "vllm_ready: port %d is not a TCP port (1..65535)" % params["port"]
    if params["timeout"] is not None and params["timeout"] < 0:
        return "vllm_ready: timeout must be >= 0 seconds"
    if params["poll_interval"] <= 0 or params["request_timeout"] <= 0:
        return "vllm_ready: poll_interval and request_timeout must be > 0"
    return None


def api_key_from_file(path: str, read_text=None):
    """The VLLM_API_KEY of the unit's EnvironmentFile ``path``; None when the file is missing or
    lacks it (the server then runs without a key). ReadyError when it cannot be read."""
    try:
        text = read_text(path) if read_text else _read_text(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ReadyError("vllm_ready: cannot read the API key file %s: %s; run with become"
                         % (path, exc.strerror or exc))
    return env_file_value(text, "VLLM_API_KEY")


def _read_text(path):
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def budget_for(params: dict, size_of=tree_size) -> dict:
    """The wait's time limit: the timeout given, 120 s to stop, or derived from the model."""
    if params["timeout"] is not None:
        return {"seconds": params["timeout"], "derived": False, "model_bytes": None}
    if params["state"] == "stopped":
        return {"seconds": 120.0, "derived": False, "model_bytes": None}
    if params["state"] == "idle":
        return {"seconds": IDLE_TIMEOUT_S, "derived": False, "model_bytes": None}
    size = size_of(params["model_path"]) if params["model_path"] else 0
    seconds = startup_budget(size, params["parallel_size"], params["enforce_eager"])
    return {"seconds": float(seconds), "derived": True, "model_bytes": size}


def env_file_value(text: str, name: str):
    """The value of ``name`` in a systemd EnvironmentFile's text (last assignment wins), or None.

    Handles ``NAME=value``, ``NAME="value"`` (backslash escapes) and ``NAME='value'``; comments
    and blank lines are skipped.
    """
    value = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, raw = line.partition("=")
        if not sep or key.strip() != name:
            continue
        raw = raw.strip()
        if len(raw) >= 2 and raw[0] == raw[-1] == '"':
            out, i, body = [], 0, raw[1:-1]
            while i < len(body):
                if body[i] == "\\" and i + 1 < len(body):
                    out.append(body[i + 1])
                    i += 2
                else:
                    out.append(body[i])
                    i += 1
            value = "".join(out)
        elif len(raw) >= 2 and raw[0] == raw[-1] == "'":
            value = raw[1:-1]
        else:
            value = raw
    return value


def _restarts(show: dict) -> int:
    try:
        return int(show.get("NRestarts") or 0)
    except ValueError:
        return 0


def wait_until_stopped(params: dict, unit, budget: dict, *, clock=time.monotonic, sleep=time.sleep,
                       processes_of=unit_processes, listeners_on=port_listeners):
    """Wait until no process of the unit is left and nothing listens on the port.

    Returns (result, failure message or None); the message only with fail_when_not_ready.
    """
    start = clock()
    while True:
        procs = processes_of(params["unit"]) if params["unit"] else []
        listeners = listeners_on(params["port"])
        if not procs and not listeners:
            break
        if clock() - start >= budget["seconds"]:
            break
        sleep(min(params["poll_interval"], 0.5))
    result = {"ready": not procs and not listeners, "elapsed": round(clock() - start, 3),
              "budget": budget, "processes": procs, "port_listeners": listeners,
              "monotonic": clock(), "changed": False}
    if unit:
        result["unit_state"] = unit.show()
    if result["ready"]:
        return result, None
    parts = []
    if procs:
        parts.append("%d process(es) of %s remain: %s" % (
            len(procs), params["unit"],
            "; ".join("pid %d %s" % (p["pid"], p["cmdline"][:120]) for p in procs[:5])))
    if listeners:
        parts.append("port %d is still held by %s" % (
            params["port"], "; ".join(describe_listener(e) for e in listeners)))
    result["last_error"] = "; ".join(parts)
    if not params["fail_when_not_ready"]:
        return result, None
    return result, ("vllm_ready: waiting for the old vLLM service to be gone failed after "
                    "%s s: %s. Stop the listed processes (or raise the timeout) and run "
                    "again." % (format_seconds(result["elapsed"]), result["last_error"]))


# A unit started this long before the wait began counts as the start the wait is for (the swap
# starts the unit, then waits).
STARTED_BEFORE_WAIT_S = 60


def unit_started_epoch(unit_state: dict, now_epoch: float, now_monotonic: float):
    """Epoch seconds the unit's main process started (its monotonic start -> epoch), or None."""
    start_us = int(unit_state.get("ExecMainStartTimestampMonotonic") or 0)
    if not start_us:
        return None
    return now_epoch - (now_monotonic - start_us / 1e6)


def journal_since(started_epoch: float, unit_state: dict, now_epoch: float, now_monotonic: float) -> float:
    """Epoch seconds the failure's journal starts at: the wait's start, or the unit's last start
    (monotonic microseconds -> epoch) when that is later; a second early for rounding."""
    since = started_epoch - 1
    unit_start = unit_started_epoch(unit_state, now_epoch, now_monotonic)
    if unit_start is not None:
        since = max(since, unit_start - 1)
    return since


def not_ready_message(params: dict, outcome: dict, budget: dict, result: dict) -> str:
    """The failure message of a wait for ready: the gate, the error, the budget, the journal."""
    what = params["served_model_name"] or "the server"
    msg = ("vllm_ready: %s on %s:%d is not ready - gate '%s' failed after %s s (budget %s s): %s"
           % (what, probe_host(params["host"]), params["port"], outcome["failed_gate"],
              format_seconds(outcome["elapsed"]), format_seconds(budget["seconds"]), outcome["last_error"]))
    if outcome["stopped_by"] == "timeout":
        msg += ". The budget ran out: raise the timeout if the model needs longer, or read the journal"
    if result.get("journal_errors"):
        msg += ". Errors in the unit's journal: " + " | ".join(result["journal_errors"])
    elif result.get("journal"):
        msg += ". Last journal lines: " + " | ".join(result["journal"][-5:])
    return msg


def wait_until_ready(params: dict, unit, budget: dict, *, clock=time.monotonic, sleep=time.sleep,
                     epoch=time.time, listeners_on=port_listeners, walk_gates=wait_ready):
    """Walk the gates (stopping early on the unit's failure or a foreign port owner).

    Returns (result, failure message or None); the message only with fail_when_not_ready.
    ReadyError when the unit is not loaded.
    """
    started_epoch = epoch()
    restarts_before = 0
    if unit:
        first = unit.show()
        if first.get("LoadState") != "loaded":
            raise ReadyError("vllm_ready: the unit %s is not loaded (LoadState=%s); deploy it "
                             "before waiting for it" % (params["unit"], first.get("LoadState")))
        restarts_before = _restarts(first)
    seen = {"listeners": []}

    def check():
        if unit:
            problem = unit_problem(unit.show(), restarts_before)
            if problem:
                return problem
        if unit and params["check_port_owner"]:
            listeners = listeners_on(params["port"])
            seen["listeners"] = listeners
            foreign = foreign_listeners(listeners, params["unit"])
            if foreign:
                return ("port %d is held by a process outside %s: %s" % (
                    params["port"], params["unit"], "; ".join(describe_listener(e) for e in foreign)))
        return None

    outcome = walk_gates(
        host=probe_host(params["host"]), port=params["port"],
        served_name=params["served_model_name"], api_key=params["api_key"],
        budget=budget["seconds"], poll=params["poll_interval"],
        request_timeout=params["request_timeout"], completion=params["completion"],
        prompt=params["prompt"], scheme=params["scheme"], check=check, api=params["api"],
        clock=clock, sleep=sleep)
    result = dict(outcome, budget=budget, changed=False, monotonic=clock(),
                  port_listeners=seen["listeners"] or listeners_on(params["port"]))
    if unit:
        result["unit_state"] = unit.show()
    if outcome["ready"]:
        if unit:
            ready_epoch = epoch()
            started = unit_started_epoch(result["unit_state"], ready_epoch, clock())
            if started is not None and started >= started_epoch - STARTED_BEFORE_WAIT_S:
                # a start this wait saw: where its time went (the journal since the start)
                lines = unit.journal(started - 1, JOURNAL_SCAN, output="short-unix")
                result["startup"] = vllm_startup.startup_phases(lines, started, ready_epoch=ready_epoch)
        return result, None
    if unit:
        since = journal_since(started_epoch, result.get("unit_state", {}), epoch(), clock())
        scanned = unit.journal(since, max(JOURNAL_SCAN, params["journal_lines"]))
        result["journal_errors"] = journal_errors(scanned)
        result["journal"] = scanned[-params["journal_lines"]:] if params["journal_lines"] > 0 else []
    if not params["fail_when_not_ready"]:
        return result, None
    return result, not_ready_message(params, outcome, budget, result)


def base_url(params: dict) -> str:
    """http(s)://<probe address>:<port> of the server (an IPv6 address in brackets)."""
    host = probe_host(params["host"])
    return "%s://%s:%d" % (params["scheme"], host if ":" not in host else "[%s]" % host, params["port"])


def wait_until_idle(params: dict, budget: dict, *, clock=time.monotonic, sleep=time.sleep,
                    read=read_in_flight):
    """Wait until the server has no request in flight: running + waiting of the served model stay
    0 for ``idle_settle`` seconds (a request spends a moment in the API server before the engine
    counts it, and its last chunks leave after the engine is done with it). A server that refuses
    the connection has nothing in flight (idle at once, ``server_absent``). One reading at least,
    whatever the budget: with ``timeout: 0`` the result says what is in flight now. A settle
    that began within the budget may end after it (by ``idle_settle`` at most): a server seen idle
    at the deadline is not reported busy.

    Returns (result, failure message or None); the message only with fail_when_not_ready.
    """
    base = base_url(params)
    settle = params.get("idle_settle")
    settle = 1.0 if settle is None else settle
    start = clock()
    first = last = None
    idle_since = None
    samples = 0
    last_error = None
    stopped_by = None
    absent = False
    while True:
        now = clock()
        try:
            counts = read(base, params["served_model_name"], params["api_key"], params["request_timeout"])
        except GateError as exc:
            if exc.refused:
                absent, last_error = True, None
                break
            last_error = str(exc)
            idle_since = None
            if exc.final:
                stopped_by = "final"
                break
        else:
            samples += 1
            first = first or counts
            last = counts
            last_error = None
            if counts["running"] + counts["waiting"] == 0:
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= settle:
                    break
            else:
                idle_since = None
        remaining = budget["seconds"] - (clock() - start)
        if idle_since is not None:          # settling: at most idle_settle past the deadline
            remaining = max(remaining, idle_since + settle - clock())
        if remaining <= 0:
            stopped_by = "timeout"
            break
        sleep(min(params["poll_interval"], remaining))
    ready = absent or (stopped_by is None)
    result = {"ready": ready, "elapsed": round(clock() - start, 3), "budget": budget,
              "in_flight": first, "in_flight_last": last, "samples": samples, "server_absent": absent,
              "idle_settle": settle, "monotonic": clock(), "changed": False}
    if ready:
        return result, None
    result["stopped_by"] = stopped_by
    result["last_error"] = last_error or "%d running, %d waiting" % (last["running"], last["waiting"])
    if not params["fail_when_not_ready"]:
        return result, None
    return result, not_idle_message(params, base, result)


def not_idle_message(params: dict, base: str, result: dict) -> str:
    """The failure message of a wait for idle: what was and still is in flight, and the fix."""
    name = params["served_model_name"] or "the server"
    if result["stopped_by"] == "final" or result["in_flight_last"] is None:
        return ("vllm_ready: cannot tell whether %s on %s is idle: %s"
                % (name, base, result["last_error"]))
    first, last = result["in_flight"], result["in_flight_last"]
    return ("vllm_ready: %s on %s still had requests in flight after %s s (budget %s s): %d running, "
            "%d waiting (%d running, %d waiting when the wait began). Raise the timeout, or find the "
            "clients that reach the server without the load balancer"
            % (name, base, format_seconds(result["elapsed"]), format_seconds(result["budget"]["seconds"]),
               last["running"], last["waiting"], first["running"], first["waiting"]))
