"""migrate_read and migrate_host_plan (action plugins: the preview's per-host tasks). What they
derive is checked directly; that a refusal comes before the host is reached, and that a refused
plan fails its host with the plan's sentence, through ansible-playbook as the migrate role runs
them (a host nobody answers at: reaching it would say "unreachable" instead)."""
import json
import sys

import pytest

from ansible_collections.modelswap.vllm.plugins.action import migrate_host_plan, migrate_read
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import host_plan
from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner

pytestmark = pytest.mark.unit

LAYOUT = {"read": {"unit": "vllm.service", "replaces": [], "port": 8000, "record_path": "/var/lib/m/d.json",
                   "snapshot_path": "", "cache_dir": "/var/lib/m/hf", "verification": "manifest"},
          "saved_dir": "/var/lib/m/vllm/saved", "saved_files": ["/var/lib/m/vllm/saved/active/unit"],
          "install": {"venv": "/opt/v", "fingerprint": {"version": "0.32.0"}},
          "config_files": ["/etc/systemd/system/vllm.service"], "secret_path": "/etc/m/vllm.secret.env"}


def test_the_read_derives_the_slot_paths_from_the_layout():
    args = migrate_read.read_args({"listing": {"x": 1}, "store": {"target": "a"}}, LAYOUT, "abc", ["/var/lib/m/drained"])
    assert args["listing"] == {"x": 1} and args["store"] == {"target": "a"}
    # an empty snapshot path is left out (vllm_service_info then finds the snapshot itself)
    assert "snapshot_path" not in args["service"] and args["service"]["unit"] == "vllm.service"
    assert args["service"]["paths"] == ["/var/lib/m/vllm/saved/active/unit", "/var/lib/m/drained",
                                        "/var/lib/m/vllm/saved/.staged/for.json"]
    assert args["install"] == {"venv": "/opt/v", "expected": {"version": "0.32.0"}}
    assert args["config"]["secret_sha1"] == "abc" and args["config"]["secret_path"] == "/etc/m/vllm.secret.env"


PROBE = {"host": "10.0.0.1", "port": 8000, "served_model_name": "a", "api_key_file": "/etc/k", "unit": "vllm.service",
         "timeout": 30, "poll_interval": 2, "journal_lines": 40,
         "start": {"timeout": 900, "model_path": "/snap", "parallel_size": "2", "enforce_eager": True}}


def test_a_kept_slot_is_probed_as_vllm_service_verifies_it():
    assert migrate_host_plan.probe_args(PROBE, False) == {k: v for k, v in PROBE.items() if k != "start"}
    # a record naming another deployment: the server may have started moments ago
    started = migrate_host_plan.probe_args(PROBE, True)
    assert started["timeout"] == 900 and started["model_path"] == "/snap" and started["parallel_size"] == 2
    assert started["enforce_eager"] is True
    # no start-up budget set (0): vllm_ready's own default, not the short verify timeout
    assert "timeout" not in migrate_host_plan.probe_args(dict(PROBE, start=dict(PROBE["start"], timeout=0)), True)
    # a replica group's worker is proved through its head's port, which no process of its own holds
    assert migrate_host_plan.probe_args(dict(PROBE, check_port_owner=False), False)["check_port_owner"] is False


def test_every_hosts_diffs_in_one_list_name_their_host():
    diffs = host_plan.fleet_diffs({"gpu1": [{"before_header": "/u", "after_header": "/u", "before": "a", "after": "b"}],
                                   "gpu2": [{"prepared": "key would change"}], "gpu3": []})
    assert diffs == [{"before_header": "gpu1: /u", "after_header": "gpu1: /u", "before": "a", "after": "b"},
                     {"prepared": "gpu2:\nkey would change"}]


PLAY = """
- name: Read and plan
  hosts: ghost
  gather_facts: false
  tasks:
    - name: Read
      modelswap.vllm.migrate_read:
        layout_inputs: {unit: vllm.service, port: 8000, model: "{{ target }}", models: "{{ models }}"}
        lease: {path: /tmp/never/lease.json, state: held, run_id: r1}
        info: {listing: {}, store: {models: "{{ models }}", target: "{{ target }}", keep: []}}
      when: step == 'read'
    - name: Plan
      modelswap.vllm.migrate_host_plan:
        target: "{{ target }}"
        read: {disk: {verdict: does_not_fit, summary: full, reason: "needs 9 GB more"}, service: {}, install: {}}
        expected: {files: {}}
        settings: {host: ghost, purge_allowed: true}
      register: plan
      when: step == 'plan'
"""


def run(tmp_path, step, target):
    (tmp_path / "play.yml").write_text(PLAY)
    # TEST-NET-1 (RFC 5737): nobody answers there
    (tmp_path / "hosts.yml").write_text(json.dumps({"all": {"hosts": {"ghost": {
        "ansible_host": "192.0.2.1", "ansible_ssh_common_args": "-o ConnectTimeout=2",
        "ansible_python_interpreter": sys.executable}}}}))
    models = {"tiny-a": {"repo_id": "lab/tiny-a", "revision": "main"}}
    return runner.run_playbook(str(tmp_path / "play.yml"), str(tmp_path / "hosts.yml"),
                               {"step": step, "target": target, "models": models}, check=True)


def test_an_unknown_target_is_refused_before_the_host_is_reached(tmp_path):
    result = run(tmp_path, "read", "tiny-z")
    assert not result.ok
    failed = result.task_results("Read", "ghost")[0]
    assert failed["_event"] == "runner_on_failed", failed
    assert "unknown model name 'tiny-z' (modelswap_serve)" in failed["msg"] and "lease" not in failed


def test_a_refused_plan_fails_its_host_with_the_plans_sentence(tmp_path):
    result = run(tmp_path, "plan", "tiny-a")
    assert not result.ok
    failed = result.task_results("Plan", "ghost")[0]
    assert failed["_event"] == "runner_on_failed", failed
    assert failed["failure"]["step"] == "preflight" and failed["msg"] == failed["failure"]["msg"]
    assert "needs 9 GB more" in failed["msg"] and "probe" not in failed
