"""The fleet filters (plugins/filter/fleet.py) hand model_fetch's peers steps the planner of
plugins/module_utils/fleet/peer_plan.py (table-tested in
tests/unit/plugins/module_utils/fleet/test_peer_plan.py) and name bad input."""
from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.modelswap.vllm.plugins.filter import fleet

pytestmark = pytest.mark.unit

MIB = 1024 ** 2
T = "lab/tiny-b@" + "b" * 40


def state(name, verified=False, size=7 * MIB):
    return {"name": name, "site": "s1", "store": "", "target": T, "verified": verified,
            "bytes": 0 if verified else size, "attempts": 0, "avoid": [], "blamed": {}}


def test_the_filters_hand_the_role_the_planner_and_name_bad_input():
    filters = fleet.FilterModule().filters()
    assert set(filters) == {"peer_plan", "peer_round", "peer_after", "peer_summary", "peer_outcome"}
    fleet_states = [state("gpu1"), state("gpu2")]
    plan = filters["peer_plan"](fleet_states, "1", "1", "3")
    assert filters["peer_round"](plan, "gpu1") == {"round": 3, "action": "hub", "from": None}
    assert filters["peer_summary"](plan)[-1].startswith("fleet: 2 host(s)")
    assert filters["peer_outcome"](fleet_states)[-1] == "in all: 0 B from the Hub, 0 B between hosts"
    with pytest.raises(AnsibleFilterError, match="peer_plan: host gpu1 is listed twice"):
        filters["peer_plan"]([state("gpu1"), state("gpu1")])
