"""The migration's run summary (templates/run_summary.md.j2) rendered from hosts' run records: the
capacity line a rate ladder adds (each host's capacity at the SLO, and the fleet's sum)."""
from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.store.model_store import human_bytes

pytestmark = pytest.mark.unit

TEMPLATE = Path(__file__).resolve().parents[3] / "templates" / "run_summary.md.j2"


def record(host, capacity=None, headline=None):
    return {"host": host, "target": "kimi", "outcome": "migrated", "failure": None, "rolled_back": False,
            "fetch": {"bytes_downloaded": 0}, "purge": {"freed_bytes": 0, "planned_bytes": 0},
            "swap": {"downtime_s": 61.0, "startup_phases": None},
            "benchmark": {"report": f"results/{host}/report.md", "capacity": capacity, "headline": headline}}


def render(records):
    env = jinja2.Environment(extensions=["jinja2.ext.do"])
    env.filters["modelswap.vllm.human_bytes"] = human_bytes
    hosts = [r["host"] for r in records]
    return env.from_string(TEMPLATE.read_text()).render(
        ansible_check_mode=False, migrate_run_id="r1", __migrate_hosts=records, migrate_hosts_group="gpus",
        groups={"gpus": hosts}, hostvars=dict({h: {"migrate_record": r} for h, r in zip(hosts, records)},
                                              localhost={}))


def cap(rate, above=False):
    return {"rate": rate, "first_failing_rate": None if above else rate * 1.2, "slo": "TTFT p99 <= 2 s",
            "above_every_rate": above, "below_every_rate": False}


def test_the_fleets_capacity_is_the_sum_of_its_hosts():
    out = render([record("gpu1", cap(12.5), "gpu1 holds 12.5 req/s at TTFT p99 <= 2 s (misses it at 15 req/s)"),
                  record("gpu2", cap(10), "gpu2 holds 10 req/s at TTFT p99 <= 2 s (misses it at 12 req/s)")])
    assert "| gpu1 | kimi | migrated | 0 B | 0 B | 61.0 s | gpu1 holds 12.5 req/s at TTFT p99 <= 2 s" in out
    assert "Capacity at the SLO (the benchmark's rate ladder): 22.5 req/s in all, on 2 host(s) (TTFT p99 <= 2 s)." in out


def test_a_host_that_passed_every_rate_says_the_fleet_may_hold_more_and_a_concurrency_run_adds_no_line():
    out = render([record("gpu1", cap(8, above=True), "gpu1 holds 8 req/s ..."), record("gpu2")])
    assert "8 req/s in all, on 1 host(s) (TTFT p99 <= 2 s); some hosts passed every rate offered" in out
    assert "Capacity at the SLO" not in render([record("gpu1"), record("gpu2")])
