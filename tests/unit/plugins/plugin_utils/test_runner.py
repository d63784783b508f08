"""The ansible-runner interface (issue 9): structured results from playbook runs."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner

pytestmark = pytest.mark.unit

EVENTS = [
    {"event": "runner_on_ok", "event_data": {"host": "gpu1", "task": "plan", "res": {"changed": False}}},
    {"event": "runner_on_failed", "event_data": {"host": "gpu2", "task": "swap",
                                                 "res": {"msg": "rolled back: tiny-broken failed"}}},
    {"event": "runner_on_failed", "event_data": {"host": "gpu2", "task": "probe", "ignore_errors": True,
                                                 "res": {"msg": "ignored"}}},
    {"event": "runner_on_unreachable", "event_data": {"host": "gpu3", "task": "Gathering", "res": {"msg": "no route"}}},
    {"event": "playbook_on_stats", "event_data": {"artifact_data": {"modelswap_plan": {"gpu1": {"verdict": "fits"}}}}},
]


def result():
    stats = {"ok": {"gpu1": 3, "gpu2": 1}, "changed": {"gpu1": 2}, "failures": {"gpu2": 1}, "dark": {"gpu3": 1}}
    return runner.RunResult(rc=2, status="failed", stats=stats, events=EVENTS, stdout="",
                            custom_stats=runner._custom_stats(EVENTS))


def test_custom_stats_come_from_the_last_stats_event():
    assert result().custom_stats == {"modelswap_plan": {"gpu1": {"verdict": "fits"}}}


def test_counts_hosts_and_failures_by_host():
    res = result()
    assert res.hosts() == ["gpu1", "gpu2", "gpu3"]
    assert res.changed("gpu1") == 2 and res.failed("gpu2") == 1 and res.count("dark", "gpu3") == 1
    assert res.failures() == {"gpu2": ["swap: rolled back: tiny-broken failed"], "gpu3": ["Gathering: no route"]}
    assert res.task_results("plan", "gpu1")[0]["_event"] == "runner_on_ok"
    assert not res.ok and res.to_dict()["failures"]["gpu2"]


def test_tasks_per_host_counts_every_task_result_once():
    events = EVENTS + [
        {"event": "runner_on_skipped", "event_data": {"host": "gpu1", "task": "skip"}},
        {"event": "runner_item_on_ok", "event_data": {"host": "gpu1", "task": "loop"}},   # an item: not a task
        {"event": "runner_on_ok", "event_data": {"host": "gpu1", "task": "loop"}},
        {"event": "runner_on_start", "event_data": {"host": "gpu1", "task": "skip"}},
    ]
    res = runner.RunResult(rc=0, status="successful", stats={}, events=events, stdout="")
    assert res.tasks_per_host() == {"gpu1": 3, "gpu2": 2, "gpu3": 1}
    assert res.to_dict()["tasks_per_host"] == res.tasks_per_host()


def test_a_missing_playbook_or_inventory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no playbook 'nope.yml'"):
        runner.run_playbook("nope.yml", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no inventory"):
        runner.run_playbook("preflight.yml", str(tmp_path / "missing"))


def test_the_cli_rejects_extra_vars_that_are_not_json(capsys):
    with pytest.raises(SystemExit):
        runner.main(["preview", "-i", "inventory/lab", "-e", "{not json"])
    assert "--extra-vars must be a JSON object" in capsys.readouterr().err
