# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""One host's final plan and run record from its facts: what each step reported, else what the
plan found it would do (a preview's host, a host the plan settled, a host that failed early).

``final_of`` takes the host's variables as Ansible holds them (hostvars[host]: the read
``__migrate_read``, the plan ``__migrate``, the steps' published results) and builds the inputs
of plan_steps.plan_steps and run_record.run_record from them. The migrate role calls it through
the filter modelswap.vllm.migrate_final, once per host of a run's record and once for the whole
play in a preview (no per-host template to compile again in every worker). Pure, no I/O.
"""
from __future__ import annotations

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import plan_steps, run_record
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.plan_data import dig

# what the plan's service part adds to a step's reported service
PLAN_SERVICE_KEYS = ("pool", "repairs", "restart_reasons", "replica")
TRUE_WORDS = ("true", "yes", "on", "1", "y", "t")


def _bool(value) -> bool:
    """Ansible's truth of a setting (a bool, or a word as an inventory writes it)."""
    if isinstance(value, str):
        return value.strip().lower() in TRUE_WORDS
    return bool(value)


def _float(value) -> float:
    """A number of bytes per second as Jinja's float filter reads it (0.0 for what is not one)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _get(mapping, key, default=None):
    """mapping[key] where the key is there (None stays None), else default."""
    return mapping[key] if hasattr(mapping, "get") and key in mapping else default


def final_of(facts, *, run_id: str, serve: str, settings: dict, check_mode: bool, now: float,
             replica: dict | None = None, group_swap: str = "") -> dict:
    """{"plan", "record", "marks"} of the host whose variables are ``facts``.

    settings: the role's record settings ({"benchmark", "download_rate", "install": {"enabled"}}),
    used where the plan did not keep its own; now: the epoch seconds the record ends at; replica:
    the host's node of its replica group (serving/replica_group.py's node), None when it serves
    alone; group_swap: why it restarts although its own plan keeps it (its group restarts).
    """
    plan_reg = _get(facts, "__migrate", {}) or {}
    read = _get(facts, "__migrate_read", {}) or {}
    own = _get(plan_reg, "settings", settings)
    marks = dict(_get(facts, "__migrate_marks", _get(plan_reg, "marks", {})) or {}, end=now)
    target = _get(plan_reg, "target", serve)
    plan_service = _get(plan_reg, "service", None)
    if group_swap and plan_service is not None and not plan_service.get("would_swap"):
        plan_service = dict(plan_service, would_swap=True, repairs=[],
                            restart_reasons=list(plan_service.get("restart_reasons") or []) + [group_swap],
                            replaced_model=dig(read, "service", "deployment", "model"))
    if replica and plan_service is not None:
        plan_service = dict(plan_service, replica=replica)
    reported = _get(facts, "vllm_service_result", plan_service if plan_service is not None else {})
    service = dict(reported or {})
    service.update({key: value for key, value in (plan_service or {}).items() if key in PLAN_SERVICE_KEYS})
    install = dict(_get(facts, "vllm_service_install_result", _get(plan_reg, "install", {})) or {},
                   enabled=_bool(own["install"]["enabled"]))
    fetched = _get(facts, "model_fetch_result", None)
    if isinstance(fetched, dict) and "peer" in fetched:
        source = _get(fetched["peer"], "got", _get(plan_reg, "source", None))
    else:
        source = _get(plan_reg, "source", None)
    failure = _get(facts, "__migrate_failure", None)
    plan = plan_steps.plan_steps(plan_steps.plan_inputs({
        "target": target, "disk": _get(read, "disk", None),
        "purge": _get(facts, "migrate_purge_result", _get(read, "purge", None)),
        "fetch": _get(facts, "model_fetch_result", _get(read, "fetch", None)),
        "service": service, "benchmark": own["benchmark"], "failure": failure,
        "download_rate": _float(own["download_rate"]), "install": install, "source": source}))
    record = run_record.run_record(run_record.record_inputs({
        "host": _get(facts, "inventory_hostname", ""), "run_id": run_id, "target": target, "plan": plan,
        "timings": marks, "fetch": fetched, "service": _get(facts, "vllm_service_result", plan_service),
        "purge": _get(facts, "migrate_purge_result", None), "benchmark": _get(facts, "benchmark_result", None),
        "failure": failure, "check_mode": check_mode, "lb": _get(facts, "lb_pool_results", None),
        "prestage": _get(facts, "migrate_prestage_result", None), "replica": replica}))
    return {"plan": plan, "record": record, "marks": marks}
