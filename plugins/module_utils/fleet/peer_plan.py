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

Pure stdlib, no I/O: unit-tested directly (tests/unit/plugins/module_utils/fleet/test_peer_plan.py),
and called on the controller by the filter modelswap.vllm.peer_plan.
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


def plan_sources(hosts, *, fanout: int = 1, hub_seeds: int = 1, bad_sources=None, avoid=None,
                 first: int = 1) -> dict:
    """The per-host source plan and its rounds.

    ``hosts``: ``[{"name", "site", "store", "target", "verified", "bytes"}]`` in play order:
    ``site`` (''= one default site), ``store`` (the shared store's id, '' = the host's own disk),
    ``target`` (what it must hold, e.g. ``org/name@commit``: only hosts of one target feed each
    other), ``verified`` (the target is verified there now), ``bytes`` (what it still lacks).
    ``fanout``: copies one source serves per round. ``hub_seeds``: hosts per site that download
    from the Hub when none of the site has the target. ``bad_sources``: ``{host: why}``, hosts
    that must not serve (a copy from them did not verify). ``avoid``: ``{receiver: [sources]}``,
    sources a receiver already failed to copy from. ``first``: the number of the first round (a
    re-plan after round n counts from n + 1, so its lines name the rounds as the run does).

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
    if isinstance(first, bool) or not isinstance(first, int) or first < 1:
        raise PlanError("first must be a round number >= 1, got %r" % (first,))
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
        number = first - 1
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
              "rounds": len(ordered), "last_round": max(rounds) if rounds else first - 1}
    return {"hosts": per_host, "rounds": ordered, "sites": sites, "totals": totals,
            "lines": ["%s: %s" % (h["name"], per_host[h["name"]]["line"]) for h in clean]}


def plan_from_states(states, *, fanout: int = 1, hub_seeds: int = 1, first: int = 1) -> dict:
    """plan_sources() over what each host of the run reports about itself, as the model_fetch role
    keeps it per host: ``{"name", "site", "store", "target", "verified", "bytes", "avoid": [sources
    it failed to copy from], "blamed": {source: why its copy did not verify}}``."""
    if not isinstance(states, (list, tuple)):
        raise PlanError("the hosts' states must be a list")
    bad, avoid, rehashed = {}, {}, []
    for s in states:
        if not isinstance(s, dict):
            raise PlanError("a host's state is not a mapping: %r" % (s,))
        for source, why in (s.get("blamed") or {}).items():
            bad.setdefault(source, why)
        if s.get("avoid"):
            avoid[s.get("name")] = list(s["avoid"])
        if s.get("rehashed"):
            rehashed.append(s.get("name"))
    plan = plan_sources(states, fanout=fanout, hub_seeds=hub_seeds, bad_sources=bad, avoid=avoid, first=first)
    plan["blamed"] = bad
    plan["rehashed"] = rehashed
    # a source blamed for a bad copy hashes its own files again (once) if it still claims them
    plan["rehash"] = [s["name"] for s in states if s.get("name") in bad and s.get("verified")
                      and s.get("name") not in rehashed]
    plan["more"] = bool(plan["rounds"] or plan["rehash"])
    return plan


def host_round(plan: dict, host: str) -> dict:
    """What ``host`` does in the plan's first round: ``{"round", "action", "from"}``, ``action`` one
    of ``hub`` (download from the Hub), ``copy`` (from ``from``), ``rehash`` (its copy did not
    verify at another host: hash its own files again), ``wait`` (a later round or a shared store
    another host fills) or ``done`` (verified; no round left for it)."""
    step = first_round(plan)
    entry = plan["hosts"].get(host) or {}
    if host in plan.get("rehash", ()):
        return {"round": step["round"] or plan["totals"]["last_round"] + 1, "action": "rehash", "from": None}
    if host in step["hub"]:
        return {"round": step["round"], "action": "hub", "from": None}
    for copy in step["copies"]:
        if copy["host"] == host:
            return {"round": step["round"], "action": "copy", "from": copy["from"]}
    if entry.get("source") in (VERIFIED, None) or (entry.get("source") == STORE and not entry.get("round")):
        return {"round": step["round"], "action": "done", "from": None}
    return {"round": step["round"], "action": "wait", "from": None}


# What a failed copy says about its source (cause -> what the receiver does next).
BLAME = ("bad_copy", "source_incomplete")      # the source is bad: nobody copies from it again
AVOID = ("copy_failed",)                       # this receiver tries another source
RETRY = ("local_bad",)                         # its own blob was bad (now deleted): copy again


def after_round(state: dict, step: dict, result=None, retries: int = 2) -> dict:
    """A host's state after its part in a round, from the round's step (``host_round``) and the
    module's result (peer_snapshot's for ``copy`` and ``rehash``; a ``hub`` host that reaches this
    point has downloaded and verified). Adds ``got`` (where its bytes came from) on success, and
    ``fail`` (the message to fail the host with) when no other source can help or it tried
    ``retries`` + 1 times."""
    new = dict(state)
    result = result or {}
    action = step.get("action")
    # the role registers these tasks with failed_when false: a failure is a cause, not "failed"
    failed = bool(result.get("failed") or result.get("cause") or not result.get("verified"))
    if action == "hub":
        new.update(verified=True, bytes=0, got={"source": HUB, "from": None, "round": step["round"],
                                                "bytes": state.get("bytes", 0)})
    elif action == "copy" and not failed:
        new.update(verified=True, bytes=0, got={"source": PEER, "from": step["from"], "round": step["round"],
                                                "bytes": (result.get("copied") or {}).get("bytes", 0)})
    elif action == "copy":
        cause = result.get("cause") or "error"
        source = step["from"]
        new["attempts"] = int(state.get("attempts", 0)) + 1
        new["bytes"] = (result.get("missing") or {}).get("bytes", state.get("bytes", 0))
        new["errors"] = list(state.get("errors") or []) + ["round %s from %s: %s" % (
            step["round"], source, result.get("msg") or cause)]
        if cause in BLAME:
            failures = (result.get("verification") or {}).get("failures") or []
            what = ("its copy of %s did not verify at %s" % (failures[0]["path"], state["name"])
                    if failures else "it lacks files of the snapshot (seen from %s)" % state["name"])
            new["blamed"] = dict(state.get("blamed") or {}, **{source: what})
        elif cause in AVOID:
            new["avoid"] = list(state.get("avoid") or []) + [source]
        if cause not in BLAME + AVOID + RETRY:
            new["fail"] = result.get("msg") or "copy from %s failed (%s)" % (source, cause)
        elif new["attempts"] > int(retries):
            new["fail"] = "%s: %d copies failed, the last: %s" % (state["name"], new["attempts"],
                                                                  result.get("msg") or cause)
    elif action == "rehash":
        new["rehashed"] = True
        if failed:
            if result.get("cause") != "bad_content":
                new["fail"] = result.get("msg") or "hashing again failed (%s)" % result.get("cause")
            new.update(verified=False, bytes=(result.get("missing") or {}).get("bytes", 0))
    return new


def outcome_lines(states) -> list:
    """What the run did, per host and in total: where each host's bytes came from."""
    lines, hub, peer = [], 0, 0
    for s in states:
        got = s.get("got")
        if got and got["source"] == HUB:
            hub += got["bytes"]
            lines.append("%s: from the Hub, %s (round %d)" % (s["name"], human_bytes(got["bytes"]), got["round"]))
        elif got:
            peer += got["bytes"]
            lines.append("%s: from %s, %s (round %d)" % (s["name"], got["from"], human_bytes(got["bytes"]),
                                                         got["round"]))
        elif s.get("store"):
            lines.append("%s: in the shared store %s" % (s["name"], s["store"]))
        else:
            lines.append("%s: already verified here" % s["name"])
        if s.get("errors"):
            lines[-1] += " after %d failed cop%s (%s)" % (len(s["errors"]), "y" if len(s["errors"]) == 1 else "ies",
                                                          "; ".join(s["errors"]))
    lines.append("in all: %s from the Hub, %s between hosts" % (human_bytes(hub), human_bytes(peer)))
    return lines


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
