"""docs/architecture.md stays true to the code: it names every module, module_utils file and role.

A file added under library/, module_utils/ or roles/ without a line in the architecture fails
here, with the names to add; a name the document lists that no longer exists fails too.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# Option values the step table quotes beside module names ("unless the accelerator is `cpu`").
VALUES = {"cpu"}


def _section(text: str, title: str) -> str:
    """The body of the `## title` section."""
    match = re.search(r"^## " + re.escape(title) + r"\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/architecture.md has no section '## {title}'"
    return match.group(1)


def test_every_module_is_in_the_modules_table():
    table = _section(DOC.read_text(), "The modules")
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.M))
    modules = {p.stem for p in (ROOT / "plugins" / "modules").glob("*.py") if not p.name.startswith("_")}
    assert listed == modules, {"missing from the doc": sorted(modules - listed),
                               "no longer a module": sorted(listed - modules)}


def _module_utils_files() -> set[str]:
    """module_utils' files as `package/file.py`: every file lives in a domain package."""
    return {str(p.relative_to(ROOT / "plugins" / "module_utils")) for p in (ROOT / "plugins" / "module_utils").rglob("*.py")
            if p.name != "__init__.py"}


def _packages() -> set[str]:
    return {p.name for p in (ROOT / "plugins" / "module_utils").iterdir() if (p / "__init__.py").is_file()}


def test_module_utils_holds_only_packages():
    loose = sorted(p.name for p in (ROOT / "plugins" / "module_utils").glob("*.py"))
    assert loose == [], "module_utils/ keeps its files in domain packages; move: %s" % loose
    assert all("/" in f and f.count("/") == 1 for f in _module_utils_files())


def test_every_module_utils_file_has_its_line():
    section = _section(DOC.read_text(), "module_utils, by domain")
    listed = set(re.findall(r"^- `([a-z_]+/[a-z_]+\.py)`:", section, re.M))
    files = _module_utils_files()
    assert listed == files, {"missing from the doc": sorted(files - listed),
                             "no longer in module_utils": sorted(listed - files)}
    headed = set(re.findall(r"^`([a-z_]+)/`: ", section, re.M))
    assert headed == _packages(), "each package gets its one-line heading in the section"


def test_the_readme_layout_names_every_package_once():
    layout = _section((ROOT / "README.md").read_text(), "Layout")
    named = re.findall(r"^  ([a-z_]+)/ ", layout, re.M)
    assert sorted(named) == sorted(_packages()), named


def test_the_readme_step_table_finds_module_package_and_role():
    layout = _section((ROOT / "README.md").read_text(), "Layout")
    rows = [line for line in layout.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(rows) >= 5, "the step table lost rows"
    modules = {p.stem for p in (ROOT / "plugins" / "modules").glob("*.py")}
    roles = {p.parent.parent.name for p in (ROOT / "roles").glob("*/tasks/main.yml")}
    for row in rows:
        _num, _step, mods, packages, role = [c.strip() for c in row.strip("|").split("|")]
        assert re.findall(r"`([a-z_]+)`", mods), row
        for name in re.findall(r"`([a-z_]+)`", mods):
            assert name in modules, (row, name)
        for name in re.findall(r"`plugins/module_utils/([a-z_]+)/`", packages):
            assert name in _packages(), (row, name)
        assert re.findall(r"`plugins/module_utils/([a-z_]+)/`", packages), row
        assert re.findall(r"`([a-z_]+)`", role)[0] in roles, row


def test_every_role_is_named_and_linked():
    section = _section(DOC.read_text(), "The roles")
    linked = set(re.findall(r"\]\(\.\./roles/([a-z_]+)/README\.md\)", section))
    roles = {p.parent.parent.name for p in (ROOT / "roles").glob("*/tasks/main.yml")}
    assert linked == roles, {"missing from the doc": sorted(roles - linked),
                             "no longer a role": sorted(linked - roles)}


def test_the_step_table_names_only_real_modules_and_files():
    section = _section(DOC.read_text(), "The migration, step by step")
    rows = [line for line in section.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(rows) >= 6, "the step table lost rows"
    modules = {p.stem for p in (ROOT / "plugins" / "modules").glob("*.py")}
    files = _module_utils_files() | {p.name for p in (ROOT / "plugins" / "filter").glob("*.py")}
    roles = {p.parent.parent.name for p in (ROOT / "roles").glob("*/tasks/main.yml")}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        _num, _what, mods, logic, role = cells
        for name in re.findall(r"`([a-z_]+)`", mods):
            assert name in modules or name in VALUES, (row, name)
        for name in re.findall(r"`(?!files/)(?:plugins/filter/)?([a-z_/]+\.py)`", logic):
            assert name in files, (row, name)
        assert re.findall(r"`([a-z_]+)`", role)[0] in roles, row
