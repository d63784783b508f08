"""The repo builds into an installable collection modelswap.vllm that another repo uses by FQCN
(docs/architecture.md: the collection, here and installed; issue 2 item 1, issue 9)."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.lab.fixtures import REPO
from tests.support.modules import build_collection

pytestmark = pytest.mark.lab
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tarball = build_collection(tmp_path_factory.mktemp("build"))
    colls = tmp_path_factory.mktemp("collections")
    subprocess.run([BIN / "ansible-galaxy", "collection", "install", "--force", "-p", colls, tarball],
                   cwd=tarball.parent, check=True, capture_output=True)
    return tarball, colls / "ansible_collections" / "modelswap" / "vllm"


def test_the_tarball_has_modules_and_helpers_and_no_local_state(installed):
    tarball, _ = installed
    names = tarfile.open(tarball).getnames()
    assert "plugins/modules" in names and "plugins/module_utils" in names
    assert "plugins/modules/modelswap_info.py" in names and "plugins/module_utils/common/about.py" in names
    assert "meta/runtime.yml" in names
    assert not [n for n in names if n.startswith((".venv", ".collections", ".git/", "inventory/lab/hosts"))]


def test_the_installed_collection_has_its_plugins(installed):
    _, root = installed
    assert (root / "plugins" / "modules" / "modelswap_info.py").is_file()
    assert (root / "plugins" / "module_utils" / "common" / "about.py").is_file()
    assert (root / "plugins" / "plugin_utils" / "runner.py").is_file()
    # the load hosts' copy of the /metrics parser: the role's link resolves to module_utils' file
    shipped = root / "roles" / "benchmark" / "files" / "vllm_metrics.py"
    assert shipped.is_file() and shipped.read_text() == (root / "plugins" / "module_utils" / "serving" / "vllm_metrics.py").read_text()


def test_another_repo_runs_the_module_by_fqcn_on_a_lab_host(lab, installed, tmp_path):
    _, root = installed
    other = tmp_path / "other-infra"
    other.mkdir()
    (other / "site.yml").write_text((REPO / "tests/integration/other_repo/site.yml").read_text())
    (other / "ansible.cfg").write_text(
        f"[defaults]\ncollections_path = {root.parents[2]}\nhost_key_checking = True\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(other / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([BIN / "ansible-playbook", "-i", str(lab.inventory), "site.yml"],
                          cwd=other, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "other-repo saw modelswap.vllm 0.1.0; gpus=0; store=" in proc.stdout
    # It ran the installed copy, not this repository's.
    doc = subprocess.run([BIN / "ansible-doc", "-t", "module", "modelswap.vllm.modelswap_info"],
                         cwd=other, env=env, capture_output=True, text=True)
    assert str(root) in doc.stdout and str(REPO / "plugins") not in doc.stdout
