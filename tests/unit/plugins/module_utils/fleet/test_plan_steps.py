"""The migration's todo list for one host (plugins/module_utils/fleet/plan_steps.py), table-tested:
test_plan_steps.yaml holds the cases (a PlanInputs mapping in, what the plan must hold)."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import plan_data, plan_steps
from tests.support import yaml_table

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", yaml_table.cases(__file__))
def test_plan_steps(case):
    yaml_table.check(plan_steps.plan_steps(plan_steps.plan_inputs(case["input"])), case)


def test_the_inputs_are_checked_against_plan_inputs():
    with pytest.raises(plan_data.InputError, match=r"migrate_plan: unknown key\(s\) plan \(it takes target, disk, "):
        plan_steps.plan_inputs({"target": "t", "plan": {}})
    with pytest.raises(plan_data.InputError, match=r"migrate_plan: missing key\(s\) target"):
        plan_steps.plan_inputs({"disk": None})
    with pytest.raises(plan_data.InputError, match="migrate_plan takes a mapping of target, disk, .* not str"):
        plan_steps.plan_inputs("kimi")
