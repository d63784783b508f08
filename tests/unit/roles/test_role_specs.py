"""Every role documents and validates its interface (issue 9, house style rules 15-16).

Per role: meta/argument_specs.yml has a `main` entry point; every variable of defaults/main.yml
has a spec entry with a description and a type; a spec default equals the role default (a
templated role default is rendered with the role's own defaults only, so
`{{ modelswap_x | default('y') }}` is documented as `y` or as the template itself; one that needs
play context is documented as the template or not at all); public variables are `<role>_*` (spec options may also be the fleet-wide `modelswap_*`
inputs), vars/main.yml holds only private `__<role>_*`; the README names every public variable
or refers to the argument specs.
"""
from __future__ import annotations

import re

import pytest
from ansible.errors import AnsibleError
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from tests.support.modules import REPO
from tests.support.role_files import SHARED, load_yaml, role_defaults

pytestmark = pytest.mark.unit

ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir() and p.name != SHARED)
SHARED_PREFIX = "modelswap_"  # fleet-wide inputs every role may take (inventory-wide settings)
NO_DEFAULT = object()


defaults = role_defaults


def main_spec(role):
    specs = load_yaml(REPO / "roles" / role / "meta" / "argument_specs.yml") or {}
    return (specs.get("argument_specs") or {}).get("main")


def options(role):
    return (main_spec(role) or {}).get("options") or {}


def effective_default(role, name):
    """The role default as a caller sees it when it sets nothing (fleet-wide variables unset)."""
    values = defaults(role)
    value = values[name]
    if not isinstance(value, str) or "{{" not in value and "{%" not in value:
        return value
    # what the role sees: the shared owner's defaults (its meta dependency), then its own
    context = {k: trust_as_template(v) if isinstance(v, str) else v for k, v in {**defaults(SHARED), **values}.items()}
    try:
        return Templar(loader=DataLoader(), variables=context).template(trust_as_template(value))
    except AnsibleError:
        return NO_DEFAULT  # needs inventory or play context (hostvars, role_path, ...)


def report(role, problems):
    if problems:
        pytest.fail(f"role {role}:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.mark.parametrize("role", ROLES)
def test_argument_specs_have_main_entry_point(role):
    path = REPO / "roles" / role / "meta" / "argument_specs.yml"
    if not path.is_file():
        report(role, [f"{path.relative_to(REPO)} is missing"])
    spec = main_spec(role)
    if not isinstance(spec, dict):
        report(role, ["meta/argument_specs.yml has no `main` entry point"])
    problems = [f"main.{key} is missing or empty" for key in ("short_description", "options") if not spec.get(key)]
    report(role, problems)


@pytest.mark.parametrize("role", ROLES)
def test_every_default_has_a_described_typed_spec(role):
    opts = options(role)
    problems = []
    for name in defaults(role):
        opt = opts.get(name)
        if opt is None:
            problems.append(f"{name}: in defaults/main.yml but not in meta/argument_specs.yml")
            continue
        description = opt.get("description")
        if not description or (isinstance(description, list) and not any(description)):
            problems.append(f"{name}: argument spec has no description")
        if not opt.get("type"):
            problems.append(f"{name}: argument spec has no type")
    for name, opt in opts.items():
        if name.startswith(f"{role}_") and name not in defaults(role) and not (opt or {}).get("required"):
            problems.append(f"{name}: in the argument spec, neither required nor in defaults/main.yml")
    report(role, problems)


@pytest.mark.parametrize("role", ROLES)
def test_spec_defaults_match_role_defaults(role):
    problems = []
    values = defaults(role)
    for name, opt in options(role).items():
        if not isinstance(opt, dict) or "default" not in opt or name not in values:
            continue
        if opt["default"] == values[name]:
            continue  # the same value, or the same template shown as is
        actual = effective_default(role, name)
        if actual is NO_DEFAULT:
            problems.append(f"{name}: spec default {opt['default']!r} != defaults/main.yml {values[name]!r} "
                            f"(computed from play context)")
        elif opt["default"] != actual:
            problems.append(f"{name}: spec default {opt['default']!r} != defaults/main.yml {actual!r}")
    report(role, problems)


def published_names(readme: str) -> set[str]:
    """The names a README's 'Published without a task' item lists (backquoted)."""
    item = re.search(r"^- Published without a task\b(.*?)(?=^- |^#|^\s*$|\Z)", readme, re.S | re.M)
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", item.group(1))) if item else set()


@pytest.mark.parametrize("role", ROLES)
def test_public_variables_are_prefixed(role):
    problems = [f"defaults/main.yml: {name} is not prefixed {role}_"
                for name in defaults(role) if not name.startswith(f"{role}_")]
    problems += [f"meta/argument_specs.yml: option {name} is neither {role}_* nor {SHARED_PREFIX}*"
                 for name in options(role) if not name.startswith((f"{role}_", SHARED_PREFIX))]
    # vars/main.yml is private, but for a value the role publishes to callers without a task of
    # its own (evaluated per host when read): such a name is {role}_* and its README says so
    private = load_yaml(REPO / "roles" / role / "vars" / "main.yml") or {}
    readme = (REPO / "roles" / role / "README.md").read_text() if (REPO / "roles" / role / "README.md").is_file() else ""
    published = published_names(readme)
    problems += [f"vars/main.yml: {name} is not private (__{role}_*) nor a published value of the README's "
                 f"'Published without a task' list"
                 for name in private if not name.startswith(f"__{role}_")
                 and not (name.startswith(f"{role}_") and name in published)]
    report(role, problems)


@pytest.mark.parametrize("role", ROLES)
def test_readme_documents_the_variables(role):
    path = REPO / "roles" / role / "README.md"
    if not path.is_file():
        report(role, ["README.md is missing"])
    text = path.read_text()
    refers_to_specs = ("meta/argument_specs.yml" in text
                       or re.search(rf"ansible-doc\s+-t\s+role\s+modelswap\.vllm\.{role}\b", text))
    if refers_to_specs:
        return
    missing = [name for name in defaults(role) if not re.search(rf"\b{re.escape(name)}\b", text)]
    report(role, [f"README.md neither refers to meta/argument_specs.yml (or `ansible-doc -t role "
                  f"modelswap.vllm.{role}`) nor mentions: {', '.join(missing)}"] if missing else [])


def test_every_role_depends_on_the_shared_defaults():
    problems = []
    for role in ROLES:
        meta = load_yaml(REPO / "roles" / role / "meta" / "main.yml") or {}
        deps = [d.get("role") if isinstance(d, dict) else d for d in meta.get("dependencies") or []]
        if f"modelswap.vllm.{SHARED}" not in deps:
            problems.append(f"{role}: meta/main.yml does not depend on modelswap.vllm.{SHARED}")
    report(SHARED, problems)


def test_the_shared_defaults_are_documented_and_add_no_task():
    everything = defaults(SHARED)
    # a role's input other roles read too is the role's, described in its own argument specs
    problems = [f"defaults/main.yml: {name} is neither {SHARED_PREFIX}* nor a role's input"
                for name in everything
                if not name.startswith(SHARED_PREFIX) and not any(name in options(role) for role in ROLES)]
    values = {k: v for k, v in everything.items() if k.startswith(SHARED_PREFIX)}
    specs = (load_yaml(REPO / "roles" / SHARED / "meta" / "argument_specs.yml") or {}).get("argument_specs") or {}
    # a `main` entry point would add a validation task to every play of every role
    problems += ["meta/argument_specs.yml has a main entry point"] if "main" in specs else []
    opts = (specs.get("variables") or {}).get("options") or {}
    problems += [f"{name}: not documented in the `variables` entry point" for name in values if name not in opts]
    problems += [f"{name}: spec default {opts[name].get('default')!r} != {values[name]!r}"
                 for name in values if name in opts and opts[name].get("default") != values[name]]
    problems += ["tasks/ exists: the shared defaults run nothing"] if (REPO / "roles" / SHARED / "tasks").exists() else []
    report(SHARED, problems)


SHARED_FILES = ("defaults/main.yml", "vars/main.yml", "tasks/*.yml", "templates/*.j2")


@pytest.mark.parametrize("role", ROLES)
def test_shared_values_are_defined_once(role):
    """The store's paths and the modelswap_* defaults live in the shared owner only: a role writes
    `{{ modelswap_hf_cache }}`, never the path or `modelswap_x | default(...)` again (another
    host's hostvars are the exception: role defaults are not in hostvars)."""
    problems = []
    for pattern in SHARED_FILES:
        for path in sorted((REPO / "roles" / role).glob(pattern)):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                where = f"{path.relative_to(REPO / 'roles' / role)}:{n}"
                if "/var/lib/modelswap" in line and not line.lstrip().startswith("#"):
                    problems.append(f"{where}: names /var/lib/modelswap (use the modelswap_* path)")
                for match in re.finditer(r"(?<![\w.])(modelswap_[a-z_]+)\s*\|\s*default\(", line):
                    problems.append(f"{where}: {match.group(1)} | default(...) repeats the shared default")
    report(role, problems)
