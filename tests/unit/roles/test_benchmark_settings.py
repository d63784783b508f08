"""One name per benchmark setting across the two playbooks that benchmark (issue 15): what an
inventory sets reaches the task that runs the ladder in playbooks/benchmark.yml and in the
migrate role's benchmark step alike, and both put their results under one results folder."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.support.modules import REPO

pytestmark = pytest.mark.unit
RUN_TASK = "Run the ladder (bounded; stops early on errors or SLO breaches)"
HOST = "gpu-a01"


def resolved(inventory, playbook, names):
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"))
    proc = subprocess.run([sys.executable, "-m", "tests.support.task_vars", str(inventory), str(REPO / playbook),
                           HOST, RUN_TASK, ",".join(names)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def example_settings():
    """Every benchmark setting the example inventory makes (group_vars/all/benchmark.yml)."""
    return yaml.safe_load((REPO / "inventory/example/group_vars/all/benchmark.yml").read_text())


def inventory_copy(tmp_path, host_vars):
    inv = tmp_path / "inventory"
    shutil.copytree(REPO / "inventory/example", inv)
    (inv / "host_vars").mkdir()
    (inv / "host_vars" / f"{HOST}.yml").write_text(json.dumps(host_vars))
    return inv


def benchmark_names(settings):
    """The benchmark role's variable for each inventory setting (the ladder's fleet-wide name maps
    to benchmark_concurrency; every other one is the role's own name)."""
    return {"benchmark_concurrency" if k == "modelswap_benchmark_concurrency" else k: v for k, v in settings.items()}


@pytest.mark.repo
def test_the_example_inventory_sets_only_names_both_playbooks_read():
    settings = example_settings()
    assert settings, "the example sets benchmark settings"
    names = benchmark_names(settings)
    for name in names:
        assert name.startswith("benchmark_"), name
    standalone = resolved(REPO / "inventory/example", "playbooks/benchmark.yml", list(names))
    migrate = resolved(REPO / "inventory/example", "playbooks/migrate.yml", list(names))
    assert standalone == migrate == names
    # and they pass the role's own settings check (the master runs on the controller)
    master_on_controller = ("benchmark_load_host == 'localhost' or "
                            "hostvars[benchmark_load_host].ansible_connection | default('') == 'local'")
    assert resolved(REPO / "inventory/example", "playbooks/benchmark.yml", [master_on_controller]) == {
        master_on_controller: True}


@pytest.mark.repo
def test_a_ladder_set_once_in_the_inventory_is_the_one_both_playbooks_run(tmp_path):
    # a ladder that differs from every default: without one name for both playbooks,
    # playbooks/benchmark.yml ran its own default [1, 8, ..., 1024] here
    inv = inventory_copy(tmp_path, {"modelswap_benchmark_concurrency": [2, 16], "benchmark_output_tokens": 64,
                                    "modelswap_results_dir": "site-results"})
    names = ["benchmark_concurrency", "benchmark_output_tokens", "benchmark_measure_s", "__benchmark_results_dir"]
    standalone = resolved(inv, "playbooks/benchmark.yml", names)
    migrate = resolved(inv, "playbooks/migrate.yml", names)
    assert standalone == migrate
    assert standalone["benchmark_concurrency"] == [2, 16]
    assert standalone["benchmark_output_tokens"] == 64
    assert standalone["benchmark_measure_s"] == example_settings()["benchmark_measure_s"]
    # relative to the directory ansible-playbook runs in (here the repository), normalized
    assert standalone["__benchmark_results_dir"] == os.path.join(os.path.realpath(REPO), "site-results", "benchmark")


@pytest.mark.repo
def test_results_default_to_the_working_directory_for_both_roles(tmp_path):
    inv = inventory_copy(tmp_path, {})
    bench = resolved(inv, "playbooks/migrate.yml", ["__benchmark_results_dir", "__migrate_results_dir"])
    root = os.path.realpath(REPO)
    assert bench == {"__benchmark_results_dir": os.path.join(root, "results", "benchmark"),
                     "__migrate_results_dir": os.path.join(root, "results", "runs")}
