"""The fleet's source planner (plugins/module_utils/fleet/peer_plan.py): where each host's bytes come from.

Table-driven: sites of 1, 2, 4, 8 and 100 hosts, the fan-out bound, shared stores, hosts already
verified, a source that served a bad copy, a receiver that failed to copy from a source; then the
re-plan after a round agrees with the simulation of that round (the preview and the run agree).
"""
from __future__ import annotations

import math

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_plan
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet.peer_plan import plan_sources

pytestmark = pytest.mark.unit

MIB = 1024 * 1024
T = "lab/tiny-b@5adf7ab29f6060a97a9982849ec851bb2442f6f2"


def fleet(n, site="s1", verified=(), store=None, size=7 * MIB, target=T, start=1):
    store = store or {}
    return [{"name": "gpu%d" % i, "site": site, "store": store.get("gpu%d" % i, ""), "target": target,
             "verified": "gpu%d" % i in verified, "bytes": 0 if "gpu%d" % i in verified else size}
            for i in range(start, start + n)]


def sources(plan):
    return {h: (e["source"], e["from"], e["round"]) for h, e in plan["hosts"].items()}


@pytest.mark.parametrize("n, fanout, rounds", [
    (1, 1, 1), (2, 1, 2), (4, 1, 3), (8, 1, 4), (100, 1, 8),
    (4, 2, 3), (9, 2, 3), (10, 2, 4), (100, 3, 5),
])
def test_one_download_per_site_then_rounds_of_about_log2(n, fanout, rounds):
    plan = plan_sources(fleet(n), fanout=fanout)
    t = plan["totals"]
    assert t["hub_downloads"] == 1 and t["hub_bytes"] == 7 * MIB
    assert t["copies"] == n - 1 and t["peer_bytes"] == (n - 1) * 7 * MIB
    assert t["rounds"] == rounds == 1 + math.ceil(math.log(n, 1 + fanout) - 1e-9)
    assert plan["hosts"]["gpu1"]["source"] == "hub" and plan["hosts"]["gpu1"]["round"] == 1
    # every host is served once, by a host that had it before that round
    ready = {"gpu1": 1}
    for step in plan["rounds"][1:]:
        for copy in step["copies"]:
            assert ready[copy["from"]] < step["round"]
            ready[copy["host"]] = step["round"]
    assert len(ready) == n


@pytest.mark.parametrize("n, fanout", [(8, 1), (100, 1), (100, 3), (33, 2)])
def test_no_source_serves_more_than_fanout_copies_in_a_round(n, fanout):
    plan = plan_sources(fleet(n), fanout=fanout)
    for step in plan["rounds"]:
        per_source = {}
        for copy in step["copies"]:
            per_source[copy["from"]] = per_source.get(copy["from"], 0) + 1
        assert max(per_source.values() or [0]) <= fanout, step


def test_four_hosts_exactly():
    plan = plan_sources(fleet(4))
    assert sources(plan) == {"gpu1": ("hub", None, 1), "gpu2": ("peer", "gpu1", 2),
                             "gpu3": ("peer", "gpu1", 3), "gpu4": ("peer", "gpu2", 3)}
    assert plan["lines"] == [
        "gpu1: from the Hub: 7.0 MiB (round 1); no host of site s1 has it verified",
        "gpu2: from gpu1: 7.0 MiB (round 2)",
        "gpu3: from gpu1: 7.0 MiB (round 3)",
        "gpu4: from gpu2: 7.0 MiB (round 3)",
    ]
    assert peer_plan.summary_lines(plan) == [
        "site s1: 4 host(s); 1 download(s) from the Hub (7.0 MiB: gpu1), 3 copies between hosts (21.0 MiB), 3 round(s)",
        "fleet: 4 host(s), 7.0 MiB from the Hub, 21.0 MiB between hosts, 3 round(s)",
    ]


@pytest.mark.parametrize("verified, expected, rounds", [
    # a host already verified is the source: no Hub at all
    (("gpu3",), {"gpu1": ("peer", "gpu3", 1), "gpu2": ("peer", "gpu1", 2), "gpu3": ("verified", None, 0),
                 "gpu4": ("peer", "gpu3", 2)}, 2),
    (("gpu1", "gpu2", "gpu3", "gpu4"), {"gpu%d" % i: ("verified", None, 0) for i in range(1, 5)}, 0),
    (("gpu2", "gpu4"), {"gpu1": ("peer", "gpu2", 1), "gpu2": ("verified", None, 0),
                        "gpu3": ("peer", "gpu4", 1), "gpu4": ("verified", None, 0)}, 1),
])
def test_hosts_already_verified_are_the_sources(verified, expected, rounds):
    plan = plan_sources(fleet(4, verified=verified))
    assert sources(plan) == expected
    assert plan["totals"]["hub_bytes"] == 0 and plan["totals"]["rounds"] == rounds
    assert plan["hosts"][verified[0]]["line"] == "already verified here"


def test_sites_are_planned_apart_and_run_their_rounds_together():
    hosts = fleet(4, site="east") + fleet(2, site="west", start=5) + fleet(1, site="", start=7)
    plan = plan_sources(hosts)
    assert plan["totals"]["hub_downloads"] == 3
    assert plan["hosts"]["gpu5"]["source"] == "hub" and plan["hosts"]["gpu6"]["from"] == "gpu5"
    assert plan["hosts"]["gpu7"]["site"] == "default"
    assert [sorted(r["hub"]) for r in plan["rounds"]] == [["gpu1", "gpu5", "gpu7"], [], []]
    assert [len(r["copies"]) for r in plan["rounds"]] == [0, 2, 2]
    assert plan["sites"]["west"]["rounds"] == 2 and plan["sites"]["east"]["rounds"] == 3


def test_hosts_of_other_targets_never_feed_each_other():
    hosts = fleet(2) + fleet(2, target="lab/tiny-a@8976b4494868209c1aa701c350d8990989f06532", start=3,
                             verified=("gpu3",))
    plan = plan_sources(hosts)
    assert sources(plan) == {"gpu1": ("hub", None, 1), "gpu2": ("peer", "gpu1", 2),
                             "gpu3": ("verified", None, 0), "gpu4": ("peer", "gpu3", 1)}


def test_a_shared_store_is_filled_once_and_counted_once():
    store = {"gpu3": "nfs1", "gpu4": "nfs1", "gpu5": "nfs1"}
    plan = plan_sources(fleet(5, store=store))
    assert sources(plan) == {"gpu1": ("hub", None, 1), "gpu2": ("peer", "gpu1", 2),
                             "gpu3": ("peer", "gpu1", 3), "gpu4": ("store", "gpu1", 3),
                             "gpu5": ("store", "gpu1", 3)}
    assert plan["totals"]["units"] == 3 and plan["totals"]["copies"] == 2
    assert plan["totals"]["peer_bytes"] == 2 * 7 * MIB          # the store's bytes once
    assert plan["hosts"]["gpu3"]["line"] == "from gpu1 into the shared store nfs1: 7.0 MiB (round 3)"
    assert plan["hosts"]["gpu4"]["line"] == "in the shared store nfs1, which gpu3 fills from gpu1 (round 3)"
    assert plan["sites"]["s1"]["stores"] == ["nfs1"]


def test_a_store_alone_downloads_once_and_a_store_that_has_it_serves_the_site():
    alone = plan_sources(fleet(2, store={"gpu1": "nfs1", "gpu2": "nfs1"}))
    assert sources(alone) == {"gpu1": ("hub", None, 1), "gpu2": ("store", None, 1)}
    assert alone["hosts"]["gpu1"]["line"].startswith("from the Hub into the shared store nfs1: 7.0 MiB (round 1)")
    assert alone["totals"]["hub_bytes"] == 7 * MIB and alone["totals"]["hub_downloads"] == 1
    # the store has it (seen verified from gpu2): gpu2 serves the others, gpu1 has nothing to do
    hosts = fleet(4, store={"gpu1": "nfs1", "gpu2": "nfs1"}, verified=("gpu2",))
    hosts[0]["bytes"] = 0
    plan = plan_sources(hosts)
    assert sources(plan) == {"gpu1": ("store", None, 0), "gpu2": ("verified", None, 0),
                             "gpu3": ("peer", "gpu2", 1), "gpu4": ("peer", "gpu2", 2)}
    assert plan["hosts"]["gpu1"]["line"] == "already in the shared store nfs1"
    assert plan["hosts"]["gpu2"]["line"] == "already in the shared store nfs1"


def test_a_bad_source_is_skipped_and_the_hub_is_the_fallback_only_when_no_peer_has_it():
    hosts = fleet(4, verified=("gpu1", "gpu2"))
    plan = plan_sources(hosts, bad_sources={"gpu2": "its copy of model.safetensors did not verify at gpu4"})
    assert sources(plan) == {"gpu1": ("verified", None, 0), "gpu2": ("verified", None, 0),
                             "gpu3": ("peer", "gpu1", 1), "gpu4": ("peer", "gpu1", 2)}
    assert plan["totals"]["hub_bytes"] == 0
    only_bad = plan_sources(fleet(3, verified=("gpu1",)), bad_sources={"gpu1": "bad copy"})
    assert sources(only_bad)["gpu2"] == ("hub", None, 1) and sources(only_bad)["gpu3"] == ("peer", "gpu2", 2)
    assert only_bad["hosts"]["gpu2"]["line"] == \
        "from the Hub: 7.0 MiB (round 1); no host of site s1 can serve it (gpu1: bad copy)"


def test_a_receiver_that_failed_from_a_source_copies_from_another():
    hosts = fleet(3, verified=("gpu1", "gpu2"))
    plan = plan_sources(hosts, avoid={"gpu3": ["gpu1"]})
    assert sources(plan)["gpu3"] == ("peer", "gpu2", 1)
    # no other source now, but one appears after this round: it waits rather than use the Hub
    hosts = fleet(3, verified=("gpu1",))
    plan = plan_sources(hosts, avoid={"gpu3": ["gpu1"]})
    assert sources(plan) == {"gpu1": ("verified", None, 0), "gpu2": ("peer", "gpu1", 1),
                             "gpu3": ("peer", "gpu2", 2)}
    # nobody else can ever serve it: the Hub, and the line says why
    plan = plan_sources(fleet(2, verified=("gpu1",)), avoid={"gpu2": ["gpu1"]})
    assert sources(plan)["gpu2"] == ("hub", None, 1)
    assert plan["hosts"]["gpu2"]["line"].endswith("no peer of site s1 could serve it (gpu1: copy failed)")


@pytest.mark.parametrize("n, fanout", [(4, 1), (8, 1), (13, 2), (6, 1)])
def test_the_plan_after_each_round_is_the_rest_of_the_first_plan(n, fanout):
    """The run re-plans after every round from what became verified; it must do what the preview said."""
    hosts = fleet(n, store={"gpu5": "nfs", "gpu6": "nfs"} if n == 6 else None)
    first = plan_sources(hosts, fanout=fanout)
    executed = []
    while True:
        plan = plan_sources(hosts, fanout=fanout)
        step = peer_plan.first_round(plan)
        if not step["round"]:
            break
        executed.append(step)
        done = set(step["hub"]) | {c["host"] for c in step["copies"]}
        for h in hosts:
            if h["name"] in done:
                h["verified"], h["bytes"] = True, 0
    assert [(s["hub"], s["copies"]) for s in executed] == [(s["hub"], s["copies"]) for s in first["rounds"]]


@pytest.mark.parametrize("hosts, kwargs, message", [
    ("nope", {}, "hosts must be a list"),
    ([{"site": "a"}], {}, r"hosts\[0\] has no name"),
    ([{"name": "a"}, {"name": "a"}], {}, "host a is listed twice"),
    ([{"name": "a", "bytes": -1}], {}, "host a: bytes must be"),
    ([{"name": "a"}], {"fanout": 0}, "fanout must be 1 or more"),
    ([{"name": "a"}], {"hub_seeds": 0}, "hub_seeds must be 1 or more"),
])
def test_bad_input_is_named(hosts, kwargs, message):
    with pytest.raises(peer_plan.PlanError, match=message):
        plan_sources(hosts, **kwargs)


def test_two_hub_seeds_per_site():
    plan = plan_sources(fleet(6), hub_seeds=2)
    assert plan["rounds"][0]["hub"] == ["gpu1", "gpu2"]
    assert plan["totals"]["hub_downloads"] == 2 and plan["totals"]["rounds"] == 3


# ------------------------------------------------------------------ a run's rounds (the role's filters)
def state(name, verified=False, size=7 * MIB, **more):
    return dict({"name": name, "site": "s1", "store": "", "target": T, "verified": verified,
                 "bytes": 0 if verified else size, "attempts": 0, "avoid": [], "blamed": {}}, **more)


def test_a_bad_copy_blames_the_source_which_hashes_itself_and_is_healed_from_a_good_one():
    states = [state("gpu1", True), state("gpu2", True), state("gpu3"), state("gpu4")]
    plan = peer_plan.plan_from_states(states)
    steps = {h: peer_plan.host_round(plan, h) for h in ("gpu1", "gpu2", "gpu3", "gpu4")}
    assert steps == {"gpu1": {"round": 1, "action": "done", "from": None},
                     "gpu2": {"round": 1, "action": "done", "from": None},
                     "gpu3": {"round": 1, "action": "copy", "from": "gpu1"},
                     "gpu4": {"round": 1, "action": "copy", "from": "gpu2"}}
    ok = {"changed": True, "failed": False, "verified": True, "copied": {"bytes": 7 * MIB}}
    bad = {"changed": True, "failed": False, "verified": False, "cause": "bad_copy", "msg": "peer_snapshot: ...",
           "missing": {"bytes": 7 * MIB}, "verification": {"failures": [{"path": "model.safetensors"}]}}
    states[2] = peer_plan.after_round(states[2], steps["gpu3"], ok)
    states[3] = peer_plan.after_round(states[3], steps["gpu4"], bad)
    assert states[2]["got"] == {"source": "peer", "from": "gpu1", "round": 1, "bytes": 7 * MIB}
    assert states[3]["blamed"] == {"gpu2": "its copy of model.safetensors did not verify at gpu4"}
    assert states[3]["attempts"] == 1 and "fail" not in states[3]
    plan = peer_plan.plan_from_states(states, first=2)
    assert peer_plan.host_round(plan, "gpu2") == {"round": 2, "action": "rehash", "from": None}
    assert peer_plan.host_round(plan, "gpu4") == {"round": 2, "action": "copy", "from": "gpu1"}
    assert plan["hosts"]["gpu4"]["line"] == "from gpu1: 7.0 MiB (round 2)"
    rot = {"failed": False, "verified": False, "cause": "bad_content", "missing": {"bytes": 6 * MIB}}
    states[1] = peer_plan.after_round(states[1], {"round": 2, "action": "rehash", "from": None}, rot)
    states[3] = peer_plan.after_round(states[3], {"round": 2, "action": "copy", "from": "gpu1"}, ok)
    assert states[1]["verified"] is False and states[1]["rehashed"] and states[1]["bytes"] == 6 * MIB
    plan = peer_plan.plan_from_states(states, first=3)
    assert peer_plan.host_round(plan, "gpu2") == {"round": 3, "action": "copy", "from": "gpu1"}
    assert plan["more"] and plan["totals"]["hub_bytes"] == 0
    states[1] = peer_plan.after_round(states[1], {"round": 3, "action": "copy", "from": "gpu1"}, ok)
    plan = peer_plan.plan_from_states(states, first=4)
    assert not plan["more"] and all(peer_plan.host_round(plan, h)["action"] == "done" for h in plan["hosts"])
    assert peer_plan.outcome_lines(states) == [
        "gpu1: already verified here",
        "gpu2: from gpu1, 7.0 MiB (round 3)",
        "gpu3: from gpu1, 7.0 MiB (round 1)",
        "gpu4: from gpu1, 7.0 MiB (round 2) after 1 failed copy (round 1 from gpu2: peer_snapshot: ...)",
        "in all: 0 B from the Hub, 21.0 MiB between hosts",
    ]


@pytest.mark.parametrize("cause, attempts, retries, avoid, blamed, fails", [
    ("copy_failed", 0, 2, ["gpu1"], {}, False),
    ("source_incomplete", 0, 2, [], {"gpu1": "it lacks files of the snapshot (seen from gpu2)"}, False),
    ("local_bad", 0, 2, [], {}, False),
    ("copy_failed", 2, 2, ["gpu1"], {}, True),          # the third failure with retries 2
    ("disk_full", 0, 2, [], {}, True),                  # no other source helps
    ("no_rsync", 0, 2, [], {}, True),
])
def test_what_a_failed_copy_does_next(cause, attempts, retries, avoid, blamed, fails):
    before = state("gpu2", attempts=attempts)
    after = peer_plan.after_round(before, {"round": 1, "action": "copy", "from": "gpu1"},
                                  {"failed": False, "verified": False, "cause": cause, "msg": "peer_snapshot: x"},
                                  retries)
    assert after["avoid"] == avoid and after["blamed"] == blamed
    assert ("fail" in after) is fails
    assert after["attempts"] == attempts + 1 and after["verified"] is False


def test_a_hub_download_that_reached_the_next_task_verified_the_host():
    after = peer_plan.after_round(state("gpu1"), {"round": 1, "action": "hub", "from": None})
    assert after["verified"] and after["got"] == {"source": "hub", "from": None, "round": 1, "bytes": 7 * MIB}


def test_a_store_member_waits_while_the_store_is_filled_and_is_done_after():
    states = [state("gpu1", store="nfs"), state("gpu2", store="nfs")]
    plan = peer_plan.plan_from_states(states)
    assert peer_plan.host_round(plan, "gpu1")["action"] == "hub"
    assert peer_plan.host_round(plan, "gpu2")["action"] == "wait"
    states[0]["verified"] = states[1]["verified"] = True
    plan = peer_plan.plan_from_states(states, first=2)
    assert [peer_plan.host_round(plan, h)["action"] for h in ("gpu1", "gpu2")] == ["done", "done"]
