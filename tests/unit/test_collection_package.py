"""The collection as `ansible-galaxy collection build` gives it to a reviewer, AWX or another repo
(docs/architecture.md: the collection, here and installed): real folders, declared dependencies,
what is tested claimed, and none of the developer's lab."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import ansible
import pytest
import yaml

from tests.support.modules import REPO, build_collection

pytestmark = [pytest.mark.unit, pytest.mark.repo]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tarball(tmp_path_factory):
    return build_collection(tmp_path_factory.mktemp("build"))


def test_no_folder_ships_as_a_link_and_every_file_link_stays_inside(tarball):
    members = tarfile.open(tarball).getmembers()
    folders = {m.name for m in members if m.isdir()}
    assert {"plugins/modules", "plugins/module_utils", "plugins/module_utils/store"} <= folders
    for member in members:
        if member.issym() or member.islnk():
            target = (Path("/c") / member.name).parent / member.linkname
            assert str(target.resolve()).startswith("/c/"), (member.name, member.linkname)
            assert not (REPO / member.name).is_dir(), "a folder ships as a link: %s" % member.name


def test_the_lab_benches_and_top_level_links_stay_out(tarball):
    names = tarfile.open(tarball).getnames()
    top = {n.split("/")[0] for n in names}
    assert not top & {"library", "module_utils", "inventory", "Makefile", ".collections", ".venv", "build", ".ci"}
    assert not [n for n in names if n.startswith(("tests/lab", "tests/bench", "tests/integration", "tests/gpu"))]
    assert "tests/unit/test_layers.py" in names and "changelogs/changelog.yaml" in names


def test_dependencies_and_the_tested_ansible_are_declared(tarball):
    with tarfile.open(tarball) as tar:
        manifest = json.load(tar.extractfile("MANIFEST.json"))
        runtime = yaml.safe_load(tar.extractfile("meta/runtime.yml"))
    deps = manifest["collection_info"]["dependencies"]
    assert set(deps) == {"community.general"}, "lb_pool calls community.general.haproxy; nothing else is used"
    assert deps["community.general"].startswith(">=") and "<" in deps["community.general"]
    used = set()
    for path in list((REPO / "roles").rglob("*.yml")) + list((REPO / "playbooks").rglob("*.yml")):
        used |= {w.split(".")[0] + "." + w.split(".")[1] for w in path.read_text().split()
                 if w.rstrip(":").count(".") == 2 and w.startswith(("community.", "ansible.posix"))}
    assert used <= {"community.general"}, used
    assert runtime["requires_ansible"] == ">=2.19.0"
    assert ansible.__version__.startswith("2.19."), "the tested ansible-core moved: update meta/runtime.yml"


def test_an_install_resolves_community_general_from_the_declared_dependency(tarball, tmp_path):
    # Offline, the dependency resolves to the community.general the controller has (the `ansible`
    # package of requirements.txt); an execution environment's build resolves it the same way.
    env = {"PATH": str(BIN) + ":/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([BIN / "ansible-galaxy", "collection", "install", "--offline", "-p", tmp_path / "c", tarball],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "'community.general:11." in proc.stdout and "already installed" in proc.stdout, proc.stdout
    assert (tmp_path / "c" / "ansible_collections" / "modelswap" / "vllm" / "plugins" / "modules" / "disk_plan.py").is_file()


def test_the_changelog_is_generated_from_fragments_without_issue_numbers():
    config = yaml.safe_load((REPO / "changelogs" / "config.yaml").read_text())
    assert config["output"] == [{"file": "CHANGELOG.md", "format": "md"}]
    changes = yaml.safe_load((REPO / "changelogs" / "changelog.yaml").read_text())
    texts = [(REPO / "CHANGELOG.md").read_text(), json.dumps(changes)]
    texts += [p.read_text() for p in (REPO / "changelogs" / "fragments").glob("*.y*ml")]
    for text in texts:
        assert not re.search(r"(?i)\bissue \d+", text)
