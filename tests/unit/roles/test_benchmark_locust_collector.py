"""The load process's garbage collector during a measured step (roles/benchmark/files/locustfile.py).

Its pauses made the event loop late at 1,024 streams, so the collector is off while a step is
measured, back on (after one collection) at any other phase, and a measured step that piles up
live container objects past GC_MEASURE_BOUND is collected anyway. The functions are taken from
the locustfile on their own: importing it would import Locust, which monkey-patches this test
process with gevent.
"""
from __future__ import annotations

import ast
import gc
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
WANTED = {"_collector_for", "_bound_garbage", "GC_MEASURE_BOUND"}


def _defines(node):
    if isinstance(node, ast.FunctionDef):
        return node.name
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


@pytest.fixture()
def locustfile():
    source = (REPO / "roles" / "benchmark" / "files" / "locustfile.py").read_text()
    body = [n for n in ast.parse(source).body if _defines(n) in WANTED]
    assert {_defines(n) for n in body} == WANTED
    namespace = {"gc": gc}
    exec(compile(ast.Module(body=body, type_ignores=[]), "locustfile.py", "exec"), namespace)
    yield type("Locustfile", (), namespace)
    gc.enable()


def test_the_collector_is_off_only_while_a_step_is_measured(locustfile):
    locustfile._collector_for("warmup")
    assert gc.isenabled()
    locustfile._collector_for("measure")
    assert not gc.isenabled()
    for phase in ("drain", "ramp", "warmup", "end"):
        locustfile._collector_for("measure")
        locustfile._collector_for(phase)
        assert gc.isenabled(), phase


def test_a_measured_step_that_piles_up_objects_is_collected_anyway(locustfile):
    locustfile._collector_for("measure")
    locustfile._bound_garbage.__globals__["GC_MEASURE_BOUND"] = 1000   # this fixture's copy only
    cycles = []
    for _unused in range(3000):
        a = []
        a.append(a)
        cycles.append(a)
    del cycles
    assert gc.get_count()[0] > 1000
    locustfile._bound_garbage()
    assert gc.get_count()[0] < 1000
    assert not gc.isenabled()   # still off: the step goes on being measured
