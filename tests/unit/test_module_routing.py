"""The modules that return information are named *_info (vllm_service_info, migrate_info); the old
names (vllm_service_facts, migrate_facts) keep working through meta/runtime.yml's plugin_routing,
with a deprecation warning that names the new module. Run through ansible-playbook on localhost
(connection local), against the collection as ANSIBLE_COLLECTIONS_PATH finds it, with a unit that
does not exist and paths in a temporary folder: no lab, nothing changed."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.modules import COLLECTIONS

pytestmark = pytest.mark.unit

COLLECTION = COLLECTIONS / "ansible_collections" / "modelswap" / "vllm"
RENAMED = {"vllm_service_facts": "vllm_service_info", "migrate_facts": "migrate_info"}
UNIT = "modelswap-routing-test-absent.service"
COMMIT = "5adf7ab29f6060a97a9982849ec851bb2442f6f2"
CONFIG = b'{"architectures": ["LlamaForCausalLM"]}'

SERVICE_ARGS = """
        unit: "{{ unit }}"
        record_path: "{{ scratch }}/deployment.json"
        cache_dir: "{{ scratch }}/hub"
        paths: ["{{ scratch }}/deployment.json", "{{ scratch }}"]
"""
MIGRATE_ARGS = """
        listing: "{{ listing }}"
        service: {unit: "{{ unit }}", record_path: "{{ scratch }}/deployment.json", cache_dir: "{{ scratch }}/hub"}
        install: {venv: "{{ scratch }}/venv", expected: {version: 0.32.0}}
        store:
          cache_dir: "{{ scratch }}/hub"
          models: {tiny: {repo_id: lab/tiny, revision: "{{ listing.commit }}"}}
          target: tiny
          deployment_record: "{{ scratch }}/deployment.json"
          vllm_unit: "{{ unit }}"
          headroom: "0"
"""
PLAY = """
- name: The old module names route to the _info modules
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Read the slot by the old name
      modelswap.vllm.vllm_service_facts:%(service)s      register: old_service

    - name: Read the slot by the new name
      modelswap.vllm.vllm_service_info:%(service)s      register: new_service

    - name: Read the host for a migration by the old name
      modelswap.vllm.migrate_facts:%(migrate)s      register: old_migrate

    - name: Read the host for a migration by the new name
      modelswap.vllm.migrate_info:%(migrate)s      register: new_migrate

    - name: Both names ran the same module and read the same host
      ansible.builtin.assert:
        that:
          - old_service is not failed and old_service is not changed
          - new_service is not failed and new_service is not changed
          - old_service.record is none and old_service.deployment is none
          - not old_service.unit.loaded and old_service.unit.active_state == new_service.unit.active_state
          - old_service.files == new_service.files
          - old_service.files[scratch] and not old_service.files[scratch ~ '/deployment.json']
          - old_migrate is not failed and old_migrate is not changed
          - new_migrate is not failed and new_migrate is not changed
          - old_migrate.fetch.commit == listing.commit and new_migrate.fetch.commit == listing.commit
          - old_migrate.fetch.would_fetch.bytes == new_migrate.fetch.would_fetch.bytes
          - old_migrate.fetch.would_fetch.bytes == config_bytes
          - old_migrate.disk.verdict == new_migrate.disk.verdict
          - old_migrate.install.matches is false and old_migrate.service.unit.loaded is false
""" % {"service": SERVICE_ARGS, "migrate": MIGRATE_ARGS}


def run_play(tmp_path: Path) -> subprocess.CompletedProcess:
    scratch = tmp_path / "host"
    (scratch / "hub").mkdir(parents=True)
    listing = {"commit": COMMIT, "files": {"config.json": {
        "size": len(CONFIG), "blob_id": hashlib.sha1(b"blob %d\0" % len(CONFIG) + CONFIG).hexdigest()}}}
    (tmp_path / "play.yml").write_text(PLAY)
    (tmp_path / "hosts.yml").write_text(json.dumps({"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    (tmp_path / "ansible.cfg").write_text("[defaults]\n")     # none of the repository's settings
    env = dict(os.environ, ANSIBLE_CONFIG=str(tmp_path / "ansible.cfg"), ANSIBLE_COLLECTIONS_PATH=str(COLLECTIONS),
               ANSIBLE_DEPRECATION_WARNINGS="1", ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
               ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default", ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"),
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    extra = {"scratch": str(scratch), "unit": UNIT, "listing": listing, "config_bytes": len(CONFIG)}
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"),
                           str(tmp_path / "play.yml"), "-e", json.dumps(extra)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert sorted(p.name for p in scratch.iterdir()) == ["hub"], "a read-only module wrote on the host"
    return proc


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    return run_play(tmp_path_factory.mktemp("routing"))


def test_old_and_new_names_run_the_same_modules(played):
    out = played.stdout + played.stderr
    assert played.returncode == 0, out[-6000:]
    assert re.search(r"localhost\s*: ok=5 +changed=0 +unreachable=0 +failed=0", played.stdout), played.stdout[-3000:]


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_the_old_name_warns_and_names_the_new_module(played, old, new):
    text = " ".join((played.stdout + played.stderr).split())
    warnings = re.findall(r"\[DEPRECATION WARNING\]: (.*?)(?=\[|$)", text)
    mine = [w for w in warnings if f"modelswap.vllm.{old}" in w]
    assert mine, text[-4000:]
    assert all(f"modelswap.vllm.{new}" in w and "2.0.0" in w for w in mine), mine
    assert not [w for w in warnings if f"modelswap.vllm.{new} has been deprecated" in w], warnings


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_the_routing_entry_redirects_with_a_deprecation(old, new):
    runtime = yaml.safe_load((COLLECTION / "meta" / "runtime.yml").read_text())
    entry = runtime["plugin_routing"]["modules"][old]
    assert entry["redirect"] == f"modelswap.vllm.{new}"
    assert entry["deprecation"]["removal_version"] == "2.0.0"
    assert f"modelswap.vllm.{new}" in entry["deprecation"]["warning_text"]
    modules = COLLECTION / "plugins" / "modules"
    assert (modules / f"{new}.py").is_file() and not (modules / f"{old}.py").exists()
