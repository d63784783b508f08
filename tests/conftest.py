"""Shared pytest wiring.

Under CI=true (and `make test`, which sets MODELSWAP_REQUIRE_LAB=1) a lab test that skips is a
failure: a missing lab must never pass silently.

The built collection ships tests/unit without the lab's tooling (tests/lab, galaxy.yml's
build_ignore): there `ansible-test units` runs the tests that need neither the lab, the local Hub
nor the repository around the collection (tests/sanity/run.sh leaves out the files that import the
lab's tooling; the tests marked lab, vllm, hub or repo are reported as deselected, never skipped).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REQUIRE_LAB = os.environ.get("CI") == "true" or os.environ.get("MODELSWAP_REQUIRE_LAB") == "1"
NEEDS_LAB = {"lab", "vllm", "hub"}
HAS_LAB_TOOLING = (Path(__file__).parent / "lab" / "fixtures.py").is_file()
pytest_plugins = ["tests.lab.fixtures", "tests.lab.hub.fixtures"] if HAS_LAB_TOOLING else []
# The markers live here, not in pytest.ini, so ansible-test's own pytest config knows them too.
MARKERS = {
    "unit": "fast tests with no lab (pure logic, fakes only where the lab has no real thing)",
    "hub": "tests that start the local Hub on loopback (no root needed)",
    "lab": "tests that need the running lab (systemd-nspawn hosts over SSH); run by `make test`",
    "vllm": "lab tests that start real vLLM on a lab host (about a minute each)",
    "campaign": "lab fault drills beyond make test's sample (they share a story with the sampled tests "
                "and run in its order): `make test-full` runs them with the rest of the lab suite",
    "serial": "timing-sensitive tests (the benchmark client's accuracy): `make test-unit` runs them alone, "
              "after the rest of the unit tests ran on two workers",
    "repo": "tests of the repository as a whole (its layout, docs, example inventory, build), not of the built collection",
}


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", "%s: %s" % (name, text))


def pytest_collection_modifyitems(config, items):
    if HAS_LAB_TOOLING:
        return
    left = [item for item in items if (NEEDS_LAB | {"repo"}) & {m.name for m in item.iter_markers()}]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if item not in left]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_LAB and report.skipped and NEEDS_LAB & {m.name for m in item.iter_markers()}:
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"lab test skipped while the lab is required (CI=true): {reason}"
