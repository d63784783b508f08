# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Filters over the fleet's source plan: where each host's bytes come from (model_fetch with peers).

The planner is plugins/module_utils/fleet/peer_plan.py (table-tested there); these filters only hand it
what the role gathered and turn its errors into filter errors.
"""
from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_plan as planner


def peer_plan(states, fanout=1, hub_seeds=1, first_round=1):
    """The per-host source plan from the hosts' states (``plan_from_states``): ``{"hosts": {name:
    {"source", "from", "round", "bytes", "line", ...}}, "rounds", "sites", "totals", "lines"}``;
    rounds are numbered from ``first_round``."""
    try:
        return planner.plan_from_states(list(states), fanout=int(fanout), hub_seeds=int(hub_seeds),
                                        first=int(first_round))
    except planner.PlanError as exc:
        raise AnsibleFilterError("peer_plan: %s" % exc)


def peer_round(plan, host):
    """What ``host`` does in the plan's next round: ``{"round", "action", "from"}`` (hub, copy, wait, done)."""
    return planner.host_round(plan, host)


def peer_after(state, step, result=None, retries=2):
    """A host's state after its part in a round (``after_round``): verified, or what failed and whom to avoid."""
    return planner.after_round(dict(state), dict(step), dict(result or {}), int(retries))


def peer_outcome(states):
    """Where each host's bytes came from in this run, and the totals (lines)."""
    return planner.outcome_lines(list(states))


def peer_summary(plan):
    """One line per site and one for the fleet (downloads, copies, bytes, rounds)."""
    return planner.summary_lines(plan)


class FilterModule:
    def filters(self):
        return {"peer_plan": peer_plan, "peer_round": peer_round, "peer_summary": peer_summary,
                "peer_after": peer_after, "peer_outcome": peer_outcome}
