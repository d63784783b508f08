# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""Filters that turn the roles' results into the migration's plan (the preview) and run record.

Thin adapters: each filter turns its Jinja arguments (and hostvars) into plain data and calls
plugins/module_utils/fleet/ (plan_steps.py: the steps; host_plan.py: the plan from one read;
fleet_plan.py: the fleet-wide part; run_record.py: the record, the failed step, the plan's lines),
where the logic is table-tested (tests/unit/plugins/module_utils/fleet/). Each role publishes its
result as a fact: preflight_plan, model_purge_result, model_fetch_result, vllm_service_result,
benchmark_result.
"""
from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import fleet_plan as fleet
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import final_record, host_plan, plan_data, plan_steps, run_record
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import replica_group


def human_bytes(value) -> str:
    """1536 -> '1.5 KiB' (common/units.py); '?' for what is not a number (a missing fact)."""
    return plan_data.bytes_text(value)


def _from_mapping(make, checked_inputs, inputs) -> dict:
    """``make`` over the filter's one mapping, checked first: a bad key fails the filter by name."""
    try:
        return make(checked_inputs(inputs))
    except plan_data.InputError as exc:
        raise AnsibleFilterError(str(exc))


def migrate_plan(inputs) -> dict:
    """The migration's todo list for one host from one mapping (fleet/plan_steps.py's PlanInputs):
    ``{{ {'target': modelswap_serve, 'disk': ..., 'fetch': ..., ...} | modelswap.vllm.migrate_plan }}``."""
    return _from_mapping(plan_steps.plan_steps, plan_steps.plan_inputs, inputs)


def read_plan(target: str, read: dict, expected: dict, settings: dict) -> dict:
    """One host's plan from its read (fleet/migrate_facts.py's result): fleet/host_plan.py's read_plan."""
    return host_plan.read_plan(target, read, expected, settings)


def plan_lines(plan: dict, host: str, check_mode: bool = True) -> list:
    """The plan as the numbered todo list an operator reads (fleet/run_record.py)."""
    return run_record.plan_lines(plan, host, check_mode)


def failure_of(marks: dict, task, result) -> dict:
    """{"step", "task", "msg"} of a failed task (ansible_failed_task: a dict or a Task)."""
    name = task.get("name", "") if isinstance(task, dict) else getattr(task, "name", "") or ""
    return run_record.failure_of(marks, name, result)


def _values(hostvars, name):
    """A host's variables (hostvars[name]; {} for a host hostvars does not know)."""
    values = hostvars[name] if name in hostvars else {}
    return values if hasattr(values, "get") else {}


def _read_of(values):
    """The host's read of this run (__migrate_read), or None where it did not succeed."""
    read = values.get("__migrate_read")
    return read if isinstance(read, dict) and not read.get("failed") else None


def fleet_hosts(hosts, hostvars) -> dict:
    """{name: FleetHost} of the play's hosts, in the play's order, read from hostvars: the read
    (__migrate_read), modelswap_serve, modelswap_models, modelswap_store, modelswap_site."""
    out = {}
    for name in hosts or []:
        values = _values(hostvars, name)
        read = _read_of(values)
        if read is None:        # only its store counts (what it serves is unknown)
            out[name] = {"read": None, "store": values.get("modelswap_store") or ""}
            continue
        out[name] = {"read": read, "serve": values.get("modelswap_serve"),
                     "models": values.get("modelswap_models") or {},
                     "store": values.get("modelswap_store") or "", "site": values.get("modelswap_site") or ""}
    return out


def other_reads(others, hostvars) -> list:
    """OtherRead of the deployment_record reads of the stores' hosts outside the play (a loop's
    results: item, deployment, failed, unreachable, msg), with each host's inventory variables."""
    out = []
    for result in others or []:
        name = result.get("item") if isinstance(result, dict) else None
        values = _values(hostvars, name) if name else {}
        store = values.get("modelswap_store") or ""
        if not store:
            continue
        other = {"host": name, "store": store, "deployment": result.get("deployment"),
                 "failed": bool(result.get("failed")), "unreachable": bool(result.get("unreachable")),
                 "msg": result.get("msg")}
        if not other["failed"] and not other["unreachable"]:
            other.update(serve=values.get("modelswap_serve"), models=values.get("modelswap_models") or {})
        out.append(other)
    return out


def fleet_plan(hosts, hostvars, peers: bool = False, fanout=1, hub_seeds=1, lb: dict | None = None,
               others=None, groups=None) -> dict:
    """The fleet-wide part of the plan (fleet/fleet_plan.py) from every host's read in hostvars."""
    return fleet.fleet_plan(fleet_hosts(hosts, hostvars), peers=bool(peers), fanout=fanout, hub_seeds=hub_seeds,
                            lb=lb, others=other_reads(others, hostvars), groups=groups)


def store_others(inventory_hosts, hostvars, play_hosts) -> list:
    """The inventory's hosts that mount a shared store (modelswap_store) of a host of the play
    but are not in the play (fleet/fleet_plan.py's store_others over hostvars)."""
    names = list(inventory_hosts or [])
    names += [name for name in play_hosts or [] if name not in names]
    return fleet.store_others({name: _values(hostvars, name).get("modelswap_store") or "" for name in names},
                              play_hosts)


def migrate_record(inputs) -> dict:
    """The JSON record of one host's migration from one mapping (fleet/run_record.py's RecordInputs):
    ``{{ {'host': inventory_hostname, 'run_id': ..., 'plan': ..., ...} | modelswap.vllm.migrate_record }}``."""
    return _from_mapping(run_record.run_record, run_record.record_inputs, inputs)


def final(hosts, hostvars, run_id, serve, settings, check_mode, now) -> dict:
    """{host: {"plan", "record", "marks"}} of each host in ``hosts``, from its variables in
    hostvars (fleet/final_record.py): one call for a whole play, on the controller."""
    out = {}
    groups = (settings or {}).get("replica_groups") if hasattr(settings, "get") else None
    group_swaps = (_values(hostvars, "localhost").get("__migrate_rollout") or {}).get("group_swaps") or {}
    where = replica_group.places(groups, hosts)
    for host in hosts or []:
        facts = _values(hostvars, host)
        place = where[host]
        try:
            out[host] = final_record.final_of(
                facts, run_id=run_id, serve=facts.get("modelswap_serve") or serve, settings=settings,
                check_mode=bool(check_mode), now=float(now), group_swap=group_swaps.get(host, "") if place else "",
                replica={k: place[k] for k in ("group", "nodes", "rank", "head")} if place else None)
        except (plan_data.InputError, KeyError, TypeError) as exc:
            raise AnsibleFilterError("migrate_final: %s: %s" % (host, exc))
    return out


def host_records(hosts, hostvars) -> list:
    """Each host's run record (None for a host that has none: unreachable, left out by --limit,
    or stopped before its record was built), in the order of `hosts`: the host's migrate_record,
    else the one the play's records built for it on the controller (localhost's __migrate_finals)."""
    built = _values(hostvars, "localhost").get("__migrate_finals") or {}
    out = []
    for host in hosts or []:
        values = _values(hostvars, host)
        if "migrate_record" in values:
            out.append(values["migrate_record"])
        else:
            out.append((built.get(host) or {}).get("record"))
    return out


def preview_diffs(hosts, hostvars) -> list:
    """The unit and environment diffs of every host whose plan rewrites its slot's files, one
    list with each header naming its host (the preview shows them in one task)."""
    by_host = {}
    for host in hosts or []:
        plan = _values(hostvars, host).get("__migrate")
        if isinstance(plan, dict) and (plan.get("todo") or {}).get("configure"):
            by_host[host] = plan.get("diffs") or []
    return host_plan.fleet_diffs(by_host)


def settled(hosts, hostvars) -> list:
    """The hosts whose plan settled them in this run (nothing to do: proved, lease given back), in
    the order of ``hosts``."""
    return [host for host in hosts or []
            if (_values(hostvars, host).get("__migrate") or {}).get("settled") is True]


def rollout(hosts, hostvars, groups=None, serial="100%") -> dict:
    """The rollout play's hosts and batches (fleet/fleet_plan.py's rollout), from each host's plan
    in hostvars: the settled hosts left out, a replica group's nodes together and counted once by
    ``serial``, and the nodes that restart only because their group does."""
    swaps = {host: bool(((_values(hostvars, host).get("__migrate") or {}).get("todo") or {}).get("swap"))
             for host in hosts or []}
    try:
        return fleet.rollout(hosts, groups, serial, swaps, settled(hosts, hostvars))
    except ValueError as exc:
        raise AnsibleFilterError(str(exc))


class FilterModule:
    def filters(self):
        return {"migrate_plan": migrate_plan, "migrate_plan_lines": plan_lines, "migrate_read_plan": read_plan,
                "migrate_failure": failure_of, "migrate_fleet": fleet_plan, "migrate_store_others": store_others,
                "migrate_record": migrate_record, "migrate_host_records": host_records, "migrate_final": final,
                "migrate_preview_diffs": preview_diffs, "migrate_settled": settled, "migrate_rollout": rollout,
                "human_bytes": human_bytes}
