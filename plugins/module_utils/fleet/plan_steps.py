# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""The migration's todo list for one host: each step (install, preflight, purge, fetch, swap,
benchmark) with what it would do, its numbers and its text, from the results the steps' roles
report (in check mode: what they would do).

``plan_steps`` takes one mapping, ``PlanInputs``; the preview builds it from one read
(fleet/host_plan.py), the run record from what each step reported (filter migrate_plan).
Pure, no I/O: table-tested (tests/unit/plugins/module_utils/fleet/test_plan_steps.yaml).
"""
from __future__ import annotations

from typing import TypedDict

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.plan_data import bytes_text, checked, dig, seconds_text

STEP_ORDER = ("install", "preflight", "purge", "fetch", "swap", "benchmark")


class PlanInputs(TypedDict, total=False):
    """What the steps report, each None where the step did not (yet) report.

    target: the catalog name to migrate to (required);
    disk: preflight's disk_plan result; purge: model_purge's result (check mode: what would go);
    fetch: hf_snapshot's result (check mode: would_fetch), or the read's fetch (fleet/migrate_facts.py; its in_flight:
    a download that holds the lock now, which the step follows); service: vllm_service_result
    (plus pool, repairs, restart_reasons of the plan); benchmark: {"enabled": bool, "concurrency": [...]};
    failure: {"step", "msg"} when a step failed; download_rate: bytes/s used to estimate the
    download time (0 or None: unknown); install: vllm_service_install_result plus "enabled" (no
    install step when absent or off); source: where the bytes come from with peers or a shared
    store (the fleet's source plan for this host: source hub/peer/store/verified, from, round,
    bytes, line); the download is then what this host itself takes, the Hub's or a peer's (a host
    of a store another fills takes 0).
    """
    target: str
    disk: dict | None
    purge: dict | None
    fetch: dict | None
    service: dict | None
    benchmark: dict | None
    failure: dict | None
    download_rate: float | None
    install: dict | None
    source: dict | None


PLAN_REQUIRED = ("target",)


def plan_inputs(values) -> PlanInputs:
    """``values`` checked as PlanInputs (InputError for an unknown or missing key)."""
    return checked("migrate_plan", values, PlanInputs, PLAN_REQUIRED)


def _install_step(install: dict | None, would_install: bool) -> dict:
    version, venv = dig(install, "version", default="?"), dig(install, "venv", default="?")
    had = dig(install, "installed_version")
    if would_install:
        text = f"install vLLM {version} into {venv} from {dig(install, 'source', default='?')}"
        text += (f" (replacing {had})" if had else "") + "; the service keeps running"
    elif dig(install, "version"):
        text = f"vLLM {version} already installed in {venv}"
    else:   # the install step did not get as far as reporting
        text = "not reached"
    return {"step": "install", "title": "Install vLLM", "would_install": would_install,
            "version": version, "venv": venv, "source": dig(install, "source"), "text": text}


def _download_of(disk, fetch):
    """The bytes the download takes as the fetch reports them (would_fetch, or what it downloaded),
    else the disk plan's (0 when neither says)."""
    download = dig(fetch, "would_fetch", "bytes")
    if download is None:
        download = dig(fetch, "bytes_downloaded", default=dig(disk, "target", "download_bytes", default=0))
    return download


def _fetch_step(target: str, disk, fetch, download, rate: float, source) -> dict:
    files = dig(fetch, "would_fetch", "files")
    if isinstance(files, list):
        nfiles = len(files)
    else:
        nfiles = dig(fetch, "files_downloaded", default=dig(disk, "target", "missing_files"))
    eta = (download / rate) if download and rate else None
    step = {
        "step": "fetch", "title": f"Download and verify {target}",
        "commit": dig(fetch, "commit") or dig(disk, "target", "commit"),
        "files": nfiles, "bytes": download, "eta_s": eta,
        "text": ((f"download {nfiles} file(s), " if nfiles is not None else "download ") + bytes_text(download)
                 + (f", about {seconds_text(eta)} at {bytes_text(rate)}/s" if eta else "")
                 + (" (listed by the controller: the host gets huggingface_hub with vLLM)"
                    if dig(fetch, "listed_by") == "controller" else "")
                 if download else "already downloaded and verified")}
    if source and download:
        own = int(source.get("bytes") or 0)
        line = source.get("line") or {"hub": "from the Hub", "peer": f"from {source.get('from')}",
                                      "store": "in the shared store"}.get(source.get("source"), "")
        step.update(source=source.get("source"), source_host=source.get("from"), round=source.get("round"),
                    bytes=own, text=f"{nfiles} file(s) {line}".rstrip())
    in_flight = dig(fetch, "in_flight")
    if in_flight and not dig(fetch, "verified"):   # a download a killed run left going: hf_snapshot follows it
        who = (f"run {in_flight.get('run')} (pid {in_flight.get('pid')} since {in_flight.get('since')})"
               if in_flight.get("run") else f"pid {in_flight.get('pid')} on {in_flight.get('host')} since {in_flight.get('since')}")
        step.update(in_flight=in_flight, text=f"follow the download started by {who}, then verify")
    return step


def _swap_step(target: str, disk, service) -> dict:
    would_swap = bool(dig(service, "would_swap") or dig(service, "swapped"))
    old = dig(service, "replaced_model") or dig(disk, "served", "name")
    replaced = dig(service, "replaced_units", default=[]) or []
    stops = ([f"stop {old} ({dig(service, 'unit')})"] if old else []) + [
        f"stop and disable {u} (set up outside modelswap)" for u in replaced]
    pool = dig(service, "pool")
    text = ((f"{', '.join(stops)}, start {target}; serving stops until the new model is ready"
             if stops else f"start {target} ({dig(service, 'unit')}); nothing serves on this host yet")
            if would_swap else f"{target} already serves with this configuration: no restart")
    reasons = dig(service, "restart_reasons", default=[]) or []
    repairs = [] if would_swap else (dig(service, "repairs", default=[]) or [])
    if would_swap and reasons:
        text = f"restart ({'; '.join(reasons)}): {text}"
    if repairs:
        text = "; ".join([text] + repairs)
    if pool and would_swap:
        text = (f"drain from the load balancer ({pool.get('line')}), {text.replace('; serving stops until the new model is ready', '')}"
                f", rejoin after the gates; clients are served by the pool's other hosts")
    replica = dig(service, "replica")
    if replica:     # a node of a replica group: the group stops and starts as one unit
        role = ("the head: it serves the API" if replica.get("rank") == 0
                else f"headless, served through {replica.get('head')}")
        text = f"replica group {replica.get('group')} ({', '.join(replica.get('nodes') or [])}; {role}): {text}"
    return {
        "step": "swap", "title": f"Stop {old or 'the old model'}, start {target}, prove it serves",
        "would_swap": would_swap, "stop": (old or ", ".join(replaced) or None) if would_swap else None,
        "start": target if would_swap else None, "unit": dig(service, "unit"), "replaced_units": replaced,
        "drain": bool(pool) and would_swap, "pool": (pool or {}).get("line"), "repairs": repairs,
        "text": text}


def _mark_failure(steps: list, failure: dict) -> None:
    failed_at = next((n for n, s in enumerate(steps) if s["step"] == failure.get("step")), None)
    if failed_at is None:
        return
    steps[failed_at]["failed"] = failure.get("msg")
    if steps[failed_at]["text"] == "not reached":   # it failed before reporting anything
        steps[failed_at]["text"] = "failed"
    # what the later steps would have done is unknown: they never ran
    for step in steps[failed_at + 1:]:
        step["text"], step["reached"] = "not reached", False


def plan_steps(inputs: PlanInputs) -> dict:
    """The migration's todo list for one host: {"target", "steps": [each step with "step",
    "title", "text" and its numbers], "ready": no failure, "changes": any step changes something,
    "failure"}."""
    target = inputs["target"]
    disk, purge, fetch = inputs.get("disk"), inputs.get("purge"), inputs.get("fetch")
    service, install, failure = inputs.get("service"), inputs.get("install"), inputs.get("failure")
    rate = float(inputs.get("download_rate") or 0)
    steps = []
    would_install = bool(dig(install, "changed"))
    if dig(install, "enabled"):
        steps.append(_install_step(install, would_install))
    fs = dig(disk, "filesystem", default={}) or {}
    free = dig(fs, "available_bytes")
    purge_bytes = dig(purge, "planned_bytes", default=dig(disk, "purge_bytes", default=0)) or 0
    removed = dig(purge, "removed", default=None)
    if removed is None:
        removed = dig(disk, "purge", default=[]) or []
    download = _download_of(disk, fetch)
    needed = dig(disk, "target", "needed_bytes", default=download) or 0
    preflight = {"free_before": free, "purge_bytes": purge_bytes, "download_bytes": download,
                 "free_after": (free + purge_bytes - needed) if isinstance(free, int) else None,
                 "verdict": dig(disk, "verdict")}
    steps.append({"step": "preflight", "title": "Check disk space and plan cleanup",
                  "text": (f"free {bytes_text(free)}; needs {bytes_text(needed)}; verdict "
                           f"{preflight['verdict']}" if disk else "not reached"), **preflight})
    by = dig(purge, "by")
    steps.append({
        "step": "purge", "title": "Delete what the plan frees",
        "items": [{"name": i.get("name") or i.get("repo_id") or i.get("path"),
                   "revision": i.get("revision") or i.get("commit"),
                   "bytes": i.get("bytes", i.get("frees_bytes"))} for i in removed if isinstance(i, dict)],
        "bytes": purge_bytes,
        "text": (f"delete {len(removed)} item(s), freeing {bytes_text(purge_bytes)}"
                 if removed else f"the shared store's purge is {by}'s" if by else "nothing to delete")})
    steps.append(_fetch_step(target, disk, fetch, download, rate, inputs.get("source")))
    swap = _swap_step(target, disk, service)
    steps.append(swap)
    bench_on = bool(dig(inputs.get("benchmark"), "enabled")) and swap["would_swap"]
    ladder = dig(inputs.get("benchmark"), "concurrency", default=[])
    rates = dig(inputs.get("benchmark"), "rates", default=[]) or []
    if rates:       # the benchmark role's rate ladder (benchmark_mode: rate)
        title, words = "Benchmark at rising request rates", f"Locust rate ladder {','.join(f'{r:g}' for r in rates)} req/s"
    else:
        title, words = "Benchmark at rising concurrency", f"Locust ladder C={','.join(str(c) for c in ladder)}"
    steps.append({"step": "benchmark", "title": title, "enabled": bench_on, "concurrency": ladder, "rates": rates,
                  "text": words if bench_on else "skipped"})
    if failure:
        _mark_failure(steps, failure)
    return {"target": target, "steps": steps, "ready": not failure,
            "changes": bool(would_install or removed or download or swap["would_swap"] or swap["repairs"]),
            "failure": failure}
