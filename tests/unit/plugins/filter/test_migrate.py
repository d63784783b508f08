"""The migrate filters are adapters (plugins/filter/migrate.py): they read hostvars and Jinja
arguments into the plain mappings plugins/module_utils/fleet/ takes (table-tested there). These
tests check that reading, the mapping call form of migrate_plan and migrate_record, and that
roles/migrate/tasks/record.yml's calls render through ansible-playbook."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.modelswap.vllm.plugins.filter import migrate
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import fleet_plan, plan_steps, run_record
from tests.support.modules import REPO

pytestmark = pytest.mark.unit

C_OLD, C_NEW = "a" * 40, "b" * 40
MODELS = {"old": {"repo_id": "org/old"}, "new": {"repo_id": "org/new"}, "other": {"repo_id": "org/other"}}
READ = {"fetch": {"commit": C_NEW, "verified": False, "would_fetch": {"bytes": 1000}},
        "service": {"deployment": {"model": "old", "repo_id": "org/old", "commit": C_OLD}}, "purge": None}


class HostVars(Mapping):
    """hostvars as Ansible hands it to a filter: a mapping of each host's variables that is not a dict."""

    def __init__(self, hosts):
        self._hosts = hosts

    def __getitem__(self, name):
        return self._hosts[name]

    def __iter__(self):
        return iter(self._hosts)

    def __len__(self):
        return len(self._hosts)


def host(read=None, store="", serve="new", site="s1"):
    """A host's hostvars as the filters see them (read: its migrate_info result, READ by default)."""
    return {"__migrate_read": READ if read is None else read, "modelswap_serve": serve, "modelswap_models": MODELS, "modelswap_store": store,
            "modelswap_site": site, "ansible_host": "10.0.0.1"}


def test_hostvars_are_read_into_the_fleets_mapping():
    hostvars = HostVars({"g1": host(), "g2": host(store="nfs1", site=""), "g3": host(read={"failed": True, "msg": "x"}),
                         "g4": host(read="not a read", store="nfs1"), "g5": {"modelswap_store": "nfs1"}, "g6": None})
    assert migrate.fleet_hosts(["g1", "g2", "g3", "g4", "g5", "g6", "g9"], hostvars) == {
        "g1": {"read": READ, "serve": "new", "models": MODELS, "store": "", "site": "s1"},
        "g2": {"read": READ, "serve": "new", "models": MODELS, "store": "nfs1", "site": ""},
        "g3": {"read": None, "store": ""},          # its read failed: only its store counts
        "g4": {"read": None, "store": "nfs1"},
        "g5": {"read": None, "store": "nfs1"},      # never read (unreachable before the read)
        "g6": {"read": None, "store": ""},          # variables hostvars cannot give
        "g9": {"read": None, "store": ""},          # not in hostvars at all
    }
    assert list(migrate.fleet_hosts(["g2", "g1"], hostvars)) == ["g2", "g1"]      # the play's order


def test_the_loops_results_are_read_into_other_reads():
    hostvars = HostVars({"o1": {"modelswap_store": "nfs1", "modelswap_serve": "new", "modelswap_models": MODELS},
                         "o2": {"modelswap_store": "nfs1"}, "o3": {"modelswap_store": ""}})
    deployment = {"model": "other", "repo_id": "org/other", "commit": C_OLD}
    results = [{"item": "o1", "deployment": deployment, "changed": False},
               {"item": "o2", "unreachable": True, "msg": "timed out"},
               {"item": "o3", "deployment": deployment},         # no store: nothing to protect
               {"item": "o9", "failed": True},                   # not in hostvars
               {"item": None}, "not a result"]
    assert migrate.other_reads(results, hostvars) == [
        {"host": "o1", "store": "nfs1", "deployment": deployment, "failed": False, "unreachable": False, "msg": None,
         "serve": "new", "models": MODELS},
        {"host": "o2", "store": "nfs1", "deployment": None, "failed": False, "unreachable": True, "msg": "timed out"}]
    assert migrate.other_reads(None, hostvars) == []


def test_the_fleet_filter_is_the_fleet_plan_of_the_mapping():
    hostvars = HostVars({"g5": host(read=dict(READ, purge={"items": ["org/other@" + C_OLD]}), store="nfs1"),
                         "g6": host(store="nfs1"), "o1": {"modelswap_store": "nfs1", "modelswap_serve": "other",
                                                          "modelswap_models": MODELS}})
    others = [{"item": "o1", "deployment": {"model": "other", "repo_id": "org/other", "commit": C_OLD}}]
    lb = {"type": "f5"}
    out = migrate.FilterModule().filters()["migrate_fleet"](["g5", "g6"], hostvars, True, 1, 1, lb, others)
    assert out == fleet_plan.fleet_plan(migrate.fleet_hosts(["g5", "g6"], hostvars), peers=True, lb=lb,
                                        others=migrate.other_reads(others, hostvars))
    assert "where o1 serves it (other)" in out["hosts"]["g5"]["store_problem"]
    assert out["hosts"]["g6"]["purge_by"] == "g5" and out["hosts"]["g6"]["source"]["source"] == "store"


def test_store_others_reads_each_hosts_store_from_hostvars():
    hostvars = HostVars({"g5": host(store="nfs1"), "g6": {"modelswap_store": "nfs1"}, "g7": host(store="nfs1"),
                         "g8": {"modelswap_store": "nfs2"}, "g9": host(), "lb": {}})
    assert migrate.store_others(["g5", "g6", "g7", "g8", "g9", "lb"], hostvars, ["g5", "g7", "g9"]) == ["g6"]
    # a play host missing from the inventory's list still names its store
    assert migrate.store_others(["g6", "g8"], hostvars, ["g5"]) == ["g6"]
    assert migrate.store_others(["g5", "g6"], hostvars, ["g9"]) == []


def test_migrate_plan_and_migrate_record_take_one_mapping():
    inputs = {"target": "tiny-b", "service": {"swapped": True}, "download_rate": "0"}
    plan = migrate.migrate_plan(inputs)
    assert plan == plan_steps.plan_steps(inputs)
    record = {"host": "gpu1", "run_id": "r", "target": "tiny-b", "plan": plan, "service": {"swapped": True},
              "check_mode": False, "lb": None, "prestage": None}
    assert migrate.migrate_record(record) == run_record.run_record(record)
    assert migrate.migrate_record(record)["outcome"] == "migrated"
    with pytest.raises(AnsibleFilterError, match=r"migrate_plan: unknown key\(s\) plan"):
        migrate.migrate_plan(dict(inputs, plan={}))
    with pytest.raises(AnsibleFilterError, match="migrate_plan takes a mapping of target, disk"):
        migrate.migrate_plan("tiny-b")
    with pytest.raises(AnsibleFilterError, match=r"migrate_record: missing key\(s\) check_mode"):
        migrate.migrate_record({k: v for k, v in record.items() if k != "check_mode"})


class Task:
    name = "Start the download"


@pytest.mark.parametrize("task, name", [({"name": "Start the download"}, "Start the download"), (Task(), "Start the download"),
                                        (None, ""), ({}, "")], ids=["dict", "task", "none", "unnamed"])
def test_the_failed_tasks_name_is_read_from_a_dict_or_a_task(task, name):
    assert migrate.failure_of({"fetch": 2.0, "preflight": 1.0}, task, {"msg": "gated"}) == {
        "step": "fetch", "task": name, "msg": "gated"}


def test_hosts_without_a_record_count_as_not_reached():
    hostvars = HostVars({"gpu1": {"migrate_record": {"host": "gpu1"}}, "gpu2": {"ansible_host": "10.0.0.2"}})
    assert migrate.host_records(["gpu1", "gpu2", "gpu9"], hostvars) == [{"host": "gpu1"}, None, None]


def test_the_filters_keep_their_names():
    assert set(migrate.FilterModule().filters()) == {
        "migrate_plan", "migrate_plan_lines", "migrate_read_plan", "migrate_failure", "migrate_fleet",
        "migrate_store_others", "migrate_record", "migrate_host_records", "migrate_preview_diffs",
        "migrate_settled", "migrate_rollout", "migrate_final", "human_bytes"}
    assert migrate.human_bytes(1536) == "1.5 KiB" and migrate.human_bytes(None) == "?"


def test_a_previews_diffs_and_a_runs_settled_hosts_are_read_from_each_hosts_plan():
    unit = {"before_header": "/u", "after_header": "/u", "before": "a", "after": "b"}
    hostvars = HostVars({"gpu1": {"__migrate": {"todo": {"configure": True}, "diffs": [unit], "settled": True}},
                         "gpu2": {"__migrate": {"todo": {"configure": False}, "diffs": [unit]}},
                         "gpu3": {"__migrate": {"failed": True, "msg": "refused"}}, "gpu4": {}})
    hosts = ["gpu1", "gpu2", "gpu3", "gpu4", "gpu9"]
    # only a plan that rewrites the slot's files shows its diffs, each named by its host
    assert migrate.preview_diffs(hosts, hostvars) == [dict(unit, before_header="gpu1: /u", after_header="gpu1: /u")]
    assert migrate.settled(hosts, hostvars) == ["gpu1"]


def test_the_rollout_leaves_the_settled_out_and_keeps_a_groups_nodes_together_in_one_batch():
    plans = {"gpu1": {"todo": {"swap": False}}, "gpu2": {"todo": {"swap": True}},
             "gpu3": {"todo": {"swap": False}, "settled": True}, "gpu4": {"todo": {"swap": True}},
             "gpu5": {"failed": True, "msg": "refused"}}
    hostvars = HostVars({h: {"__migrate": p} for h, p in plans.items()})
    groups = {"pair": {"nodes": ["gpu4", "gpu1"]}}
    out = migrate.rollout(["gpu1", "gpu2", "gpu3", "gpu4", "gpu5"], hostvars, groups, 1)
    # the group where its first node stands, in rank order; a failed host keeps its place (Ansible
    # counts it in its batch)
    assert out["settled"] == ["gpu3"] and out["hosts"] == ["gpu4", "gpu1", "gpu2", "gpu5"]
    assert out["serial"] == [2, 1, 1]
    assert out["groups"] == [{"group": "pair", "nodes": ["gpu4", "gpu1"], "head": "gpu4", "swap": True, "by": ["gpu4"]}]
    assert out["group_swaps"] == {"gpu1": "its replica group pair restarts as one unit (gpu4 must)"}
    with pytest.raises(AnsibleFilterError, match="modelswap_serial: 'two' is not a number"):
        migrate.rollout(["gpu1"], hostvars, groups, "two")


PLAYBOOK = """
- hosts: localhost
  connection: local
  gather_facts: false
  vars:
    modelswap_serve: tiny-b
    migrate_benchmark: true
    migrate_benchmark_concurrency: [1, 4]
    migrate_download_bytes_per_s: 0
    migrate_install_vllm: false
  tasks:
    # what the read, the plan and the steps leave as facts or registered results (hostvars)
    - ansible.builtin.set_fact:
        migrate_run_id: run-1
        __migrate_read:
          disk: {verdict: fits, filesystem: {available_bytes: 4096}, target: {needed_bytes: 1024, download_bytes: 1024}}
          fetch: {commit: %(commit)s, would_fetch: {files: [a], bytes: 1024}}
        __migrate:
          service: {would_swap: true, unit: vllm.service, replaced_model: tiny-a, restart_reasons: [], repairs: []}
          install: {changed: false}
          source: null
          marks: {preflight: 1.0}
    - ansible.builtin.include_role:
        name: modelswap.vllm.migrate
        tasks_from: record.yml
"""


def test_record_yml_calls_the_filters_with_one_mapping(tmp_path):
    """roles/migrate/tasks/record.yml's calls render: the plan and the record of a preview."""
    book = tmp_path / "record.yml"
    book.write_text(PLAYBOOK % {"commit": "c" * 40})
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_STDOUT_CALLBACK="ansible.builtin.json", ANSIBLE_LOCALHOST_WARNING="0",
               ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "--check", "-i", "localhost,",
                           str(book)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = [task["hosts"]["localhost"] for play in json.loads(proc.stdout)["plays"] for task in play["tasks"]]
    facts = next(r["ansible_facts"] for r in results if "migrate_record" in r.get("ansible_facts", {}))
    plan, record = facts["migrate_plan"], facts["migrate_record"]
    steps = {s["step"]: s for s in plan["steps"]}
    assert list(steps) == ["preflight", "purge", "fetch", "swap", "benchmark"]
    assert steps["fetch"]["text"] == "download 1 file(s), 1.0 KiB"
    assert steps["swap"]["text"] == "stop tiny-a (vllm.service), start tiny-b; serving stops until the new model is ready"
    assert record["outcome"] == "preview" and record["host"] == "localhost" and record["run_id"] == "run-1"
    assert record["plan"] == plan and record["check_mode"] is True and list(record["steps"]) == ["preflight"]
