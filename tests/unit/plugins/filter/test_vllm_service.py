"""The vllm_service role's refusals as one judge (plugins/module_utils/serving/vllm_service_checks.py):
the role's validate step and the migration's preview call it, so they refuse the same requests
with the same sentence. Table-driven: each row changes one setting of a good deployment."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.filter.vllm_service import FilterModule
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_checks as checks

pytestmark = pytest.mark.unit

MODELS = {"tiny-a": {"repo_id": "lab/tiny-a", "revision": "a" * 40, "vllm_args": {"dtype": "float32"}},
          "tiny-tp2": {"repo_id": "lab/tiny-a", "vllm_args": {"tensor_parallel_size": 2}},
          "bad": {"repo_id": "lab/../x"}}
GOOD = {"action": "deploy", "accelerator": "auto", "unit": "vllm.service", "port": 8000, "verification": "full",
        "replaces": [], "cpu_affinity": "", "model": "tiny-a", "models": MODELS, "api_key": "k" * 32,
        "require_api_key": True, "host": "gpu1",
        "render": {"unit": "vllm.service", "replaces": [], "user": "vllm", "group": "vllm", "home": "/var/lib/vllm",
                   "config_dir": "/etc/modelswap", "host": "0.0.0.0", "hardening": {"NoNewPrivileges": "yes"},
                   "env": {"NCCL_DEBUG": "WARN"}, "guard": False}}


def with_(**changes):
    return dict(GOOD, **changes)


@pytest.mark.parametrize("settings, first", [
    (with_(action="upgrade"), "vllm_service: invalid settings - vllm_service_action must be deploy, rollback or "
                              "install (got upgrade)"),
    (with_(port=0), "vllm_service_port 1..65535 (got 0)"),
    (with_(port="x"), "vllm_service_port 1..65535 (got x)"),
    (with_(unit="vllm"), 'vllm_service_unit a *.service name (got "vllm")'),
    (with_(replaces=["vllm.service"]), 'other than the slot\'s own (got ["vllm.service"])'),
    (with_(replaces="old.service"), 'got "old.service"'),
    (with_(render=dict(GOOD["render"], user="Root User")),
     "vllm_service: refusing to render \"vllm.service\" on gpu1: vllm_service_user 'Root User' is not an account name"),
    (with_(cpu_affinity="0;1"), 'vllm_service_cpu_affinity must be a CPU list such as 0, 0-3 or 0,2-3 (got "0;1")'),
    (with_(model="tiny-zzz"), "vllm_service: refusing to deploy 'tiny-zzz': it is not in the model catalog "
                              "(vllm_service_models / modelswap_models has bad, tiny-a, tiny-tp2)."),
    (with_(model="bad"), "vllm_service: catalog entry 'bad' is invalid: "),
    (with_(api_key=""), "vllm_service: vllm_service_api_key is empty; vLLM would serve without authentication."),
    (with_(api_key='a"b'), "vllm_service_api_key is not usable (it contains a quote, backslash or newline)"),
], ids=["action", "port-0", "port-text", "unit", "replaces-self", "replaces-string", "render", "affinity",
        "not-in-catalog", "bad-entry", "no-key", "bad-key"])
def test_a_bad_setting_is_refused_with_the_roles_sentence(settings, first):
    problems = checks.settings_problems(settings)
    assert problems and problems[0].startswith(first) or first in problems[0], problems
    assert "k" * 32 not in " ".join(problems)


def test_a_good_deployment_and_the_exceptions_pass():
    assert checks.settings_problems(GOOD) == []
    assert checks.settings_problems(with_(api_key="", require_api_key=False)) == []
    assert checks.settings_problems(with_(cpu_affinity="0,2-3")) == []
    # rollback and install need no catalog entry and no key
    assert checks.settings_problems(with_(action="rollback", model="", api_key="")) == []
    assert checks.settings_problems(with_(action="install", model="tiny-zzz")) == []


def test_the_first_problem_is_the_one_the_role_checks_first():
    problems = checks.settings_problems(with_(cpu_affinity="x", api_key=""))
    assert [p.split(":")[1].strip().split()[0] for p in problems] == ["vllm_service_cpu_affinity", "vllm_service_api_key"]


VERIFIED = {"snapshot": {"verified": True}, "port": {"foreign": []}}
NOT_FETCHED = {"snapshot": {"verified": False, "reason": "tiny-a (lab/tiny-a@aaaa) is not on this host"},
               "port": {"foreign": []}}
HELD = {"snapshot": {"verified": True}, "port": {"foreign": [{"text": "pid 9, user root: python3 -m http.server"}]}}
EIGHT_GPUS = {"gpus": [{"index": i} for i in range(8)], "nvml": {"available": True}}
NO_GPU = {"gpus": [], "nvml": {"available": False, "reason": "NVML not available: no NVIDIA driver"}}


@pytest.mark.parametrize("changes, facts, gpus, allow, expected", [
    ({"accel": "cuda", "parallel": 8}, VERIFIED, EIGHT_GPUS, False, []),
    ({"accel": "cuda", "parallel": 16}, VERIFIED, EIGHT_GPUS, False,
     ["vllm_service: refusing to deploy 'tiny-a' on gpu1: its vllm_args need 16 GPUs (tensor x pipeline x data "
      "parallel) and the host has 8. Lower the parallel sizes or deploy it on a larger host; nothing was changed."]),
    ({"accel": "cpu", "parallel": 2}, VERIFIED, NO_GPU, False,
     ["vllm_service: refusing to deploy 'tiny-a' on gpu1: the host has no NVIDIA GPU (NVML not available: no NVIDIA "
      "driver), so it serves on CPU, and its vllm_args ask for 2-way parallelism (tensor x pipeline x data). This "
      "role serves CPU models as one process: set the parallel sizes to 1 or deploy the model on a GPU host; "
      "nothing was changed."]),
    ({"accel": "cpu", "parallel": 1}, NOT_FETCHED, {}, False,
     ["vllm_service: refusing to deploy 'tiny-a' on gpu1: tiny-a (lab/tiny-a@aaaa) is not on this host. "
      "Nothing was changed."]),
    ({"accel": "cpu", "parallel": 1}, NOT_FETCHED, {}, True, []),      # a download comes first
    ({"accel": "cpu", "parallel": 1}, HELD, {}, False,
     ["vllm_service: refusing to deploy on gpu1:8000: the port is held by a process outside vllm.service (pid 9, "
      "user root: python3 -m http.server). Stop it, choose another vllm_service_port, or, when it is a vLLM server "
      "set up by hand that this slot takes over, name its unit in vllm_service_replaces (it is stopped and "
      "disabled at the swap); nothing was changed."]),
    ({"accel": "cpu", "parallel": 1, "action": "rollback"}, NOT_FETCHED, {}, False, []),
], ids=["enough-gpus", "too-few-gpus", "cpu-parallel", "not-fetched", "not-fetched-before-download",
        "port-held", "rollback-skips"])
def test_host_problems(changes, facts, gpus, allow, expected):
    assert checks.host_problems(dict(GOOD, **changes), facts, gpus, allow_unfetched=allow) == expected


def test_the_filters_are_the_functions():
    filters = FilterModule().filters()
    assert filters["vllm_service_problems"](with_(api_key="")) == checks.settings_problems(with_(api_key=""))
    settings = dict(GOOD, accel="cpu", parallel=1)
    assert filters["vllm_service_host_problems"](settings, NOT_FETCHED) == checks.host_problems(settings, NOT_FETCHED, {})
    assert filters["vllm_service_host_problems"](settings, NOT_FETCHED, None, True) == []


def test_replica_behind_problems_reads_each_nodes_step_of_this_run_from_hostvars():
    """Unset, or not one of the wanted values, is behind (the module_utils half is tested beside replica_group)."""
    behind = FilterModule().filters()["replica_behind_problems"]
    groups = {"pair": {"nodes": ["gpu1", "gpu2"], "distributed_timeout": 120}}
    hostvars = {"gpu1": {"step": "checked"}, "gpu2": {"step": "drained"}}
    assert behind(groups, "gpu2", hostvars, "step", ["drained"])[0].count("whose gpu1 ") == 1
    assert behind(groups, "gpu1", hostvars, "step", ["checked", "drained"]) == []
    assert behind(groups, "gpu1", {"gpu1": {"step": 1}}, "step") != []
    assert behind(groups, "gpu1", {"gpu1": {"x": 1}, "gpu2": {"step": False}}, "step") == []
