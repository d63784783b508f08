"""One host's plan from one read (plugins/module_utils/fleet/host_plan.py), table-tested:
test_host_plan.yaml holds the shared read and settings and the cases laid over them."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import host_plan, plan_steps
from tests.support import yaml_table

pytestmark = pytest.mark.unit

TABLE = yaml_table.load(__file__)


def planned(case: dict) -> dict:
    read = dict(TABLE["read"], **(case.get("read") or {}))
    settings = dict(TABLE["settings"], **(case.get("settings") or {}))
    return host_plan.read_plan(case.get("target", TABLE["target"]), read, case.get("expected", TABLE["expected"]), settings)


@pytest.mark.parametrize("case", yaml_table.cases(__file__))
def test_read_plan(case):
    yaml_table.check(planned(case), case)


def test_the_plan_from_one_read_is_plan_steps_over_the_steps_results():
    """The preview's steps are the ones plan_steps gives from the results the roles report in
    check mode, which read_plan makes from the read (the same numbers)."""
    out = planned({})
    assert out["plan"] == plan_steps.plan_steps({
        "target": TABLE["target"], "disk": TABLE["read"]["disk"], "fetch": TABLE["read"]["fetch"],
        "service": out["service"], "benchmark": TABLE["settings"]["benchmark"], "download_rate": 0.0,
        "install": dict(out["install"], enabled=True)})
