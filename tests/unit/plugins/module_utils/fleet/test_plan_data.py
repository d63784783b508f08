"""The plan's plain-data helpers (plugins/module_utils/fleet/plan_data.py), table-tested:
test_plan_data.yaml holds the cases."""
from __future__ import annotations

from typing import TypedDict

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import plan_data
from tests.support import yaml_table

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("case", yaml_table.cases(__file__))
def test_plan_data(case):
    function = getattr(plan_data, case["call"])
    yaml_table.check(function(*case["args"], **(case.get("kwargs") or {})), case)


class Sample(TypedDict, total=False):
    a: int
    b: str


def test_checked_names_unknown_and_missing_keys():
    assert plan_data.checked("f", {"a": 1}, Sample, ("a",)) == {"a": 1}
    with pytest.raises(plan_data.InputError, match=r"^f: unknown key\(s\) c, d \(it takes a, b\)$"):
        plan_data.checked("f", {"a": 1, "d": 2, "c": 3}, Sample)
    with pytest.raises(plan_data.InputError, match=r"^f: missing key\(s\) a$"):
        plan_data.checked("f", {"b": "x"}, Sample, ("a",))
    with pytest.raises(plan_data.InputError, match=r"^f takes a mapping of a, b, not list$"):
        plan_data.checked("f", [("a", 1)], Sample)
