# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""One host's run record (what happened in the migration, how long each step took), the failed
step a failed task is charged to, and the plan as the numbered todo list an operator reads.

``run_record`` takes one mapping, ``RecordInputs`` (the filter modelswap.vllm.migrate_record
builds it in roles/migrate/tasks/record.yml). Pure, no I/O: table-tested
(tests/unit/plugins/module_utils/fleet/test_run_record.yaml).
"""
from __future__ import annotations

import os
from typing import TypedDict

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.plan_data import checked, dig

RECORD_SCHEMA = 1


class RecordInputs(TypedDict, total=False):
    """What the record is made of; each step's result None where the step did not report.

    host: the inventory name; run_id: the run's id; target: the catalog name; plan: the host's
    plan (fleet/plan_steps.py's); check_mode: a preview (required, like the four before);
    timings: {step: the time it started (epoch seconds), "end": ...}; fetch: model_fetch_result;
    service: vllm_service_result; purge: model_purge's result; benchmark: benchmark_result;
    failure: {"step", "task", "msg"} of a failed step; lb: lb_pool_results ({"drain", "rejoin"});
    prestage: page_cache_warm's result (migrate_prestage_result); replica: the host's node of its
    replica group ({group, nodes, rank, head}; None for a host that serves alone).
    """
    host: str
    run_id: str
    target: str
    plan: dict
    timings: dict | None
    fetch: dict | None
    service: dict | None
    purge: dict | None
    benchmark: dict | None
    failure: dict | None
    check_mode: bool
    lb: dict | None
    prestage: dict | None
    replica: dict | None


RECORD_REQUIRED = ("host", "run_id", "target", "plan", "check_mode")
PRESTAGE_KEYS = ("skipped", "reason", "bytes_total", "bytes_read", "seconds", "bytes_per_s", "complete")
# what the run record keeps of benchmark_result (beside its paths)
BENCHMARK_KEPT = ("saturation", "stopped_early", "comparison", "capacity", "headline")


def record_inputs(values) -> RecordInputs:
    """``values`` checked as RecordInputs (InputError for an unknown or missing key)."""
    return checked("migrate_record", values, RecordInputs, RECORD_REQUIRED)


def clean_path(value):
    """A path as the record and the summary print it: normalized ('a/b/../c' -> 'a/c'); None stays."""
    return os.path.normpath(value) if isinstance(value, str) and value else value


def outcome_of(plan: dict, service, failure, check_mode: bool) -> tuple:
    """(outcome, rolled_back): preview, migrated, changed, unchanged, failed or rolled_back."""
    failed_msg = (failure or {}).get("msg") or ""
    rolled_back = "rolled back" in failed_msg.lower() and "not rolled back" not in failed_msg.lower()
    if failure:
        return ("rolled_back" if rolled_back else "failed"), rolled_back
    if check_mode:
        return "preview", rolled_back
    if dig(service, "swapped"):
        return "migrated", rolled_back
    return ("changed" if plan.get("changes") else "unchanged"), rolled_back


def step_times(timings) -> dict:
    """{step: {"started", "seconds"}} from the steps' start marks: a step lasts until the next mark."""
    steps = {}
    marks = sorted(((k, v) for k, v in (timings or {}).items() if v is not None), key=lambda kv: kv[1])
    for (name, start), nxt in zip(marks, marks[1:] + [(None, None)]):
        if name == "end":
            continue
        steps[name] = {"started": start, "seconds": round(nxt[1] - start, 3) if nxt[1] else None}
    return steps


def run_record(inputs: RecordInputs) -> dict:
    """The JSON record of one host's migration (what happened, how long each step took)."""
    plan, service, fetch, purge = inputs["plan"], inputs.get("service"), inputs.get("fetch"), inputs.get("purge")
    lb, prestage, benchmark = inputs.get("lb"), inputs.get("prestage"), inputs.get("benchmark")
    failure, check_mode = inputs.get("failure"), inputs["check_mode"]
    outcome, rolled_back = outcome_of(plan, service, failure, check_mode)
    return {
        "schema": RECORD_SCHEMA, "run_id": inputs["run_id"], "host": inputs["host"], "target": inputs["target"],
        "outcome": outcome, "check_mode": check_mode,
        # a node of a replica group: the group swaps as one unit, its head serves the API
        "replica": inputs.get("replica"),
        "failure": failure, "rolled_back": rolled_back,
        "steps": step_times(inputs.get("timings")), "plan": plan,
        "purge": {"removed": len(dig(purge, "removed", default=[]) or []),
                  "planned_bytes": dig(purge, "planned_bytes"), "freed_bytes": dig(purge, "freed_bytes")},
        "fetch": {"commit": dig(fetch, "commit"), "bytes_downloaded": dig(fetch, "bytes_downloaded"),
                  "bytes_received": dig(fetch, "bytes_received"),
                  "files_downloaded": dig(fetch, "files_downloaded"), "seconds": dig(fetch, "seconds"),
                  "mb_per_s": dig(fetch, "mb_per_s"), "verified": dig(fetch, "verification", "ok")},
        "swap": {"swapped": bool(dig(service, "swapped")), "replaced_model": dig(service, "replaced_model"),
                 "downtime_s": dig(service, "downtime_s"), "start_to_ready_s": dig(service, "start_to_ready_s"),
                 "startup_phases": dig(service, "startup", "phases"),
                 "startup_reported": dig(service, "startup", "reported"),
                 # the quality gate: passed, each check's value and limit, the reference compared with
                 "quality": ({k: dig(service, "quality", k) for k in ("passed", "checks", "reference")}
                             if dig(service, "quality") else None)},
        # the load balancer: out of the pool from the drain to the rejoin (lb_pool_results)
        "lb": ({"drained": bool(dig(lb, "drain", "changed")), "rejoined": bool(dig(lb, "rejoin", "changed")),
                "pool": dig(lb, "drain", "pool"), "in_flight_at_start": dig(lb, "drain", "in_flight_at_start"),
                "sessions_at_start": dig(lb, "drain", "sessions_at_start"),
                "drain_seconds": dig(lb, "drain", "drain_seconds"), "seconds_out": dig(lb, "rejoin", "seconds_out")}
               if isinstance(lb, dict) and lb.get("drain") else None),
        "prestage": ({k: prestage.get(k) for k in PRESTAGE_KEYS}
                     if isinstance(prestage, dict) and not prestage.get("skipped_by_ansible") and "bytes_total" in prestage
                     else None),
        "benchmark": (dict({k: benchmark.get(k) for k in BENCHMARK_KEPT},
                           run_dir=clean_path(benchmark.get("run_dir")), report=clean_path(benchmark.get("report")))
                      if benchmark else None),
    }


def failure_of(marks: dict, task_name: str, result) -> dict:
    """{"step", "task", "msg"} of a failed task: the step is the last one started (its mark)."""
    started = sorted(((v, k) for k, v in (marks or {}).items() if k != "end" and v is not None))
    result = result if isinstance(result, dict) else {}
    return {"step": started[-1][1] if started else "preflight", "task": task_name or "",
            "msg": result.get("msg") or result.get("stderr") or "failed"}


def plan_lines(plan: dict, host: str, check_mode: bool = True) -> list:
    """The plan as the numbered todo list an operator reads: a preview says what would fail, a
    real run what failed."""
    verdict = "would fail" if check_mode else "failed"
    lines = [f"{host}: migrate to {plan.get('target')}"
             + ("" if plan.get("ready") else f" - {verdict}: {dig(plan, 'failure', 'msg')}")]
    for n, step in enumerate(plan.get("steps", []), 1):
        mark = "x" if step.get("failed") else " "
        lines.append(f"  [{mark}] {n}. {step['title']}: {step['text']}")
        if step.get("failed"):
            lines.append(f"        failed here: {step['failed']}")
    return lines
