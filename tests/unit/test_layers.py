"""module_utils' packages form layers whose imports point one way (docs/architecture.md: the layers).

A package imports only its own files and the packages below it in LAYERS; an upward import (the
store reading the Hub, the catalog reading the service) fails here with its file and line.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.modules import REPO

pytestmark = pytest.mark.unit

# Lowest first. gpu sits beside serving (neither imports the other); a linear order keeps the
# rule one comparison.
LAYERS = ("common", "store", "hub", "gpu", "serving", "bench", "fleet")
PREFIX = "ansible_collections.modelswap.vllm.plugins.module_utils."
ROOT = REPO / "plugins" / "module_utils"


def imported_packages(source: str):
    """(line, package) for every module_utils import in a file, at any depth (a function's
    lazy import counts too)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
            if node.module + "." == PREFIX:        # from ...module_utils import store
                modules = [PREFIX + alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module.startswith(PREFIX):
                yield node.lineno, module[len(PREFIX):].split(".")[0]


def upward_imports(root: Path) -> list:
    """``file:line: <pkg> imports <higher pkg>`` for every import that points up, and the
    packages missing from LAYERS."""
    found = []
    for path in sorted(root.rglob("*.py")):
        package = path.relative_to(root).parts[0]
        if package not in LAYERS:
            found.append("%s: package %r has no place in LAYERS (add it where its imports allow)"
                         % (path.relative_to(root), package))
            continue
        for line, target in imported_packages(path.read_text()):
            if target not in LAYERS or LAYERS.index(target) > LAYERS.index(package):
                found.append("%s:%d: %s imports %s, a layer above it"
                             % (path.relative_to(root), line, package, target))
    return found


def test_no_module_utils_file_imports_a_layer_above_its_own():
    assert upward_imports(ROOT) == []


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYERS)


@pytest.mark.parametrize("planted, expected", [
    ("from %sserving import vllm_unit\n" % PREFIX, "store/planted.py:1: store imports serving"),
    ("import %shub.hub_client\n" % PREFIX, "store/planted.py:1: store imports hub"),
    ("def f():\n    from %sfleet.peer_plan import plan\n" % PREFIX, "store/planted.py:2: store imports fleet"),
    ("from %s import bench\n" % PREFIX[:-1], "store/planted.py:1: store imports bench"),
])
def test_a_planted_upward_import_is_named_with_its_file_and_line(tmp_path, planted, expected):
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / "store" / "planted.py").write_text(planted)
    (tmp_path / "store" / "fine.py").write_text("from %scommon import units\n" % PREFIX)
    found = upward_imports(tmp_path)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_the_doc_draws_the_same_order():
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert " <- ".join(LAYERS) in doc
