"""migrate_final: each host's final plan and run record from its variables, in one call for a
play (what the migrate role's records were built from one Jinja template per host before): a
previewed host from its read and plan, a host after its steps from their results, a host that
failed before its plan from the role's settings."""
from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.modelswap.vllm.plugins.filter.migrate import FilterModule, final, host_records
from tests.unit.plugins.filter.test_migrate_filters import FETCH_CHECK, GIB, PLAN, PURGE, SERVICE_CHECK

pytestmark = pytest.mark.unit

SETTINGS = {"benchmark": {"enabled": False, "concurrency": [1]}, "download_rate": "1e9", "install": {"enabled": "true"}}
PLANNED = {"target": "tiny-b", "marks": {"preflight": 100.0},
           "settings": {"benchmark": {"enabled": True, "concurrency": [1, 8]}, "download_rate": 2e9,
                        "install": {"enabled": False}},
           "service": dict(SERVICE_CHECK, pool={"line": "vllm/gpu1 UP, 1 of 2 others serving"}, repairs=["rejoin"]),
           "install": {"would_install": False}, "source": None}
READ = {"disk": PLAN, "purge": PURGE, "fetch": FETCH_CHECK}


def run(hostvars, hosts=None, check_mode=True):
    return final(hosts or list(hostvars), hostvars, "run-1", "tiny-z", SETTINGS, check_mode, 200.0)


def test_a_previewed_host_is_planned_from_its_read_and_plan():
    out = run({"gpu1": {"inventory_hostname": "gpu1", "__migrate_read": READ, "__migrate": PLANNED}})["gpu1"]
    steps = {s["step"]: s for s in out["plan"]["steps"]}
    assert steps["purge"]["items"][0]["name"] == "kimi-k2.5-nvfp4"
    assert steps["fetch"]["bytes"] == 547 * GIB and steps["fetch"]["eta_s"] == pytest.approx(547 * GIB / 2e9)
    assert steps["swap"]["start"] == "tiny-b" and steps["benchmark"]["enabled"] is True
    assert out["marks"] == {"preflight": 100.0, "end": 200.0}
    record = out["record"]
    assert record["host"] == "gpu1" and record["run_id"] == "run-1" and record["target"] == "tiny-b"
    assert record["check_mode"] is True and record["plan"] == out["plan"]
    assert record["swap"]["replaced_model"] == "minimax-m2.5" and record["outcome"] == "preview"
    # the plan's pool goes with the service: the swap drains the host first
    assert steps["swap"]["drain"] is True and steps["swap"]["pool"] == "vllm/gpu1 UP, 1 of 2 others serving"


def test_a_host_after_its_steps_is_recorded_from_what_they_reported():
    fetched = {"commit": "c" * 40, "fetched": {"files": 3, "bytes": 10}, "peer": {"got": {"source": "peer", "from": "gpu2"}}}
    facts = {"inventory_hostname": "gpu1", "__migrate_read": READ, "__migrate": PLANNED,
             "__migrate_marks": {"preflight": 100.0, "swap": 150.0},
             "model_fetch_result": fetched, "vllm_service_result": {"swapped": True, "unit": "vllm.service"},
             "migrate_purge_result": dict(PURGE, freed_bytes=540 * GIB), "benchmark_result": None}
    out = run({"gpu1": facts}, check_mode=False)["gpu1"]
    assert out["marks"] == {"preflight": 100.0, "swap": 150.0, "end": 200.0}
    assert out["record"]["fetch"]["commit"] == "c" * 40 and out["record"]["check_mode"] is False
    steps = {s["step"]: s for s in out["plan"]["steps"]}
    # the download's peer as it reported it, not the plan's source
    assert steps["fetch"]["source"] == "peer" and steps["fetch"]["source_host"] == "gpu2"
    # the service as the swap reported it, with the plan's pool (the drain)
    assert steps["swap"]["would_swap"] is True and steps["swap"]["drain"] is True
    assert out["record"]["swap"]["swapped"] is True
    assert out["record"]["swap"]["swapped"] is True and out["record"]["purge"]["freed_bytes"] == 540 * GIB


def test_a_host_that_failed_before_its_plan_gets_the_roles_settings_and_its_own_target():
    facts = {"inventory_hostname": "gpu2", "modelswap_serve": "tiny-b",
             "__migrate_failure": {"step": "preflight", "task": "Read the host", "msg": "unreachable"}}
    out = run({"gpu2": facts}, check_mode=False)["gpu2"]
    assert out["record"]["target"] == "tiny-b" and out["record"]["failure"]["step"] == "preflight"
    assert out["marks"] == {"end": 200.0}
    assert {s["step"] for s in out["plan"]["steps"]} >= {"preflight"}


def test_the_plays_records_are_what_the_summary_reads_for_hosts_without_a_record_of_their_own():
    hostvars = {"gpu1": {"inventory_hostname": "gpu1", "__migrate_read": READ, "__migrate": PLANNED},
                "gpu2": {"inventory_hostname": "gpu2", "migrate_record": {"host": "gpu2", "own": True}}}
    built = run(hostvars, hosts=["gpu1"])
    hostvars["localhost"] = {"__migrate_finals": built}
    assert host_records(["gpu1", "gpu2", "gpu3"], hostvars) == [built["gpu1"]["record"], {"host": "gpu2", "own": True}, None]


def test_a_bad_plan_fails_naming_the_host():
    bad = dict(PLANNED, settings={"download_rate": 1})
    with pytest.raises(AnsibleFilterError, match="gpu1"):
        run({"gpu1": {"inventory_hostname": "gpu1", "__migrate_read": READ, "__migrate": bad}})


def test_the_filter_is_published():
    assert FilterModule().filters()["migrate_final"] is final


GROUPS = {"pair": {"nodes": ["gpu1", "gpu2"]}}


def test_a_worker_whose_group_restarts_is_planned_to_restart_with_it_and_each_node_names_its_group():
    keeps = dict(PLANNED, service=dict(SERVICE_CHECK, would_swap=False, replaced_model=None, restart_reasons=[],
                                       repairs=["repair the record"]))
    read = dict(READ, service={"deployment": {"model": "tiny-a"}})
    hostvars = {"gpu1": {"inventory_hostname": "gpu1", "__migrate_read": read, "__migrate": PLANNED},
                "gpu2": {"inventory_hostname": "gpu2", "__migrate_read": read, "__migrate": keeps},
                "localhost": {"__migrate_rollout": {"group_swaps": {"gpu2": "its replica group pair restarts "
                                                                            "as one unit (gpu1 must)"}}}}
    out = final(["gpu1", "gpu2"], hostvars, "run-1", "tiny-z", dict(SETTINGS, replica_groups=GROUPS), True, 200.0)
    worker = {s["step"]: s for s in out["gpu2"]["plan"]["steps"]}["swap"]
    assert worker["would_swap"] is True and worker["stop"] == "tiny-a" and worker["repairs"] == []
    assert "restart (its replica group pair restarts as one unit (gpu1 must))" in worker["text"]
    assert worker["text"].startswith("replica group pair (gpu1, gpu2; headless, served through gpu1): ")
    head = {s["step"]: s for s in out["gpu1"]["plan"]["steps"]}["swap"]
    assert head["text"].startswith("replica group pair (gpu1, gpu2; the head: it serves the API): ")
    assert out["gpu2"]["record"]["replica"] == {"group": "pair", "nodes": ["gpu1", "gpu2"], "rank": 1, "head": "gpu1"}
    # a host in no group: no replica, its own plan
    alone = final(["gpu2"], hostvars, "run-1", "tiny-z", SETTINGS, True, 200.0)["gpu2"]
    assert alone["record"]["replica"] is None
    assert {s["step"]: s for s in alone["plan"]["steps"]}["swap"]["would_swap"] is False
