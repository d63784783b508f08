"""Where the results go, and how their paths are printed (issue 15): by default results/ in the
directory ansible-playbook runs from, so a repository that uses the collection keeps its run
records in its own tree; a relative setting is taken from there; every printed or recorded path
is absolute and normalized (no '.../playbooks/../results/...')."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner
from tests.support.modules import REPO

pytestmark = pytest.mark.unit

# A playbook of another repository: the migrate role's start and summary steps on the controller.
SITE = """
- name: Name the run
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Start the run record
      ansible.builtin.import_role:
        name: modelswap.vllm.migrate
        tasks_from: start.yml
    - name: Summarize the run
      ansible.builtin.import_role:
        name: modelswap.vllm.migrate
        tasks_from: summary.yml
"""


@pytest.fixture()
def other_repo(tmp_path):
    repo = tmp_path / "other-infra"
    (repo / "playbooks").mkdir(parents=True)
    (repo / "playbooks" / "site.yml").write_text(SITE)
    (repo / "hosts.yml").write_text(json.dumps({"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    return repo


def no_results_in_this_repository(before):
    assert sorted((REPO / "results" / "runs").glob("*")) == before if (REPO / "results" / "runs").exists() else True


def test_the_runner_writes_to_results_in_the_callers_directory(other_repo, monkeypatch):
    before = sorted((REPO / "results" / "runs").glob("*")) if (REPO / "results" / "runs").exists() else []
    monkeypatch.chdir(other_repo)
    result = runner.run_playbook(str(other_repo / "playbooks" / "site.yml"), "hosts.yml",
                                 {"migrate_hosts_group": "all"})
    assert result.ok, result.stdout[-3000:]
    run_dir = Path(result.custom_stats["modelswap_run_dir"])
    assert run_dir.parent == Path(os.path.realpath(other_repo)) / "results" / "runs"
    assert (run_dir / "summary.md").is_file()
    no_results_in_this_repository(before)


def test_a_relative_results_dir_is_taken_from_the_working_directory_and_printed_normalized(other_repo):
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "hosts.yml",
                           "playbooks/site.yml", "-e", "migrate_hosts_group=all",
                           "-e", "modelswap_results_dir=playbooks/../out"],
                          cwd=other_repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    [run_dir] = (other_repo / "out" / "runs").iterdir()
    assert (run_dir / "summary.md").is_file()
    assert not (other_repo / "playbooks" / "out").exists() and not (other_repo.parent / "out").exists()
    # the run's folder, as it is handed on, is absolute and has no '..'
    stats = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "hosts.yml",
                            "playbooks/site.yml", "-e", "migrate_hosts_group=all",
                            "-e", "modelswap_results_dir=playbooks/../out", "--check", "-v"],
                           cwd=other_repo, env=env, capture_output=True, text=True, timeout=300)
    assert stats.returncode == 0, stats.stdout[-3000:]
    assert "/../" not in stats.stdout
    assert f"{os.path.realpath(other_repo)}/out/runs/" in stats.stdout
