# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""Filters that turn the roles' results into the migration's plan (the preview) and run record.

Pure functions over plain dicts, so they are unit-tested without a host
(tests/unit/test_migrate_filters.py). Each role publishes its result as a fact: preflight_plan,
model_purge_result, model_fetch_result, vllm_service_result, benchmark_result.
"""
from __future__ import annotations

import hashlib
import os

from ansible_collections.modelswap.vllm.plugins.module_utils.common import units
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import service_files
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.vllm_service_facts import restart_reasons

RECORD_SCHEMA = 1


def clean_path(value):
    """A path as the record and the summary print it: normalized ('a/b/../c' -> 'a/c'); None stays."""
    return os.path.normpath(value) if isinstance(value, str) and value else value


def human_bytes(value) -> str:
    """1536 -> '1.5 KiB' (common/units.py); '?' for what is not a number (a missing fact)."""
    try:
        return units.human_bytes(value)
    except (TypeError, ValueError):
        return "?"


def human_seconds(value) -> str:
    try:
        secs = float(value)
    except (TypeError, ValueError):
        return "?"
    if secs < 90:
        return f"{secs:.0f} s"
    if secs < 5400:
        return f"{secs / 60:.0f} min"
    return f"{secs / 3600:.1f} h"


def _get(data, *path, default=None):
    for key in path:
        if not isinstance(data, dict) or key not in data or data[key] is None:
            return default
        data = data[key]
    return data


def migrate_plan(target: str, plan: dict | None, purge: dict | None, fetch: dict | None,
                 service: dict | None, benchmark: dict | None = None,
                 failure: dict | None = None, download_rate: float = 0,
                 install: dict | None = None, source: dict | None = None) -> dict:
    """The migration's todo list for one host, each step with what it would do and its numbers.

    plan: preflight's disk_plan result; purge: model_purge's result (check mode: what would go);
    fetch: hf_snapshot's result (check mode: would_fetch), or migrate_facts' fetch (its in_flight: a
    download that holds the lock now, which the step follows); service: vllm_service_result;
    benchmark: {"enabled": bool, "concurrency": [...]}; failure: {"step", "msg"} when a step
    failed; download_rate: bytes/s used to estimate the download time (0 = unknown);
    install: vllm_service_install_result plus "enabled" (no install step when absent or off);
    source: where the bytes come from with peers or a shared store (the fleet's source plan for
    this host: source hub/peer/store/verified, from, round, bytes, line); the download is then
    what this host itself takes, the Hub's or a peer's (a host of a store another fills takes 0).
    """
    steps = []
    would_install = bool(_get(install, "changed"))
    if _get(install, "enabled"):
        version, venv = _get(install, "version", default="?"), _get(install, "venv", default="?")
        had = _get(install, "installed_version")
        if would_install:
            text = f"install vLLM {version} into {venv} from {_get(install, 'source', default='?')}"
            text += (f" (replacing {had})" if had else "") + "; the service keeps running"
        elif _get(install, "version"):
            text = f"vLLM {version} already installed in {venv}"
        else:   # the install step did not get as far as reporting
            text = "not reached"
        steps.append({"step": "install", "title": "Install vLLM", "would_install": would_install,
                      "version": version, "venv": venv, "source": _get(install, "source"), "text": text})
    fs = _get(plan, "filesystem", default={}) or {}
    free = _get(fs, "available_bytes")
    purge_bytes = _get(purge, "planned_bytes", default=_get(plan, "purge_bytes", default=0)) or 0
    removed = _get(purge, "removed", default=None)
    if removed is None:
        removed = _get(plan, "purge", default=[]) or []
    download = _get(fetch, "would_fetch", "bytes")
    if download is None:
        download = _get(fetch, "bytes_downloaded", default=_get(plan, "target", "download_bytes", default=0))
    files = _get(fetch, "would_fetch", "files")
    if isinstance(files, list):
        nfiles = len(files)
    else:
        nfiles = _get(fetch, "files_downloaded", default=_get(plan, "target", "missing_files"))
    needed = _get(plan, "target", "needed_bytes", default=download) or 0

    disk = {"free_before": free, "purge_bytes": purge_bytes, "download_bytes": download,
            "free_after": (free + purge_bytes - needed) if isinstance(free, int) else None,
            "verdict": _get(plan, "verdict")}
    steps.append({"step": "preflight", "title": "Check disk space and plan cleanup",
                  "text": (f"free {human_bytes(free)}; needs {human_bytes(needed)}; verdict "
                           f"{disk['verdict']}" if plan else "not reached"), **disk})
    by = _get(purge, "by")
    steps.append({
        "step": "purge", "title": "Delete what the plan frees",
        "items": [{"name": i.get("name") or i.get("repo_id") or i.get("path"),
                   "revision": i.get("revision") or i.get("commit"),
                   "bytes": i.get("bytes", i.get("frees_bytes"))} for i in removed if isinstance(i, dict)],
        "bytes": purge_bytes,
        "text": (f"delete {len(removed)} item(s), freeing {human_bytes(purge_bytes)}"
                 if removed else f"the shared store's purge is {by}'s" if by else "nothing to delete")})
    eta = (download / download_rate) if download and download_rate else None
    fetch_step = {
        "step": "fetch", "title": f"Download and verify {target}",
        "commit": _get(fetch, "commit") or _get(plan, "target", "commit"),
        "files": nfiles, "bytes": download, "eta_s": eta,
        "text": ((f"download {nfiles} file(s), " if nfiles is not None else "download ") + human_bytes(download)
                 + (f", about {human_seconds(eta)} at {human_bytes(download_rate)}/s" if eta else "")
                 + (" (listed by the controller: the host gets huggingface_hub with vLLM)"
                    if _get(fetch, "listed_by") == "controller" else "")
                 if download else "already downloaded and verified")}
    if source and download:
        own = int(source.get("bytes") or 0)
        line = source.get("line") or {"hub": "from the Hub", "peer": f"from {source.get('from')}",
                                      "store": "in the shared store"}.get(source.get("source"), "")
        fetch_step.update(source=source.get("source"), source_host=source.get("from"), round=source.get("round"),
                          bytes=own, text=f"{nfiles} file(s) {line}".rstrip())
    in_flight = _get(fetch, "in_flight")
    if in_flight and not _get(fetch, "verified"):   # a download a killed run left going: hf_snapshot follows it
        who = (f"run {in_flight.get('run')} (pid {in_flight.get('pid')} since {in_flight.get('since')})"
               if in_flight.get("run") else f"pid {in_flight.get('pid')} on {in_flight.get('host')} since {in_flight.get('since')}")
        fetch_step.update(in_flight=in_flight, text=f"follow the download started by {who}, then verify")
    steps.append(fetch_step)
    would_swap = bool(_get(service, "would_swap") or _get(service, "swapped"))
    old = _get(service, "replaced_model") or _get(plan, "served", "name")
    units = _get(service, "replaced_units", default=[]) or []
    stops = ([f"stop {old} ({_get(service, 'unit')})"] if old else []) + [
        f"stop and disable {u} (set up outside modelswap)" for u in units]
    pool = _get(service, "pool")
    swap_text = ((f"{', '.join(stops)}, start {target}; serving stops until the new model is ready"
                  if stops else f"start {target} ({_get(service, 'unit')}); nothing serves on this host yet")
                 if would_swap else f"{target} already serves with this configuration: no restart")
    reasons = _get(service, "restart_reasons", default=[]) or []
    repairs = [] if would_swap else (_get(service, "repairs", default=[]) or [])
    if would_swap and reasons:
        swap_text = f"restart ({'; '.join(reasons)}): {swap_text}"
    if repairs:
        swap_text = "; ".join([swap_text] + repairs)
    if pool and would_swap:
        swap_text = (f"drain from the load balancer ({pool.get('line')}), {swap_text.replace('; serving stops until the new model is ready', '')}"
                     f", rejoin after the gates; clients are served by the pool's other hosts")
    steps.append({
        "step": "swap", "title": f"Stop {old or 'the old model'}, start {target}, prove it serves",
        "would_swap": would_swap, "stop": (old or ", ".join(units) or None) if would_swap else None,
        "start": target if would_swap else None, "unit": _get(service, "unit"), "replaced_units": units,
        "drain": bool(pool) and would_swap, "pool": (pool or {}).get("line"), "repairs": repairs,
        "text": swap_text})
    bench_on = bool(_get(benchmark, "enabled")) and would_swap
    ladder = _get(benchmark, "concurrency", default=[])
    steps.append({"step": "benchmark", "title": "Benchmark at rising concurrency",
                  "enabled": bench_on, "concurrency": ladder,
                  "text": (f"Locust ladder C={','.join(str(c) for c in ladder)}" if bench_on
                           else "skipped")})
    if failure:
        failed_at = next((n for n, s in enumerate(steps) if s["step"] == failure.get("step")), None)
        if failed_at is not None:
            steps[failed_at]["failed"] = failure.get("msg")
            if steps[failed_at]["text"] == "not reached":   # it failed before reporting anything
                steps[failed_at]["text"] = "failed"
            # what the later steps would have done is unknown: they never ran
            for step in steps[failed_at + 1:]:
                step["text"], step["reached"] = "not reached", False
    return {"target": target, "steps": steps, "ready": not failure,
            "changes": bool(would_install or removed or download or would_swap or repairs), "failure": failure}


def _purge_problem(host: str, target: str, disk: dict, settings: dict) -> str:
    """The model_purge role's refusal of this plan (forbidden, or a purge that would not make room)."""
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
    texts = _get(read, "config", "text", default={}) or {}
    sums = _get(read, "config", "sha1", default={}) or {}
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


def read_plan(target: str, read: dict, expected: dict, settings: dict) -> dict:
    """The migration of one host planned from one read (migrate_facts' result): what each step
    would do, which steps must run, the first refusal, and each step's result as its role reports
    it in check mode (so the preview's plan is migrate_plan's, the same numbers the steps give).

    expected: {path: text} of the slot's unit, environment and guard files as the controller
    renders them (their diffs against the read's texts are returned as ``diffs``, what the
    preview shows). settings: secret_path (the API key file); install {enabled, version, venv, source}; unit; force_restart;
    replaced_todo (vllm_units_to_replace of the read); guard; purge_allowed, purge_all_listed;
    fail_on_does_not_fit; benchmark {enabled, concurrency}; download_rate; host; problems (the
    settings' refusals, step by step: [{"step", "msg"}], judged on the controller first).
    """
    disk, service, install = read.get("disk") or {}, read.get("service") or {}, read.get("install") or {}
    install_on = bool(_get(settings, "install", "enabled"))
    install_result = {
        "changed": install_on and not install.get("matches"),
        "version": _get(settings, "install", "version"), "venv": _get(settings, "install", "venv"),
        "installed_version": install.get("version"), "source": _get(settings, "install", "source")}
    sums = _get(read, "config", "sha1", default={}) or {}
    drift = sorted(path for path, text in (expected or {}).items()
                   if sums.get(path) != hashlib.sha1(str(text).encode("utf-8")).hexdigest())
    secret_ok = _get(read, "config", "secret_matches")
    configure = bool(drift) or secret_ok is False
    unit_state = _get(service, "unit", "active_state")
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
        "would_swap": swap, "replaced_model": _get(service, "deployment", "model") if swap else None,
        "replaced_units": [u.get("unit") for u in replaced] if swap else [],
        "restart_reasons": restart, "repairs": repairs}
    fleet_pool = (settings.get("fleet") or {}).get("pool")
    if fleet_pool:
        service_result["pool"] = fleet_pool
    problems = list(settings.get("problems") or [])
    host = settings.get("host") or ""
    if disk.get("verdict") == "does_not_fit" and settings.get("fail_on_does_not_fit", True):
        problems.append({"step": "preflight", "msg": "%s does not fit on %s: %s" % (
            target, _get(disk, "filesystem", "path"), disk.get("reason"))})
    why = _purge_problem(host, target, disk, settings) if disk else ""
    if why:
        problems.append({"step": "purge", "msg": why})
    if fleet.get("store_problem"):
        problems.append({"step": "purge", "msg": fleet["store_problem"]})
    problems.extend({"step": "swap", "msg": msg} for msg in settings.get("host_problems") or [])
    pool = fleet.get("pool") or {}
    if swap and pool.get("problem"):
        problems.append({"step": "swap", "msg": pool["problem"]})
    order = ["install", "preflight", "purge", "fetch", "swap", "benchmark"]
    problems.sort(key=lambda p: order.index(p["step"]) if p["step"] in order else len(order))
    failure = dict(problems[0], task="plan") if problems else None
    purge = read.get("purge")
    if fleet.get("purge_by") and purge is not None:     # a shared store is purged by one of its hosts
        purge = {"removed": [], "planned_bytes": 0, "by": fleet["purge_by"]}
    todo = {"install": install_result["changed"], "purge": purge is not None and not purge.get("by"),
            "fetch": not fetch.get("verified", False), "configure": configure, "swap": swap,
            "record": todo_record, "rejoin": todo_rejoin,
            "drift": drift + ([] if secret_ok is not False else ["API key file"])}
    plan = migrate_plan(target, disk or None, purge, fetch, service_result,
                        settings.get("benchmark"), failure, float(settings.get("download_rate") or 0),
                        dict(install_result, enabled=install_on), fleet.get("source") or None)
    diffs = config_diffs(read, expected or {}, drift, settings.get("secret_path"), secret_ok)
    return {"plan": plan, "todo": todo, "failure": failure, "install": install_result,
            "service": service_result, "diffs": diffs, "source": fleet.get("source")}


def repairs_of(target: str, service: dict, commit, settings: dict, pool: dict) -> tuple:
    """What a host that serves the target still lacks, when an interrupted run left it so:
    (lines for the plan, record it, rejoin the pool). The record must name what serves (a kill
    between the start and the record leaves the old one there, and the old configuration as the
    one a later rollback restores); a host this run's drain left out of the pool goes back."""
    lines, record, rejoin = [], False, False
    deployment = service.get("deployment") or {}
    files = service.get("files") or {}
    if _get(service, "unit", "active_state") == "active" and (
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


def _item_repo(item: str):
    """(repo_id, commit or None) of a purge item as disk_plan names it (``org/name[@commit]``);
    (None, None) for a plain model folder."""
    if not isinstance(item, str) or "/" not in item or item.startswith("/"):
        return None, None
    repo, _unused, commit = item.partition("@")
    return repo, commit or None


def _pools(hosts, lb: dict | None) -> dict:
    """Each host's drain judged against the load balancer's pool as it is now (lb_pool's own
    judge, the host leaving alone: a serial batch's hosts are judged together at the drain)."""
    from ansible_collections.modelswap.vllm.plugins.module_utils.serving import lb_pool
    kind = (lb or {}).get("type") or "none"
    if kind == "none":
        return {}
    if kind != "haproxy":
        return {h: {"type": kind, "line": "through the %s hook task files" % kind, "floor_ok": True} for h in hosts}
    try:
        servers = lb_pool.haproxy_servers(lb.get("stats") or {}, lb.get("backend") or "", "the load balancer's stats page")
    except lb_pool.PoolError as exc:
        problem = "lb_pool: %s; nothing was changed" % exc
        return {h: {"type": kind, "line": "the pool could not be read", "floor_ok": False, "problem": problem}
                for h in hosts}
    out = {}
    for name in hosts:
        view = lb_pool.pool_view(servers, name, lb.get("min_serving", 1), [name], lb.get("name") or lb.get("backend"))
        out[name] = {"type": kind, "line": view["line"], "floor_ok": view["floor_ok"], "problem": view["problem"],
                     "serving": view["serving"], "total": view["total"], "status": view["status"]}
    return out


def _read_of(hostvars, name):
    values = hostvars[name] if name in hostvars else {}
    read = values.get("__migrate_read") if hasattr(values, "get") else None
    return values, (read if isinstance(read, dict) and not read.get("failed") else None)


def store_others(inventory_hosts, hostvars, play_hosts) -> list:
    """The inventory's hosts that mount a shared store (modelswap_store) of a host of the play
    but are not in the play (left out by --limit or a host pattern): what they serve is read
    apart (prepare.yml), since no purge of the store may take it."""
    play = set(play_hosts or [])
    stores = {store for store in (_store_of(hostvars, name) for name in play) if store}
    return [name for name in inventory_hosts or [] if name not in play and _store_of(hostvars, name) in stores]


def _store_of(hostvars, name) -> str:
    values = hostvars[name] if name in hostvars else {}
    return (values.get("modelswap_store") if hasattr(values, "get") else "") or ""


def _catalog_commit(entry: dict):
    """The catalog's revision when it is a commit (40 hex digits), else None (any commit)."""
    rev = str((entry or {}).get("revision") or "")
    return rev if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else None


def _protect(keep: dict, name: str, values, deployment: dict, target_commit) -> None:
    """Note in ``keep`` what host ``name`` of a shared store serves (its record's deployment) and
    targets (its modelswap_serve at ``target_commit``; None: any commit of it)."""
    if deployment.get("repo_id"):
        keep[(deployment["repo_id"], deployment.get("commit"))] = (name, "serves", deployment.get("model"))
    target = (values.get("modelswap_models") or {}).get(values.get("modelswap_serve")) or {}
    if target.get("repo_id"):
        keep[(target["repo_id"], target_commit)] = (name, "targets", values.get("modelswap_serve"))


def fleet_plan(hosts, hostvars, peers: bool = False, fanout=1, hub_seeds=1, lb: dict | None = None,
               others=None) -> dict:
    """The fleet-wide part of the plan, from every host's read (migrate_facts): with peers, where
    each host's bytes come from (the planner model_fetch's download follows: fleet/peer_plan.py);
    on a shared store (modelswap_store), the purge items another host of the store serves or
    targets, which no host of the store may delete, and the one host that purges it (its first);
    {"hosts": {name: {"source", "store_problem", "purge_by"}},
    "sources": the peer plan, "stores": {store: [protected repo@commit]}}.

    others: deployment_record reads (a loop's results: item, deployment, failed, unreachable,
    msg) of the store's hosts outside the play (store_others): what a readable one serves or
    targets is protected like a host of the play's; an unreadable one stops every purge of its
    store, since what it serves is then unknown."""
    from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_plan as planner
    reads, stores, unknown = {}, {}, {}
    for result in others or []:
        name = result.get("item") if isinstance(result, dict) else None
        store = _store_of(hostvars, name) if name else ""
        if not store:
            continue
        if result.get("unreachable") or result.get("failed") or not isinstance(result.get("deployment"), (dict, type(None))):
            why = "unreachable" if result.get("unreachable") else "its record could not be read"
            unknown.setdefault(store, []).append("%s (%s: %s)" % (name, why, str(result.get("msg") or "?").strip()[:200]))
            continue
        values = hostvars[name]
        target = (values.get("modelswap_models") or {}).get(values.get("modelswap_serve")) or {}
        _protect(stores.setdefault(store, {}), name, values, result.get("deployment") or {}, _catalog_commit(target))
    for name in hosts or []:
        values, read = _read_of(hostvars, name)
        if read is None:
            # a host of the play that could not be read (unreachable, its lease or read failed)
            store = _store_of(hostvars, name)
            if store:
                unknown.setdefault(store, []).append("%s (its read in this run did not succeed)" % name)
            continue
        reads[name] = (values, read)
        store = values.get("modelswap_store") or ""
        if store:
            _protect(stores.setdefault(store, {}), name, values, _get(read, "service", "deployment") or {},
                     _get(read, "fetch", "commit"))
    out = {"hosts": {name: {} for name in reads}, "stores": {
        store: sorted("%s@%s" % key for key in keep) for store, keep in stores.items()}}
    leaders = {}
    for name, (values, _read) in reads.items():      # the store's first host purges it, the others not
        store = values.get("modelswap_store") or ""
        if store:
            leader = leaders.setdefault(store, name)
            if leader != name:
                out["hosts"][name]["purge_by"] = leader
    for name, (values, read) in reads.items():
        store = values.get("modelswap_store") or ""
        if store in unknown and _get(read, "purge", "items"):
            out["hosts"][name]["store_problem"] = (
                "model_purge: the shared store %s is also mounted by %s, which this run could not read: what it "
                "serves is unknown, so nothing is purged from the store. Reach it and run again, or take "
                "modelswap_store off a host that no longer mounts it; nothing was deleted"
                % (store, ", ".join(unknown[store])))
            continue
        for item in (_get(read, "purge", "items") or []) if store else []:
            repo, commit = _item_repo(item)
            for (p_repo, p_commit), (other, how, model) in stores.get(store, {}).items():
                if other != name and repo == p_repo and (commit is None or p_commit is None or commit == p_commit):
                    out["hosts"][name]["store_problem"] = (
                        "model_purge: %s is in the shared store %s, where %s %s it (%s): no host of the store "
                        "deletes it. Give preflight_purge_candidates that leave it, or migrate %s first; "
                        "nothing was deleted" % (item, store, other, how, model, other))
                    break
            if out["hosts"][name].get("store_problem"):
                break
    for name, pool in _pools(list(reads), lb).items():
        out["hosts"][name]["pool"] = pool
    if peers:
        states = []
        for name, (values, read) in reads.items():
            models = values.get("modelswap_models") or {}
            entry = models.get(values.get("modelswap_serve")) or {}
            states.append({"name": name, "site": values.get("modelswap_site") or "",
                           "store": values.get("modelswap_store") or "",
                           "target": "%s@%s" % (entry.get("repo_id"), _get(read, "fetch", "commit")),
                           "verified": bool(_get(read, "fetch", "verified")),
                           "bytes": int(_get(read, "fetch", "would_fetch", "bytes", default=0) or 0)})
        sources = planner.plan_sources(states, fanout=int(fanout), hub_seeds=int(hub_seeds))
        out["sources"] = {"totals": sources["totals"], "lines": planner.summary_lines(sources)}
        for name, entry in sources["hosts"].items():
            out["hosts"].setdefault(name, {})["source"] = entry
    return out


def failure_of(marks: dict, task, result) -> dict:
    """{"step", "task", "msg"} of a failed task: the step is the last one started (its mark)."""
    started = sorted(((v, k) for k, v in (marks or {}).items() if k != "end" and v is not None))
    result = result if isinstance(result, dict) else {}
    name = task.get("name", "") if isinstance(task, dict) else getattr(task, "name", "") or ""
    return {"step": started[-1][1] if started else "preflight", "task": name or "",
            "msg": result.get("msg") or result.get("stderr") or "failed"}


def plan_lines(plan: dict, host: str, check_mode: bool = True) -> list[str]:
    """The plan as the numbered todo list an operator reads: a preview says what would fail, a
    real run what failed."""
    verdict = "would fail" if check_mode else "failed"
    lines = [f"{host}: migrate to {plan.get('target')}"
             + ("" if plan.get("ready") else f" - {verdict}: {_get(plan, 'failure', 'msg')}")]
    for n, step in enumerate(plan.get("steps", []), 1):
        mark = "x" if step.get("failed") else " "
        lines.append(f"  [{mark}] {n}. {step['title']}: {step['text']}")
        if step.get("failed"):
            lines.append(f"        failed here: {step['failed']}")
    return lines


def migrate_record(host: str, run_id: str, target: str, plan: dict, timings: dict,
                   fetch: dict | None, service: dict | None, purge: dict | None,
                   benchmark: dict | None, failure: dict | None, check_mode: bool,
                   lb: dict | None = None, prestage: dict | None = None) -> dict:
    """The JSON record of one host's migration (what happened, how long each step took)."""
    swapped = bool(_get(service, "swapped"))
    failed_msg = (failure or {}).get("msg") or ""
    rolled_back = "rolled back" in failed_msg.lower() and "not rolled back" not in failed_msg.lower()
    if failure:
        outcome = "rolled_back" if rolled_back else "failed"
    elif check_mode:
        outcome = "preview"
    else:
        outcome = "migrated" if swapped else ("changed" if plan.get("changes") else "unchanged")
    steps = {}
    marks = sorted(((k, v) for k, v in (timings or {}).items() if v is not None), key=lambda kv: kv[1])
    for (name, start), nxt in zip(marks, marks[1:] + [(None, None)]):
        if name == "end":
            continue
        steps[name] = {"started": start, "seconds": round(nxt[1] - start, 3) if nxt[1] else None}
    return {
        "schema": RECORD_SCHEMA, "run_id": run_id, "host": host, "target": target,
        "outcome": outcome, "check_mode": check_mode,
        "failure": failure, "rolled_back": rolled_back,
        "steps": steps, "plan": plan,
        "purge": {"removed": len(_get(purge, "removed", default=[]) or []),
                  "planned_bytes": _get(purge, "planned_bytes"), "freed_bytes": _get(purge, "freed_bytes")},
        "fetch": {"commit": _get(fetch, "commit"), "bytes_downloaded": _get(fetch, "bytes_downloaded"),
                  "bytes_received": _get(fetch, "bytes_received"),
                  "files_downloaded": _get(fetch, "files_downloaded"), "seconds": _get(fetch, "seconds"),
                  "mb_per_s": _get(fetch, "mb_per_s"), "verified": _get(fetch, "verification", "ok")},
        "swap": {"swapped": swapped, "replaced_model": _get(service, "replaced_model"),
                 "downtime_s": _get(service, "downtime_s"), "start_to_ready_s": _get(service, "start_to_ready_s")},
        # the load balancer: out of the pool from the drain to the rejoin (lb_pool_results)
        "lb": ({"drained": bool(_get(lb, "drain", "changed")), "rejoined": bool(_get(lb, "rejoin", "changed")),
                "pool": _get(lb, "drain", "pool"), "in_flight_at_start": _get(lb, "drain", "in_flight_at_start"),
                "sessions_at_start": _get(lb, "drain", "sessions_at_start"),
                "drain_seconds": _get(lb, "drain", "drain_seconds"), "seconds_out": _get(lb, "rejoin", "seconds_out")}
               if isinstance(lb, dict) and lb.get("drain") else None),
        "prestage": ({k: prestage.get(k) for k in ("skipped", "reason", "bytes_total", "bytes_read", "seconds",
                                                   "bytes_per_s", "complete")}
                     if isinstance(prestage, dict) and not prestage.get("skipped_by_ansible") and "bytes_total" in prestage
                     else None),
        "benchmark": (dict({k: benchmark.get(k) for k in ("saturation", "stopped_early", "comparison")},
                           run_dir=clean_path(benchmark.get("run_dir")), report=clean_path(benchmark.get("report")))
                      if benchmark else None),
    }


def host_records(hosts, hostvars) -> list:
    """Each host's run record (None for a host that has none: unreachable, left out by --limit,
    or stopped before its record was built), in the order of `hosts`."""
    out = []
    for host in hosts or []:
        values = hostvars[host] if host in hostvars else {}
        out.append(values["migrate_record"] if "migrate_record" in values else None)
    return out


class FilterModule:
    def filters(self):
        return {"migrate_plan": migrate_plan, "migrate_plan_lines": plan_lines, "migrate_read_plan": read_plan,
                "migrate_failure": failure_of, "migrate_fleet": fleet_plan, "migrate_store_others": store_others,
                "migrate_record": migrate_record, "migrate_host_records": host_records,
                "human_bytes": human_bytes}
