"""One host's run record, the step a failed task is charged to, and the plan's lines
(plugins/module_utils/fleet/run_record.py), table-tested: test_run_record.yaml holds the cases."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import plan_data, run_record
from tests.support import yaml_table

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", yaml_table.cases(__file__))
def test_run_record(case):
    yaml_table.check(run_record.run_record(run_record.record_inputs(case["input"])), case)


@pytest.mark.parametrize("case", yaml_table.cases(__file__, "failure_of"))
def test_failure_of(case):
    yaml_table.check(run_record.failure_of(case["marks"], case["task"], case["result"]), case)


@pytest.mark.parametrize("case", yaml_table.cases(__file__, "plan_lines"))
def test_plan_lines(case):
    yaml_table.check(run_record.plan_lines(case["plan"], case["host"], case["check_mode"]), case)


def test_the_inputs_are_checked_against_record_inputs():
    base = {"host": "h", "run_id": "r", "target": "t", "plan": {}, "check_mode": False}
    with pytest.raises(plan_data.InputError, match=r"migrate_record: unknown key\(s\) marks \(it takes host, run_id, "):
        run_record.record_inputs(dict(base, marks={}))
    with pytest.raises(plan_data.InputError, match=r"migrate_record: missing key\(s\) run_id, check_mode"):
        run_record.record_inputs({"host": "h", "target": "t", "plan": {}})
    assert run_record.record_inputs(base) == base
