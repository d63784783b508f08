"""The execution environment for AWX/AAP (issue 9): ansible-builder writes a build context from
execution-environment.yml, and the image it describes gets the collection's Python requirements.

No image is built (that needs a container runtime). The test runs `ansible-builder create` on a
copy of the definition next to a freshly built collection tarball, then replays, on this machine,
the build's dependency step: the context's tarball installed into a collections path and the
context's own introspect.py run on it, as the Containerfile's builder stage does. All offline.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from tests.support.modules import REPO

pytestmark = [pytest.mark.unit, pytest.mark.repo]

BIN = Path(sys.executable).parent
TARBALL = "modelswap-vllm.tar.gz"


def run(*argv, cwd=None):
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{argv} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def requirements(path: Path) -> dict[str, Requirement]:
    reqs = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            reqs[req.name.lower().replace("_", "-")] = req
    return reqs


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    """(the build context ansible-builder created, the folder holding the definition)."""
    top = tmp_path_factory.mktemp("ee")
    shutil.copy(REPO / "execution-environment.yml", top / "execution-environment.yml")
    run(BIN / "ansible-galaxy", "collection", "build", "--force", "--output-path", top / "dist", REPO)
    (built,) = (top / "dist").glob("modelswap-vllm-*.tar.gz")
    (top / "build" / "ee").mkdir(parents=True)
    shutil.copy(built, top / "build" / "ee" / TARBALL)
    run(BIN / "ansible-builder", "create", "-f", top / "execution-environment.yml", "--context", top / "context",
        "--output-filename", "Containerfile")
    return top / "context", top


def test_containerfile_installs_python_ansible_and_the_collection(context):
    ctx, _unused = context
    containerfile = (ctx / "Containerfile").read_text()
    definition = yaml.safe_load((REPO / "execution-environment.yml").read_text())
    assert definition["version"] == 3
    assert f'EE_BASE_IMAGE="{definition["images"]["base_image"]["name"]}"' in containerfile
    assert 'PYCMD="/usr/bin/python3.11"' in containerfile
    controller = requirements(REPO / "requirements.txt")
    # ansible-core and ansible-runner as the controller's requirements.txt bounds them
    refs = next(line for line in containerfile.splitlines() if line.startswith("ARG ANSIBLE_INSTALL_REFS="))
    installed = {r.name: r.specifier for r in map(Requirement, refs.split("=", 1)[1].strip('"').split())}
    assert installed == {name: controller[name].specifier for name in ("ansible-core", "ansible-runner")}, refs
    assert "ansible-galaxy collection install $ANSIBLE_GALAXY_CLI_COLLECTION_OPTS -r requirements.yml" in containerfile
    assert "introspect.py introspect" in containerfile and "/output/scripts/assemble" in containerfile


def test_context_carries_the_built_collection(context):
    ctx, _unused = context
    galaxy = yaml.safe_load((ctx / "_build" / "requirements.yml").read_text())
    assert galaxy["collections"] == [{"name": f"/build/collections/{TARBALL}", "type": "file"}]
    # the Containerfile copies _build to /build, so that name is this file in the image
    with tarfile.open(ctx / "_build" / "collections" / TARBALL) as tar:
        manifest = json.load(tar.extractfile("MANIFEST.json"))
        names = set(tar.getnames())
    assert (manifest["collection_info"]["namespace"], manifest["collection_info"]["name"]) == ("modelswap", "vllm")
    assert {"meta/execution-environment.yml", "meta/ee-requirements.txt", "plugins/modules", "plugins/module_utils"} <= names
    assert "openssh-clients [platform:rpm]" in (ctx / "_build" / "bindep.txt").read_text()


def test_image_gets_the_collections_python_requirements(context, tmp_path):
    """The builder stage's step, replayed: introspect the installed collection, as in the image."""
    ctx, _unused = context
    # --force: the repo's own collections path (ansible.cfg) already holds modelswap.vllm
    run(BIN / "ansible-galaxy", "collection", "install", "--offline", "--force", "-p", tmp_path / "collections",
        ctx / "_build" / "collections" / TARBALL)
    assert (tmp_path / "collections" / "ansible_collections" / "modelswap" / "vllm" / "MANIFEST.json").is_file()
    out_pip, out_bindep = tmp_path / "requirements.txt", tmp_path / "bindep.txt"
    run(sys.executable, ctx / "_build" / "scripts" / "introspect.py", "introspect", tmp_path / "collections",
        "--user-bindep", ctx / "_build" / "bindep.txt", "--write-pip", out_pip, "--write-bindep", out_bindep)
    wanted = requirements(REPO / "meta" / "ee-requirements.txt")
    assert wanted, "meta/ee-requirements.txt lists nothing"
    ours = [Requirement(line.split("#")[0]) for line in out_pip.read_text().splitlines()
            if line.endswith("# from collection modelswap.vllm")]
    # exactly meta/ee-requirements.txt (not, say, the controller's requirements.txt at the root)
    assert sorted(map(str, ours)) == sorted(map(str, wanted.values())), out_pip.read_text()
    assert "openssh-clients [platform:rpm]  # from collection user" in out_bindep.read_text().splitlines()


def test_ee_requirements_match_the_controller_requirements():
    """One set of bounds: the EE must not drift from what the controller is tested with."""
    controller = requirements(REPO / "requirements.txt")
    for name, req in requirements(REPO / "meta" / "ee-requirements.txt").items():
        assert name in controller, f"{name} is in meta/ee-requirements.txt but not in requirements.txt"
        assert req.specifier == controller[name].specifier, f"{name}: {req.specifier} != requirements.txt {controller[name].specifier}"
