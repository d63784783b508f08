"""Shared pytest wiring.

Under CI=true (and `make test`, which sets MODELSWAP_REQUIRE_LAB=1) a lab test that skips is a
failure: a missing lab must never pass silently.
"""
from __future__ import annotations

import os

import pytest

pytest_plugins = ["tests.lab.fixtures", "tests.lab.hub.fixtures"]

REQUIRE_LAB = os.environ.get("CI") == "true" or os.environ.get("MODELSWAP_REQUIRE_LAB") == "1"
NEEDS_LAB = {"lab", "vllm", "hub"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_LAB and report.skipped and NEEDS_LAB & {m.name for m in item.iter_markers()}:
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"lab test skipped while the lab is required (CI=true): {reason}"
