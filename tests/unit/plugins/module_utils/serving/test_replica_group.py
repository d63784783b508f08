"""replica_group: a replica group's refusals, each node's place, flags and environment, and how the
vllm_service settings render a head and a worker from the same catalog entry."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common import vllm_args
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import replica_group as r
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_checks
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_settings as s
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit

pytestmark = pytest.mark.unit

GROUPS = {"pair": {"nodes": ["gpu1", "gpu2"], "distributed_timeout": 120}}
TP2 = {"tensor_parallel_size": 2}


def test_place_of_each_node_and_of_a_host_in_no_group():
    head, worker = r.node(GROUPS, "gpu1"), r.node(GROUPS, "gpu2")
    assert head["rank"] == 0 and not head["headless"] and head["head"] == "gpu1"
    assert worker["rank"] == 1 and worker["headless"] and worker["nnodes"] == 2
    assert worker["master_port"] == r.DEFAULT_MASTER_PORT and worker["distributed_timeout"] == 120
    assert r.node(GROUPS, "gpu3") is None and r.node({}, "gpu1") is None and r.node(None, "gpu1") is None


@pytest.mark.parametrize("groups, words", [
    ([["gpu1", "gpu2"]], "must be a mapping of group name"),
    ({"pair": ["gpu1", "gpu2"]}, "must be a mapping with `nodes"),
    ({"pair": {"nodes": "gpu1,gpu2"}}, "`nodes` must be a list"),
    ({"pair": {"nodes": ["gpu1"]}}, "has 1 node"),
    ({"pair": {"nodes": ["gpu1", "gpu2", "gpu1"]}}, "lists a node twice: gpu1"),
    ({"pair": {"nodes": ["gpu1", "gpu2"], "master_prot": 1}}, "unknown keys master_prot"),
    ({"pair": {"nodes": ["gpu1", "gpu2"], "master_port": 70000}}, "master_port must be a TCP port"),
    ({"pair": {"nodes": ["gpu1", "gpu2"], "distributed_timeout": 0}}, "distributed_timeout must be a positive"),
    ({"a b": {"nodes": ["gpu1", "gpu2"]}}, "is not a usable name"),
    ({"a": {"nodes": ["gpu1", "gpu2"]}, "b": {"nodes": ["gpu2", "gpu3"]}},
     "gpu2 is a node of both 'a' and 'b'"),
])
def test_bad_groups_are_refused_by_name_and_place_nobody(groups, words):
    problems = r.group_problems(groups)
    assert any(words in p for p in problems), problems
    assert all(p.endswith("Nothing was changed.") for p in problems)
    assert r.node(groups, "gpu2") is None


def good(**over):
    base = dict(parallel_sizes=TP2, accelerator="cpu", address="10.0.0.2", master_addr="10.0.0.1",
                inventory_hosts=["gpu1", "gpu2"])
    base.update(over)
    return r.node_problems(GROUPS, "gpu2", **base)


def test_a_node_that_fits_has_no_problem_and_a_host_in_no_group_none():
    assert good() == []
    assert r.node_problems(GROUPS, "gpu3", parallel_sizes={}, address="x") == []


@pytest.mark.parametrize("over, words", [
    ({"parallel_sizes": {}}, "1 x 1 = 1 GPUs cannot be split evenly"),
    ({"parallel_sizes": {"tensor_parallel_size": 3}}, "3 x 1 = 3 GPUs"),
    ({"parallel_sizes": {"tensor_parallel_size": 2, "data_parallel_size": 2}}, "data_parallel_size=2"),
    ({"parallel_sizes": {"pipeline_parallel_size": 2}, "enforce_eager": True}, "dies at the first completion"),
    ({"address": "gpu2.example"}, "vllm_service_node_address of gpu2 is 'gpu2.example', not an IP"),
    ({"master_addr": ""}, "the head's address (gpu1's vllm_service_node_address)"),
    ({"ifname": "eth0; rm"}, "not a network interface name"),
    ({"inventory_hosts": ["gpu2"]}, "names gpu1, not in the inventory"),
])
def test_a_node_that_cannot_serve_its_place_is_refused(over, words):
    problems = good(**over)
    assert any(words in p for p in problems), problems


def test_pipeline_parallel_on_gpus_or_without_eager_is_allowed():
    assert good(parallel_sizes={"pipeline_parallel_size": 2}, enforce_eager=False) == []
    assert good(parallel_sizes={"pipeline_parallel_size": 2}, enforce_eager=True, accelerator="cuda") == []


def test_play_problems_name_the_nodes_left_out():
    assert r.play_problems(GROUPS, "gpu1", ["gpu1", "gpu2", "gpu3"]) == []
    assert r.play_problems(GROUPS, "gpu3", []) == []
    (problem,) = r.play_problems(GROUPS, "gpu1", ["gpu1"])
    assert "whose gpu2 is not in this play" in problem and "Nothing was changed on gpu1" in problem


def test_flags_and_environment_of_head_and_worker():
    head, worker = r.node(GROUPS, "gpu1"), r.node(GROUPS, "gpu2")
    common = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29501",
              "--distributed-timeout-seconds", "120"]
    assert r.serve_flags(head, "10.0.0.1") == common[:2] + ["--node-rank", "0"] + common[2:]
    assert r.serve_flags(worker, "10.0.0.1") == ["--headless"] + common[:2] + ["--node-rank", "1"] + common[2:]
    assert r.serve_flags(None, "x") == [] and r.node_env(None, "x") == {}
    assert r.node_env(worker, "10.0.0.2") == {"VLLM_HOST_IP": "10.0.0.2"}
    assert r.node_env(worker, "10.0.0.2", "host0") == {
        "VLLM_HOST_IP": "10.0.0.2", "GLOO_SOCKET_IFNAME": "host0", "NCCL_SOCKET_IFNAME": "host0"}
    assert r.per_node_parallel(worker, 8) == 4 and r.per_node_parallel(None, 8) == 8


@pytest.mark.parametrize("flag", ["nnodes", "node_rank", "master_addr", "master_port",
                                  "distributed_timeout_seconds", "headless"])
def test_a_catalog_entry_cannot_set_what_the_group_sets(flag):
    with pytest.raises(vllm_args.ArgsError, match="sets --%s" % flag.replace("_", "-")):
        vllm_args.vllm_args_argv({"extra_args": ["--" + flag.replace("_", "-")]})
    with pytest.raises(vllm_args.ArgsError, match="is not allowed"):
        vllm_args.vllm_args_argv({flag: 1})


SNAP = "/var/lib/modelswap/hf/hub/models--lab--tiny/snapshots/" + "a" * 40


def inputs(host, **over):
    base = {
        "action": "deploy", "accelerator": "cpu", "unit": "vllm.service", "port": 8100, "host": "10.0.0.%s" % host[-1],
        "probe_host": "", "inventory_hostname": host, "verification": "full", "replaces": [],
        "cpu_affinity": "", "model": "tiny",
        "models": {"tiny": {"repo_id": "lab/tiny", "vllm_args": dict(TP2, enforce_eager=True)}},
        "snapshot_path": "", "hf_cache": "/var/lib/modelswap/hf/hub", "record_path": "/var/lib/modelswap/deployment.json",
        "api_key": "sk-planted", "require_api_key": True, "guard_routes": True, "open_routes": ["/health"],
        "user": "vllm", "group": "vllm", "home": "/var/lib/vllm", "config_dir": "/etc/modelswap",
        "state_dir": "/var/lib/modelswap", "hardening": {}, "nccl_env": {}, "env": {"VLLM_HOST_IP": "127.0.0.1"},
        "version": "0.32.0", "venv": "", "package": "", "wheelhouse": "", "pip_index_url": "",
        "requirements_file": "", "pip_extra_args": "", "shutdown_timeout": 60, "stop_timeout": 120,
        "replica_groups": GROUPS, "node_address": "10.0.0.%s" % host[-1], "node_ifname": "host0",
        "master_addr": "10.0.0.1", "inventory_hosts": ["gpu1", "gpu2"],
    }
    base.update(over)
    return base


FACTS = {"snapshot": {"path": SNAP, "commit": "a" * 40, "verified": True}}


def test_settings_render_the_head_and_the_worker_of_a_group():
    head = s.derive(inputs("gpu1"), FACTS)
    worker = s.derive(inputs("gpu2"), FACTS)
    # the same model flags on both; the worker headless; the rendezvous at the head's address
    assert head["argv"][-10:] == ["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1",
                                  "--master-port", "29501", "--distributed-timeout-seconds", "120"]
    assert worker["argv"][-11:-10] == ["--headless"] and worker["argv"][-8:-6] == ["--node-rank", "1"]
    assert head["argv"][:-10] == [w.replace("10.0.0.2", "10.0.0.1") for w in worker["argv"][:-11]]
    # each node's own address wins over the operator's VLLM_HOST_IP (the lab's loopback)
    assert head["env"]["VLLM_HOST_IP"] == "10.0.0.1" and worker["env"]["VLLM_HOST_IP"] == "10.0.0.2"
    assert worker["env"]["GLOO_SOCKET_IFNAME"] == "host0"
    # one GPU (here: one CPU process) per node, which the host checks judge
    assert head["target"]["parallel"] == worker["target"]["parallel"] == 1
    assert vllm_service_checks.host_problems(worker["host_checks"], FACTS, {}) == []
    # the worker proves the group through its head
    assert worker["probe"] == "10.0.0.1" and head["probe"] == "10.0.0.1"
    assert worker["replica"]["headless"] and worker["replica"]["master_addr"] == "10.0.0.1"
    assert "inventory_hosts" not in str(worker["host_checks"])
    # the argv reads back as one node's share
    assert vllm_unit.argv_settings(worker["argv"])["parallel"] == 1


def test_settings_refuse_a_group_the_entry_cannot_fill():
    one_gpu = inputs("gpu2", models={"tiny": {"repo_id": "lab/tiny", "vllm_args": {"enforce_eager": True}}})
    problems = s.layout(one_gpu)["problems"]
    assert any("cannot be split evenly" in p for p in problems), problems
    assert s.layout(inputs("gpu2"))["problems"] == []


def test_a_host_in_no_group_renders_as_before():
    alone = s.derive(inputs("gpu1", replica_groups={}, models={"tiny": {"repo_id": "lab/tiny",
                                                                        "vllm_args": {"enforce_eager": True}}}), FACTS)
    assert alone["replica"] is None and "--nnodes" not in alone["argv"] and "--headless" not in alone["argv"]
    assert alone["env"]["VLLM_HOST_IP"] == "127.0.0.1"


def test_rollout_units_keep_a_groups_nodes_together_where_its_first_node_stands():
    groups = {"pair": {"nodes": ["gpu3", "gpu1"]}, "trio": {"nodes": ["gpu5", "gpu6", "gpu7"]}}
    hosts = ["gpu1", "gpu2", "gpu3", "gpu6", "gpu4", "gpu5"]
    # rank order inside a unit; a node out of the hosts (gpu7) is not invented
    assert r.rollout_units(groups, hosts) == [["gpu3", "gpu1"], ["gpu2"], ["gpu5", "gpu6"], ["gpu4"]]
    # refused groups count as none: every host alone (the plan refuses them)
    assert r.rollout_units({"pair": {"nodes": ["gpu1"]}}, ["gpu1", "gpu2"]) == [["gpu1"], ["gpu2"]]
    assert r.rollout_units({}, ["gpu1"]) == [["gpu1"]] and r.rollout_units(None, []) == []


def test_a_node_waits_for_every_other_node_of_its_group_to_reach_the_same_step():
    (why,) = r.behind_problems(GROUPS, "gpu2", {"gpu1": False, "gpu2": True})
    assert why.startswith("modelswap_replica_groups: gpu2 is a node of group 'pair', whose gpu1 did not get this far")
    assert why.endswith("nothing was changed on gpu2.")
    assert r.behind_problems(GROUPS, "gpu2", {"gpu1": True}) == [] and r.behind_problems(GROUPS, "gpu3", {}) == []


def test_places_are_each_hosts_node_with_the_groups_judged_once():
    assert r.places(GROUPS, ["gpu1", "gpu2", "gpu3"]) == {h: r.node(GROUPS, h) for h in ("gpu1", "gpu2", "gpu3")}
    assert r.places({"pair": {"nodes": ["gpu1"]}}, ["gpu1"]) == {"gpu1": None} and r.places(GROUPS, None) == {}
