"""No template reads a key named like a dict method as an attribute (issue 35).

In Jinja, ``x.items`` on a dict is the dict's ``items`` method, not the value under the key
``"items"``: the migration's purge passed ``{{ __migrate_read.purge.items }}`` to model_purge and
every migration that needed a purge failed with "Type 'method' is unsupported". The same trap
waits behind ``keys``, ``values``, ``get``, ``update``, ``pop``, ``copy`` and the other methods of
``dict``. Such a key must be read with brackets (``x['items']``).

The detector parses every Jinja expression of the roles, playbooks and templates with jinja2's
own parser (the templated strings of the YAML files, the bare conditionals of ``when:``,
``that:``, ``changed_when:``, ``failed_when:`` and ``until:``, and the ``.j2`` files) and reports
each attribute read of such a name that is not called (``x.items()`` is a method call, fine).
"""
from __future__ import annotations

from pathlib import Path

import jinja2
import jinja2.nodes
import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DICT_METHODS = frozenset(name for name in dir(dict) if not name.startswith("_"))
# Keys whose value is a bare Jinja expression in Ansible (no braces).
CONDITIONALS = frozenset({"when", "that", "changed_when", "failed_when", "until"})
_ENV = jinja2.Environment(extensions=["jinja2.ext.do", "jinja2.ext.loopcontrols"])


def method_reads(source: str) -> list[str]:
    """The ``x.<dict method>`` reads of a template that are not calls (``x.items`` but not
    ``x.items()``), as the expression's text around them would show: ``<obj>.<name>``."""
    tree = _ENV.parse(source)
    called = {id(call.node) for call in tree.find_all(jinja2.nodes.Call)}
    found = []
    for node in tree.find_all(jinja2.nodes.Getattr):
        if node.attr in DICT_METHODS and id(node) not in called:
            found.append(f"{_describe(node.node)}.{node.attr}")
    return found


def _describe(node) -> str:
    if isinstance(node, jinja2.nodes.Name):
        return node.name
    if isinstance(node, jinja2.nodes.Getattr):
        return f"{_describe(node.node)}.{node.attr}"
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return f"{_describe(node.node)}[{node.arg.value!r}]"
    return "(...)"


def _strings(data, key=None):
    """(key, text) for every string of a loaded YAML document, with the key it stands under."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _strings(v, k)
    elif isinstance(data, list):
        for v in data:
            yield from _strings(v, key)
    elif isinstance(data, str):
        yield key, data


def yaml_findings(path: Path, root: Path) -> list[str]:
    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        for key, text in _strings(doc):
            if key in CONDITIONALS and "{{" not in text:
                text = "{{ (" + text + ") }}"
            elif "{{" not in text and "{%" not in text:
                continue
            out += [f"{path.relative_to(root)}: {read}" for read in method_reads(text)]
    return out


def template_findings(path: Path, root: Path) -> list[str]:
    return [f"{path.relative_to(root)}: {read}" for read in method_reads(path.read_text())]


def repo_findings(root: Path = ROOT) -> list[str]:
    found = []
    for folder in ("roles", "playbooks", "templates", "inventory"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".yml", ".yaml"):
                found += yaml_findings(path, root)
            elif path.suffix == ".j2":
                found += template_findings(path, root)
    return found


@pytest.mark.parametrize("source, expected", [
    ("{{ __migrate_read.purge.items }}", ["__migrate_read.purge.items"]),
    ("{{ result.keys }}", ["result.keys"]),
    ("{{ plan['purge'].values | list }}", ["plan['purge'].values"]),
    ("{{ x.get }}{{ y.update }}{{ z.copy }}", ["x.get", "y.update", "z.copy"]),
    ("{% for k, v in d.items %}{{ k }}{% endfor %}", ["d.items"]),
    # brackets read the key; a call is the method itself, used on purpose
    ("{{ __migrate_read.purge['items'] }}", []),
    ("{{ d.items() | list }}", []),
    ("{{ d.get('x', 1) }}", []),
    ("{{ x | dict2items | map(attribute='key') | list }}", []),
    ("{{ x.purge.item }}", []),
    ("{{ modelswap_models | modelswap.vllm.catalog_entry(t) }}", []),
])
def test_the_detector_flags_method_reads_and_only_them(source, expected):
    assert method_reads(source) == expected


def test_a_planted_key_read_in_a_role_file_is_found(tmp_path):
    role = tmp_path / "roles" / "r" / "tasks"
    role.mkdir(parents=True)
    (role / "main.yml").write_text(
        "- name: Purge\n  some.module:\n    items: \"{{ read.purge.items }}\"\n"
        "- name: Ok\n  some.module:\n    items: \"{{ read.purge['items'] }}\"\n"
        "  when: read.purge.values | length > 0\n")
    (tmp_path / "roles" / "r" / "templates").mkdir()
    (tmp_path / "roles" / "r" / "templates" / "t.j2").write_text("{% for i in x.keys %}{{ i }}{% endfor %}\n")
    assert repo_findings(tmp_path) == ["roles/r/tasks/main.yml: read.purge.items",
                                       "roles/r/tasks/main.yml: read.purge.values",
                                       "roles/r/templates/t.j2: x.keys"]


def test_no_template_of_the_repository_reads_a_dict_method_as_a_key():
    findings = repo_findings()
    assert not findings, ("read these keys with brackets (x['items']): in Jinja x.items is the "
                          "dict's method, not the key:\n" + "\n".join(findings))
