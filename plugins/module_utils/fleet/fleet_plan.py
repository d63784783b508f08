# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""The fleet-wide part of the migration's plan, from every host's read: with peers, where each
host's bytes come from (fleet/peer_plan.py, the planner model_fetch's download follows); on a
shared store (modelswap_store), what another host of the store serves or targets, which no host
of the store may delete, and the one host that purges it; each host's drain judged against the
load balancer's pool as it is now (serving/lb_pool.py); the rollout's order and batches, where
a replica group counts as one unit.

Takes plain data, ``FleetHost`` per host (the filter modelswap.vllm.migrate_fleet reads them
from hostvars), never Ansible's objects. Pure, no I/O: table-tested
(tests/unit/plugins/module_utils/fleet/test_fleet_plan.yaml).
"""
from __future__ import annotations

from typing import TypedDict

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_plan as planner
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.plan_data import dig
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import lb_pool
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import replica_group


class FleetHost(TypedDict, total=False):
    """One host of the play as the fleet's plan sees it.

    read: its read (fleet/migrate_facts.py's result), or None when its read in this run did not succeed
    (unreachable, its lease or read failed); serve: its modelswap_serve (the catalog name);
    models: its modelswap_models (the catalog); store: its modelswap_store ("" for its own disk);
    site: its modelswap_site ("" for none). A host without a read needs only its store.
    """
    read: dict | None
    serve: str | None
    models: dict
    store: str
    site: str


class OtherRead(TypedDict, total=False):
    """A host of a shared store outside the play (store_others), read apart: the
    deployment_record read of it (deployment, failed, unreachable, msg) with its inventory's
    serve, models and store."""
    host: str
    store: str
    serve: str | None
    models: dict
    deployment: dict | None
    failed: bool
    unreachable: bool
    msg: str | None


def store_others(stores, play_hosts) -> list:
    """The inventory's hosts that mount a shared store of a host of the play but are not in the
    play (left out by --limit or a host pattern): what they serve is read apart (prepare.yml),
    since no purge of the store may take it. ``stores``: {host: its store ("" none)} of the
    inventory's hosts in the inventory's order (and of the play's)."""
    play = set(play_hosts or [])
    wanted = {stores.get(name) or "" for name in play} - {""}
    return [name for name in stores if name not in play and (stores.get(name) or "") in wanted]


def item_repo(item: str):
    """(repo_id, commit or None) of a purge item as disk_plan names it (``org/name[@commit]``);
    (None, None) for a plain model folder."""
    if not isinstance(item, str) or "/" not in item or item.startswith("/"):
        return None, None
    repo, _unused, commit = item.partition("@")
    return repo, commit or None


def catalog_commit(entry: dict):
    """The catalog's revision when it is a commit (40 hex digits), else None (any commit)."""
    rev = str((entry or {}).get("revision") or "")
    return rev if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else None


def _target_entry(host) -> dict:
    return (host.get("models") or {}).get(host.get("serve")) or {}


def _protect(keep: dict, name: str, host, deployment: dict, target_commit) -> None:
    """Note in ``keep`` what host ``name`` of a shared store serves (its record's deployment) and
    targets (its serve at ``target_commit``; None: any commit of it)."""
    if deployment.get("repo_id"):
        keep[(deployment["repo_id"], deployment.get("commit"))] = (name, "serves", deployment.get("model"))
    target = _target_entry(host)
    if target.get("repo_id"):
        keep[(target["repo_id"], target_commit)] = (name, "targets", host.get("serve"))


def pools(hosts, lb: dict | None) -> dict:
    """Each host's drain judged against the load balancer's pool as it is now (lb_pool's own
    judge, the host leaving alone: a serial batch's hosts are judged together at the drain)."""
    kind = (lb or {}).get("type") or "none"
    if kind == "none":
        return {}
    if kind != "haproxy":
        return {h: {"type": kind, "line": "through the %s hook task files" % kind, "floor_ok": True} for h in hosts}
    read = lb.get("pool") or {}     # lb_pool's pool entry point's result, or how it failed
    try:
        if read.get("failed"):
            raise lb_pool.PoolError(str(read.get("msg") or "the pool could not be read").strip())
        servers = (list(read["servers"]) if read.get("action") == "pool"
                   else lb_pool.haproxy_servers(lb.get("stats") or {}, lb.get("backend") or "", "the load balancer's stats page"))
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


def _outside(others, stores: dict, unknown: dict) -> None:
    """What the store's hosts outside the play serve and target (protected), or why it is unknown."""
    for other in others or []:
        name, store = other.get("host"), other.get("store") or ""
        if not name or not store:
            continue
        if other.get("unreachable") or other.get("failed") or not isinstance(other.get("deployment"), (dict, type(None))):
            why = "unreachable" if other.get("unreachable") else "its record could not be read"
            unknown.setdefault(store, []).append("%s (%s: %s)" % (name, why, str(other.get("msg") or "?").strip()[:200]))
            continue
        _protect(stores.setdefault(store, {}), name, other, other.get("deployment") or {},
                 catalog_commit(_target_entry(other)))


def _store_problem(name: str, store: str, read: dict, stores: dict, unknown: dict) -> str:
    """Why host ``name`` may not purge from its shared store ("" when it may)."""
    if store in unknown and dig(read, "purge", "items"):
        return ("model_purge: the shared store %s is also mounted by %s, which this run could not read: what it "
                "serves is unknown, so nothing is purged from the store. Reach it and run again, or take "
                "modelswap_store off a host that no longer mounts it; nothing was deleted"
                % (store, ", ".join(unknown[store])))
    for item in (dig(read, "purge", "items") or []) if store else []:
        repo, commit = item_repo(item)
        for (p_repo, p_commit), (other, how, model) in stores.get(store, {}).items():
            if other != name and repo == p_repo and (commit is None or p_commit is None or commit == p_commit):
                return ("model_purge: %s is in the shared store %s, where %s %s it (%s): no host of the store "
                        "deletes it. Give preflight_purge_candidates that leave it, or migrate %s first; "
                        "nothing was deleted" % (item, store, other, how, model, other))
    return ""


def fleet_plan(hosts, *, peers: bool = False, fanout=1, hub_seeds=1, lb: dict | None = None, others=None,
               groups=None) -> dict:
    """The fleet-wide part of the plan: {"hosts": {name: {"source", "store_problem", "purge_by",
    "pool"}} (the hosts with a read), "sources": the peer plan's totals and lines (with peers),
    "stores": {store: [protected repo@commit]}}.

    hosts: {name: FleetHost} in the play's order (a store's first host purges it; peers' sources
    are taken in this order); lb: {type, stats, backend, min_serving, name} of the load balancer;
    others: OtherRead of the stores' hosts outside the play: what a readable one serves or targets
    is protected like a host of the play's; an unreadable one stops every purge of its store,
    since what it serves is then unknown; groups: modelswap_replica_groups (a group's workers are
    no servers of the pool: it is drained through its head)."""
    reads, stores, unknown = {}, {}, {}
    _outside(others, stores, unknown)
    for name, host in (hosts or {}).items():
        store = host.get("store") or ""
        if host.get("read") is None:
            # a host of the play that could not be read (unreachable, its lease or read failed)
            if store:
                unknown.setdefault(store, []).append("%s (its read in this run did not succeed)" % name)
            continue
        read = host["read"]
        reads[name] = host
        if store:
            _protect(stores.setdefault(store, {}), name, host, dig(read, "service", "deployment") or {},
                     dig(read, "fetch", "commit"))
    out = {"hosts": {name: {} for name in reads}, "stores": {
        store: sorted("%s@%s" % key for key in keep) for store, keep in stores.items()}}
    leaders = {}
    for name, host in reads.items():      # the store's first host purges it, the others not
        store = host.get("store") or ""
        if store:
            leader = leaders.setdefault(store, name)
            if leader != name:
                out["hosts"][name]["purge_by"] = leader
    for name, host in reads.items():
        problem = _store_problem(name, host.get("store") or "", host["read"], stores, unknown)
        if problem:
            out["hosts"][name]["store_problem"] = problem
    where = replica_group.places(groups, reads)
    servers = [name for name in reads if not (where[name] or {}).get("headless")]
    for name, pool in pools(servers, lb).items():
        out["hosts"][name]["pool"] = pool
    if peers:
        states = [{"name": name, "site": host.get("site") or "", "store": host.get("store") or "",
                   "target": "%s@%s" % (_target_entry(host).get("repo_id"), dig(host["read"], "fetch", "commit")),
                   "verified": bool(dig(host["read"], "fetch", "verified")),
                   "bytes": int(dig(host["read"], "fetch", "would_fetch", "bytes", default=0) or 0)}
                  for name, host in reads.items()]
        sources = planner.plan_sources(states, fanout=int(fanout), hub_seeds=int(hub_seeds))
        out["sources"] = {"totals": sources["totals"], "lines": planner.summary_lines(sources)}
        for name, entry in sources["hosts"].items():
            out["hosts"].setdefault(name, {})["source"] = entry
    return out


def _serial_count(value, units: int) -> int:
    """One ``serial`` value as Ansible reads it (an int, or "N%" of the units, at least 1), over units."""
    text = str(value).strip()
    try:
        if text.endswith("%"):
            return int(float(text[:-1]) / 100.0 * units) or 1
        return int(text)
    except ValueError:
        raise ValueError("modelswap_serial: %r is not a number of hosts, a percentage (\"25%%\") or a list of "
                         "them; nothing was changed" % (value,)) from None


def batch_sizes(units: list, serial="100%") -> list:
    """The rollout's batch sizes in hosts (the play's ``serial`` list) for units of hosts, ``serial``
    counting units as Ansible's counts hosts: a number, "N%" or a list of them (the last repeats);
    0 or less takes every unit left."""
    values = list(serial) if isinstance(serial, (list, tuple)) else [serial]
    values = values or ["100%"]
    sizes, left, turn = [], list(units), 0
    while left:
        count = _serial_count(values[min(turn, len(values) - 1)], len(units))
        batch, left = (left, []) if count <= 0 else (left[:count], left[count:])
        sizes.append(sum(len(unit) for unit in batch))
        turn += 1
    return sizes


def rollout(hosts, groups=None, serial="100%", swaps=None, settled=None) -> dict:
    """The rollout play's hosts and batches: {"settled" (left out: their plan settled them),
    "hosts" (the others, each replica group's nodes together), "serial" (batch sizes in hosts,
    each counting a group once), "groups" ([{group, nodes, head, swap, by}] of the groups in the
    rollout: ``by`` the nodes whose own plan swaps), "group_swaps" ({node: why} of the nodes
    that restart only because their group does)}.

    hosts: the plan play's hosts in order; swaps: {host: its own plan swaps}; settled: the hosts
    the plan settled."""
    settled = [host for host in hosts or [] if host in (settled or [])]
    units = replica_group.rollout_units(groups, [host for host in hosts or [] if host not in settled])
    out = {"settled": settled, "hosts": [host for unit in units for host in unit],
           "serial": batch_sizes(units, serial), "groups": [], "group_swaps": {}}
    where = replica_group.places(groups, [unit[0] for unit in units])
    for unit in units:
        place = where[unit[0]]
        if not place:
            continue
        by = [host for host in unit if (swaps or {}).get(host)]
        out["groups"].append({"group": place["group"], "nodes": place["nodes"], "head": place["head"],
                              "swap": bool(by), "by": by})
        for host in unit:
            if by and host not in by:
                out["group_swaps"][host] = "its replica group %s restarts as one unit (%s must)" % (
                    place["group"], ", ".join(by))
    return out
