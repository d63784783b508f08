"""The fleet-wide part of the migration's plan (plugins/module_utils/fleet/fleet_plan.py),
table-tested: test_fleet_plan.yaml holds the hosts (plain FleetHost mappings, no hostvars), the
options and what the plan must hold; and store_others' cases."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import fleet_plan
from tests.support import yaml_table

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", yaml_table.cases(__file__))
def test_fleet_plan(case):
    yaml_table.check(fleet_plan.fleet_plan(case["hosts"], **(case.get("options") or {})), case)


@pytest.mark.parametrize("case", yaml_table.cases(__file__, "store_others"))
def test_store_others(case):
    yaml_table.check(fleet_plan.store_others(case["stores"], case["play"]), case)


UNITS = [["g1", "g2"], ["a"], ["b"], ["t1", "t2", "t3"], ["c"]]


@pytest.mark.parametrize("serial, sizes", [
    ("100%", [8]), (1, [2, 1, 1, 3, 1]), ("2", [3, 4, 1]), ("40%", [3, 4, 1]), ("10%", [2, 1, 1, 3, 1]),
    ([1, "50%"], [2, 2, 4]), ([1, 0], [2, 6]), ([], [8]), (-1, [8]),
])
def test_serial_counts_a_replica_group_once(serial, sizes):
    assert fleet_plan.batch_sizes(UNITS, serial) == sizes
    assert sum(sizes) == 8 and fleet_plan.batch_sizes([], serial) == []


@pytest.mark.parametrize("serial", ["two", "%", None, [1, "x%"]])
def test_a_serial_that_is_no_number_is_refused_naming_the_variable(serial):
    with pytest.raises(ValueError, match="modelswap_serial: .* is not a number of hosts"):
        fleet_plan.batch_sizes(UNITS, serial)


def test_a_groups_worker_is_no_server_of_the_pool_its_head_is():
    servers = [{"name": "gpu1", "status": "UP", "serving": True}, {"name": "gpu3", "status": "UP", "serving": True}]
    lb = {"type": "haproxy", "pool": {"action": "pool", "servers": servers}, "backend": "vllm", "min_serving": 1}
    read = {"service": {}, "fetch": {"commit": "c"}}
    hosts = {name: {"read": read, "serve": "m", "models": {}} for name in ("gpu1", "gpu2", "gpu3")}
    plan = fleet_plan.fleet_plan(hosts, lb=lb, groups={"pair": {"nodes": ["gpu1", "gpu2"]}})
    assert plan["hosts"]["gpu1"]["pool"]["floor_ok"] and plan["hosts"]["gpu3"]["pool"]["floor_ok"]
    assert "pool" not in plan["hosts"]["gpu2"]
    # without the group, gpu2 would be refused: it is no server of the pool
    assert "gpu2 is not a server" in fleet_plan.fleet_plan(hosts, lb=lb)["hosts"]["gpu2"]["pool"]["problem"]
