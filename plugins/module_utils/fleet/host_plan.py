# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""One host's migration planned from one read (fleet/migrate_facts.py's result): which steps must run
(the todo), the first refusal, the repairs an interrupted run left to do, the diffs of the slot's
files, and each step's result as its role reports it in check mode, so the preview's steps are
fleet/plan_steps.py's from the same numbers the steps give.

Pure, no I/O: table-tested (tests/unit/plugins/module_utils/fleet/test_host_plan.yaml); the
controller calls it through the filter modelswap.vllm.migrate_read_plan.
"""
from __future__ import annotations

import hashlib
import os
from typing import TypedDict

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.plan_data import dig
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.plan_steps import STEP_ORDER, plan_steps
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import service_files
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_service_facts import restart_reasons


class ReadSettings(TypedDict, total=False):
    """What the plan weighs besides the read (roles/migrate/vars/main.yml's __migrate_plan_settings).

    host: the inventory name (in the messages); unit: the slot's systemd unit; secret_path: the API
    key file; install: {enabled, version, venv, source}; force_restart; replaced_todo: the units
    set up outside modelswap the swap replaces ([{"unit"}]); purge_allowed, purge_all_listed;
    fail_on_does_not_fit; benchmark: {enabled, concurrency}; download_rate: bytes/s (0: unknown);
    fleet: this host's part of fleet/fleet_plan.py's plan (source, store_problem, purge_by, pool);
    problems: refusals judged on the controller first ([{"step", "msg"}]); group_problems: why the
    host's replica group cannot be changed in this play (a node out of it; messages); host_problems: the
    swap's refusals (messages); swap_problems: what a swap needs on the controller (the quality
    reference, the evaluation hook; refused only where the plan swaps); drain_mark, staged_record:
    the files an interrupted run leaves.
    """
    host: str
    unit: str
    secret_path: str
    install: dict
    force_restart: bool
    replaced_todo: list
    purge_allowed: bool
    purge_all_listed: bool
    fail_on_does_not_fit: bool
    benchmark: dict
    download_rate: float
    fleet: dict
    problems: list
    group_problems: list
    host_problems: list
    swap_problems: list
    drain_mark: str
    staged_record: str


def purge_problem(host: str, target: str, disk: dict, settings: ReadSettings) -> str:
    """The model_purge role's refusal of this plan (forbidden, or a purge that would not make room); "" for none."""
    verdict = disk.get("verdict")
    if settings.get("purge_all_listed") or verdict != "does_not_fit":
        if settings.get("purge_allowed", True) or verdict == "fits":
            return ""
    if verdict == "does_not_fit":
        return ("%s: %s. Purging would not make room for %s: %s; nothing was deleted"
                % (host, disk.get("summary"), target, disk.get("reason")))
    return ("%s: %s. %s needs a purge of %s but model_purge_allowed is false; nothing was deleted"
            % (host, disk.get("summary"), target, ", ".join(disk.get("purge") or []) or "partial downloads"))


def config_diffs(read: dict, expected: dict, drift: list, secret_path, secret_ok) -> list:
    """The diffs vllm_service's write would show (service_files' entries), made on the controller
    from the read's texts: one per drifted file, a note for the API key file (never its content)."""
    texts = dig(read, "config", "text", default={}) or {}
    sums = dig(read, "config", "sha1", default={}) or {}
    out = []
    for path in drift:
        exists = sums.get(path) is not None
        if exists and texts.get(path) is None:      # too large or not UTF-8 to show
            out.append({"prepared": "%s: the content would change (not shown: not small UTF-8 text)\n" % path})
            continue
        out.append(service_files.diff_of({"path": path, "exists": exists, "secret": False,
                                          "before": (texts.get(path) or "").encode("utf-8"),
                                          "after": str(expected[path]).encode("utf-8")}, True))
    if secret_ok is False and secret_path:
        out.append(service_files.diff_of({"path": secret_path, "secret": True}, True))
    return out


def repairs_of(target: str, service: dict, commit, settings: ReadSettings, pool: dict) -> tuple:
    """What a host that serves the target still lacks, when an interrupted run left it so:
    (lines for the plan, record it, rejoin the pool). The record must name what serves (a kill
    between the start and the record leaves the old one there, and the old configuration as the
    one a later rollback restores); a host this run's drain left out of the pool goes back."""
    lines, record, rejoin = [], False, False
    deployment = service.get("deployment") or {}
    files = service.get("files") or {}
    if dig(service, "unit", "active_state") == "active" and (
            deployment.get("model") != target or (commit and deployment.get("commit") != commit)):
        record = True
        lines.append("repair the record: it names %s, %s serves" % (
            "%s@%s" % (deployment.get("model"), str(deployment.get("commit") or "")[:12])
            if deployment.get("model") else "no deployment", target))
    elif settings.get("staged_record") and files.get(settings["staged_record"]):
        record = True
        lines.append("finish the record's interrupted write (its saved configurations wait in %s)"
                     % os.path.dirname(settings["staged_record"]))
    mark = settings.get("drain_mark")
    if mark and files.get(mark):
        rejoin = True
        status = pool.get("status")
        lines.append("rejoin the pool: %s is %s there since an interrupted run drained it" % (
            settings.get("host") or "the host", status) if status and status != "UP"
            else "forget the drain mark of an interrupted run (the host is in the pool)")
    return lines, record, rejoin


def _refusals(target: str, disk: dict, swap: bool, settings: ReadSettings) -> list:
    """Every refusal of the plan as {"step", "msg"}, in the steps' order (the earliest first)."""
    fleet = settings.get("fleet") or {}
    problems = list(settings.get("problems") or [])
    problems.extend({"step": "preflight", "msg": msg} for msg in settings.get("group_problems") or [])
    if disk.get("verdict") == "does_not_fit" and settings.get("fail_on_does_not_fit", True):
        problems.append({"step": "preflight", "msg": "%s does not fit on %s: %s" % (
            target, dig(disk, "filesystem", "path"), disk.get("reason"))})
    why = purge_problem(settings.get("host") or "", target, disk, settings) if disk else ""
    if why:
        problems.append({"step": "purge", "msg": why})
    if fleet.get("store_problem"):
        problems.append({"step": "purge", "msg": fleet["store_problem"]})
    problems.extend({"step": "swap", "msg": msg} for msg in settings.get("host_problems") or [])
    if swap:        # what a swap needs on the controller: a host that does not swap needs none of it
        problems.extend({"step": "swap", "msg": msg} for msg in settings.get("swap_problems") or [])
    pool = fleet.get("pool") or {}
    if swap and pool.get("problem"):
        problems.append({"step": "swap", "msg": pool["problem"]})
    problems.sort(key=lambda p: STEP_ORDER.index(p["step"]) if p["step"] in STEP_ORDER else len(STEP_ORDER))
    return problems


def read_plan(target: str, read: dict, expected: dict, settings: ReadSettings) -> dict:
    """The migration of one host planned from one read (fleet/migrate_facts.py's result): {"plan" (plan_steps'),
    "todo" (which steps must run), "failure" (the first refusal, or None), "install" and "service"
    (the steps' check-mode results), "diffs" (of the slot's files), "source" (the fleet's source)}.

    expected: {path: text} of the slot's unit, environment and guard files as the controller
    renders them (their diffs against the read's texts are returned as ``diffs``, what the
    preview shows).
    """
    disk, service, install = read.get("disk") or {}, read.get("service") or {}, read.get("install") or {}
    install_on = bool(dig(settings, "install", "enabled"))
    install_result = {
        "changed": install_on and not install.get("matches"),
        "version": dig(settings, "install", "version"), "venv": dig(settings, "install", "venv"),
        "installed_version": install.get("version"), "source": dig(settings, "install", "source")}
    sums = dig(read, "config", "sha1", default={}) or {}
    drift = sorted(path for path, text in (expected or {}).items()
                   if sums.get(path) != hashlib.sha1(str(text).encode("utf-8")).hexdigest())
    secret_ok = dig(read, "config", "secret_matches")
    configure = bool(drift) or secret_ok is False
    unit_state = dig(service, "unit", "active_state")
    replaced = settings.get("replaced_todo") or []
    restart = restart_reasons(service.get("unit") or {})
    swap = (configure or unit_state != "active" or bool(settings.get("force_restart")) or bool(replaced)
            or bool(restart))
    fetch = read.get("fetch") or {}
    fleet = settings.get("fleet") or {}
    repairs, todo_record, todo_rejoin = ([], False, False) if swap else repairs_of(
        target, service, fetch.get("commit"), settings, fleet.get("pool") or {})
    service_result = {
        "action": "deploy", "model": target, "unit": settings.get("unit"), "swapped": False,
        "would_swap": swap, "replaced_model": dig(service, "deployment", "model") if swap else None,
        "replaced_units": [u.get("unit") for u in replaced] if swap else [],
        "restart_reasons": restart, "repairs": repairs}
    if fleet.get("pool"):
        service_result["pool"] = fleet["pool"]
    problems = _refusals(target, disk, swap, settings)
    failure = dict(problems[0], task="plan") if problems else None
    purge = read.get("purge")
    if fleet.get("purge_by") and purge is not None:     # a shared store is purged by one of its hosts
        purge = {"removed": [], "planned_bytes": 0, "by": fleet["purge_by"]}
    todo = {"install": install_result["changed"], "purge": purge is not None and not purge.get("by"),
            "fetch": not fetch.get("verified", False), "configure": configure, "swap": swap,
            "record": todo_record, "rejoin": todo_rejoin,
            "drift": drift + ([] if secret_ok is not False else ["API key file"])}
    plan = plan_steps({"target": target, "disk": disk or None, "purge": purge, "fetch": fetch,
                       "service": service_result, "benchmark": settings.get("benchmark"), "failure": failure,
                       "download_rate": float(settings.get("download_rate") or 0),
                       "install": dict(install_result, enabled=install_on), "source": fleet.get("source") or None})
    diffs = config_diffs(read, expected or {}, drift, settings.get("secret_path"), secret_ok)
    return {"plan": plan, "todo": todo, "failure": failure, "install": install_result,
            "service": service_result, "diffs": diffs, "source": fleet.get("source")}


def fleet_diffs(diffs_by_host: dict) -> list:
    """The preview's diffs of every host as one list, each header naming its host
    ({host: [diff entries]} in the play's order; a "prepared" text gets a first line instead)."""
    out = []
    for host, diffs in diffs_by_host.items():
        for diff in diffs or []:
            entry = dict(diff)
            for key in ("before_header", "after_header"):
                if key in entry:
                    entry[key] = "%s: %s" % (host, entry[key])
            if "prepared" in entry:
                entry["prepared"] = "%s:\n%s" % (host, entry["prepared"])
            out.append(entry)
    return out
