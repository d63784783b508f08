# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Where each host's bytes come from: one download per site, then copies between hosts.

A fleet that downloads a model on every host pulls it through the site's uplink once per host
(100 hosts x 547 GB = 54.7 TB). With peers, the first host of a site downloads it from the Hub
and verifies it; every other host copies the verified snapshot from a host of its site that
already has it, and each host that finishes becomes a source in turn, so copies fan out: with
``fanout`` copies per source per round, the sources grow by a factor (1 + fanout) each round
and a site of n hosts is done in 1 + ceil(log_(1+fanout)(n)) rounds (8 for 100 hosts at fanout 1).

Hosts that mount the same model store (``store``: NFS, Lustre, a shared SSD) are one *unit*:
one of them (the leader) fills the store once, the others wait and then verify cheaply; the
store's bytes are counted once.

``plan_sources`` is the one planner: the preview prints its per-host lines and the run executes
its rounds one at a time, re-planning from the state after each round (hosts that became
verified, sources that served a bad copy, copies that failed). Given the same state it gives the
same answer, so the run does what the preview said unless something fails, and then says how it
deviates. Sources are taken in the hosts' order (the play's order), never in the order they became
verified, so a re-plan after a round agrees with the simulation of that round.

Pure stdlib, no I/O: unit-tested directly (tests/unit/test_peer_plan.py), and called on the
controller by the filter modelswap.vllm.peer_plan.
"""
from __future__ import annotations

from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes

HUB, PEER, STORE, VERIFIED = "hub", "peer", "store", "verified"
SOURCES = (HUB, PEER, STORE, VERIFIED)
DEFAULT_SITE = "default"


class PlanError(ValueError):
    """Input the planner cannot use (names the host and the field)."""


def _hosts(hosts) -> list:
    """The hosts as clean dicts, in order; PlanError names what is wrong."""
    if not isinstance(hosts, (list, tuple)):
        raise PlanError("hosts must be a list of {name, site, store, target, verified, bytes}")
    out, seen = [], set()
    for i, h in enumerate(hosts):
        if not isinstance(h, dict) or not isinstance(h.get("name"), str) or not h.get("name"):
            raise PlanError("hosts[%d] has no name" % i)
        name = h["name"]
        if name in seen:
            raise PlanError("host %s is listed twice" % name)
        seen.add(name)
        size = h.get("bytes", 0)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PlanError("host %s: bytes must be a count of bytes >= 0, got %r" % (name, size))
        out.append({"name": name, "site": str(h.get("site") or "") or DEFAULT_SITE,
                    "store": str(h.get("store") or ""), "target": str(h.get("target") or ""),
                    "verified": bool(h.get("verified")), "bytes": size})
    return out


def _units(hosts: list) -> list:
    """Hosts grouped into units: a host alone, or the hosts of one store for one target."""
    units, by_key = [], {}
    for h in hosts:
        key = (h["target"], ("store", h["store"]) if h["store"] else ("host", h["name"]))
        unit = by_key.get(key)
        if unit is None:
            unit = by_key[key] = {"index": len(units), "target": h["target"], "site": h["site"],
                                  "store": h["store"], "members": [], "verified": False}
            units.append(unit)
        unit["members"].append(h)
    for unit in units:
        good = [m for m in unit["members"] if m["verified"]]
        unit["verified"] = bool(good)
        unit["leader"] = (good or unit["members"])[0]["name"]
        unit["bytes"] = 0 if good else unit["members"][0]["bytes"]
    return units


def _why_not(unit, names, bad_sources, avoid) -> str:
    """Why no source among ``names`` (the swarm's hosts) may serve ``unit`` (the Hub fallback's line)."""
    bad = ["%s: %s" % (s, why) for s, why in sorted(bad_sources.items()) if s in names]
    failed = ["%s: copy failed" % s for s in sorted(avoid.get(unit["leader"], ())) if s in names]
    return "; ".join(bad + failed) or "none has it"


def plan_sources(hosts, *, fanout: int = 1, hub_seeds: int = 1, bad_sources=None, avoid=None) -> dict:
    """The per-host source plan and its rounds.

    ``hosts``: ``[{"name", "site", "store", "target", "verified", "bytes"}]`` in play order:
    ``site`` (''= one default site), ``store`` (the shared store's id, '' = the host's own disk),
    ``target`` (what it must hold, e.g. ``org/name@commit``: only hosts of one target feed each
    other), ``verified`` (the target is verified there now), ``bytes`` (what it still lacks).
    ``fanout``: copies one source serves per round. ``hub_seeds``: hosts per site that download
    from the Hub when none of the site has the target. ``bad_sources``: ``{host: why}``, hosts
    that must not serve (a copy from them did not verify). ``avoid``: ``{receiver: [sources]}``,
    sources a receiver already failed to copy from.

    Returns ``{"hosts": {name: {"host", "site", "store", "target", "source", "from", "round",
    "bytes", "line", "leader"}}, "rounds": [{"round", "hub": [names], "copies": [{"host", "from",
    "bytes"}]}], "sites": {site: {...}}, "totals": {...}, "lines": ["host: line", ...]}``.
    ``source``: ``verified`` (nothing to do), ``hub``, ``peer`` (``from`` names the host), or
    ``store`` (a shared store that ``leader`` fills or already holds; ``bytes`` 0).
    """
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
        raise PlanError("fanout must be 1 or more copies per source per round, got %r" % (fanout,))
    if isinstance(hub_seeds, bool) or not isinstance(hub_seeds, int) or hub_seeds < 1:
        raise PlanError("hub_seeds must be 1 or more hosts per site, got %r" % (hub_seeds,))
    bad_sources = dict(bad_sources or {})
    avoid = {k: set(v or ()) for k, v in (avoid or {}).items()}
    clean = _hosts(hosts)
    units = _units(clean)
    swarms = {}
    for unit in units:
        swarms.setdefault((unit["site"], unit["target"]), []).append(unit)

    fate = {}          # unit index -> (source, from unit or None, round, reason)
    rounds = {}
    for (site, _target), members in swarms.items():
        names = {m["name"] for u in members for m in u["members"]}
        have = [u for u in members if u["verified"] and not any(m["name"] in bad_sources for m in u["members"])]
        need = [u for u in members if not u["verified"]]
        for u in members:
            if u["verified"]:
                fate[u["index"]] = (VERIFIED, None, 0, "")
        number = 0
        while need:
            number += 1
            step = rounds.setdefault(number, {"round": number, "hub": [], "copies": []})
            served, hub = [], []
            if not have:
                why = ("no host of site %s has it verified" % site) if not names & set(bad_sources) else \
                    ("no host of site %s can serve it (%s)" % (site, _why_not(need[0], names, bad_sources, avoid)))
                hub = [(u, why) for u in need[:hub_seeds]]
            else:
                have.sort(key=lambda u: u["index"])
                capacity = {u["index"]: fanout for u in have}
                turn = 0
                stuck = []
                for u in need:
                    refused = avoid.get(u["leader"], set())
                    allowed = [s for s in have if s["leader"] not in refused]
                    if not allowed:
                        stuck.append(u)
                        continue
                    for k in range(len(have)):
                        s = have[(turn + k) % len(have)]
                        if s["leader"] in refused or capacity[s["index"]] == 0:
                            continue
                        capacity[s["index"]] -= 1
                        turn = (turn + k + 1) % len(have)
                        served.append((u, s))
                        break
                if stuck and not served:
                    # no peer that may serve them now, and none will appear after this round
                    hub = [(u, "no peer of site %s could serve it (%s)" % (site, _why_not(u, names, bad_sources, avoid)))
                           for u in stuck[:hub_seeds]]
            for u, s in served:
                fate[u["index"]] = (PEER, s, number, "")
                step["copies"].append({"host": u["leader"], "from": s["leader"], "bytes": u["bytes"]})
            for u, why in hub:
                fate[u["index"]] = (HUB, None, number, why)
                step["hub"].append(u["leader"])
            done = [u for u, _s in served] + [u for u, _w in hub]
            if not done:   # pragma: no cover - every pass serves or falls back to the Hub
                raise PlanError("internal: round %d of site %s moved nothing" % (number, site))
            need = [u for u in need if u not in done]
            have = have + done

    per_host = {}
    for unit in units:
        source, via, number, why = fate[unit["index"]]
        for m in unit["members"]:
            leads = m["name"] == unit["leader"]
            entry = {"host": m["name"], "site": unit["site"], "store": unit["store"],
                     "target": unit["target"], "round": number, "leader": unit["leader"],
                     "from": via["leader"] if via else None, "reason": why}
            if unit["store"] and not leads:
                entry.update(source=STORE, bytes=0)
            else:
                entry.update(source=source, bytes=unit["bytes"] if source in (HUB, PEER) else 0)
            entry["line"] = source_line(entry, source)
            per_host[m["name"]] = entry

    sites = {}
    for h in clean:
        e = per_host[h["name"]]
        site = sites.setdefault(e["site"], {"hosts": 0, "hub_bytes": 0, "peer_bytes": 0, "hub": [],
                                            "copies": 0, "rounds": 0, "stores": []})
        site["hosts"] += 1
        if e["store"] and e["store"] not in site["stores"]:
            site["stores"].append(e["store"])
        if e["source"] == HUB:
            site["hub_bytes"] += e["bytes"]
            site["hub"].append(e["host"])
        elif e["source"] == PEER:
            site["peer_bytes"] += e["bytes"]
            site["copies"] += 1
        site["rounds"] = max(site["rounds"], e["round"])
    ordered = [rounds[n] for n in sorted(rounds)]
    totals = {"hosts": len(clean), "units": len(units),
              "hub_bytes": sum(s["hub_bytes"] for s in sites.values()),
              "peer_bytes": sum(s["peer_bytes"] for s in sites.values()),
              "hub_downloads": sum(len(s["hub"]) for s in sites.values()),
              "copies": sum(s["copies"] for s in sites.values()),
              "rounds": len(ordered)}
    return {"hosts": per_host, "rounds": ordered, "sites": sites, "totals": totals,
            "lines": ["%s: %s" % (h["name"], per_host[h["name"]]["line"]) for h in clean]}


def source_line(entry: dict, unit_source: str) -> str:
    """What one host's plan says in words: where its bytes come from, and how many."""
    store = entry["store"]
    when = " (round %d)" % entry["round"] if entry["round"] else ""
    if entry["source"] == STORE:
        if unit_source == VERIFIED:
            return "already in the shared store %s" % store
        how = "from the Hub" if unit_source == HUB else "from %s" % entry["from"]
        return "in the shared store %s, which %s fills %s%s" % (store, entry["leader"], how, when)
    if entry["source"] == VERIFIED:
        return "already in the shared store %s" % store if store else "already verified here"
    into = " into the shared store %s" % store if store else ""
    size = human_bytes(entry["bytes"])
    if entry["source"] == HUB:
        return "from the Hub%s: %s%s; %s" % (into, size, when, entry["reason"])
    return "from %s%s: %s%s" % (entry["from"], into, size, when)


def summary_lines(plan: dict) -> list:
    """One line per site and one for the fleet: downloads, copies, bytes, rounds."""
    out = []
    for site, s in plan["sites"].items():
        out.append("site %s: %d host(s)%s; %d download(s) from the Hub (%s%s), %d copies between hosts "
                   "(%s), %d round(s)" % (
                       site, s["hosts"],
                       " (shared store %s)" % ", ".join(s["stores"]) if s["stores"] else "",
                       len(s["hub"]), human_bytes(s["hub_bytes"]),
                       ": " + ", ".join(s["hub"]) if s["hub"] else "",
                       s["copies"], human_bytes(s["peer_bytes"]), s["rounds"]))
    t = plan["totals"]
    out.append("fleet: %d host(s), %s from the Hub, %s between hosts, %d round(s)"
               % (t["hosts"], human_bytes(t["hub_bytes"]), human_bytes(t["peer_bytes"]), t["rounds"]))
    return out


def first_round(plan: dict) -> dict:
    """The next round to run: the plan's first (``{"round": 0, "hub": [], "copies": []}`` when done)."""
    return plan["rounds"][0] if plan["rounds"] else {"round": 0, "hub": [], "copies": []}
