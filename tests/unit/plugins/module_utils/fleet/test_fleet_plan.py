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
