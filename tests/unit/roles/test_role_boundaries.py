"""Roles talk through their interfaces only: no role reads or sets another role's private
`__<role>_*` variables or renders another role's templates and files; it calls the other role's
documented entry points (include_role/import_role tasks_from) and reads what they publish
(vllm_service_layout, vllm_service_expected, lb_pool_result, ...)."""
from __future__ import annotations

import re

import pytest

from tests.support.modules import REPO
from tests.support.role_files import SHARED, load_yaml

pytestmark = pytest.mark.unit

ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir())
TEXT_FILES = ("**/*.yml", "**/*.yaml", "**/*.j2")
# where a role uses variables (its argument specs and README only describe them)
CODE_FILES = ("defaults/*.yml", "vars/*.yml", "tasks/*.yml", "templates/*.j2", "handlers/*.yml")


def inputs(role: str) -> set[str]:
    """The role's documented inputs: the options of every entry point of its argument specs."""
    specs = (load_yaml(REPO / "roles" / role / "meta" / "argument_specs.yml") or {}).get("argument_specs") or {}
    return {name for entry in specs.values() for name in (entry.get("options") or {})}


def inputs_read(text: str, names: set[str]) -> list[str]:
    """The names of `names` that a line reads: not a key it sets (`name:`, a parameter passed to
    an entry point) nor a command-line example (`-e name=value`)."""
    return [m.group(1) for m in re.finditer(r"(?<![\w.])([a-z][a-z0-9_]*)\b(?!\s*[:=])", text) if m.group(1) in names]


def crossings(role: str, text: str) -> list[str]:
    """What a role's file `text` reaches into elsewhere: another role's private variable, or a
    path to another role's folder (role_path | dirname, or roles/<other>/)."""
    found = []
    for other in ROLES:
        if other == role:
            continue
        for match in re.finditer(rf"(?<![\w]){re.escape('__' + other)}(?:_\w+|(?!\w))", text):
            found.append(f"reads {match.group(0)}, private to {other}")
        if re.search(rf"(role_path\s*\|\s*dirname\s*\)?\s*~?\s*['\"]?/{re.escape(other)}\b|roles/{re.escape(other)}/)", text):
            found.append(f"reaches into roles/{other}/ (its templates or files)")
    # role_path | dirname is the roles folder: a path from there is another role's (the
    # collection's own templates/ are role_path | dirname | dirname)
    for match in re.finditer(r"role_path\s*\|\s*dirname(?!\s*\|\s*dirname)", text):
        found.append(f"uses {match.group(0)!r}: the roles folder, a way into another role")
    return found


@pytest.mark.parametrize("role", ROLES)
def test_no_role_reaches_into_another(role):
    problems = []
    for pattern in TEXT_FILES:
        for path in sorted((REPO / "roles" / role).glob(pattern)):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.lstrip().startswith("#"):
                    continue
                problems += [f"roles/{role}/{path.relative_to(REPO / 'roles' / role)}:{n}: {what}"
                             for what in crossings(role, line)]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.parametrize("text, found", [
    ("x: \"{{ __vllm_service_saved_dir }}\"", "private to vllm_service"),
    ("  register: __vllm_service_gpus_venv", "private to vllm_service"),
    ("x: \"{{ __vllm_service.target.port }}\"", "private to vllm_service"),
    ("t: \"{{ role_path | dirname }}/vllm_service/templates\"", "the roles folder"),
    ("src: roles/vllm_service/templates/vllm.service.j2", "reaches into roles/vllm_service/"),
])
def test_the_check_catches_a_crossing(text, found):
    assert any(found in what for what in crossings("migrate", text)), crossings("migrate", text)


def test_the_check_lets_a_role_use_its_own_and_public_names():
    assert not crossings("vllm_service", "x: \"{{ __vllm_service_saved_dir }}\"")
    assert not crossings("migrate", "x: \"{{ vllm_service_layout.saved_dir }} {{ lb_pool_result.line }}\"")
    assert not crossings("migrate", "src: \"{{ role_path | dirname | dirname }}/templates/run_summary.md.j2\"")


def test_the_stats_page_is_read_in_one_place():
    """HAProxy's stats page is read by one task (lb_pool's haproxy_read.yml): the pool, the drain's
    and the rejoin's waits import it, the migration's plan and the fleet table ask lb_pool's pool
    entry point."""
    readers = []
    for path in sorted((REPO / "roles").glob("*/tasks/*.yml")):
        text = path.read_text()
        readers += [f"{path.relative_to(REPO)}" for _unused in re.finditer(r"url:\s*\"\{\{\s*\w*stats_url\b", text)]
    assert readers == ["roles/lb_pool/tasks/haproxy_read.yml"], readers


def test_the_store_path_is_defined_once():
    """The model store's path is written once, in the shared defaults; every other mention in the
    roles' defaults, vars, tasks and templates goes through modelswap_hf_cache."""
    places = []
    for path in sorted((REPO / "roles").glob("*/*/*.y*ml")) + sorted((REPO / "roles").glob("*/templates/*.j2")):
        if "/meta/" in str(path) or path.name.endswith(".md"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.lstrip().startswith("#") and re.search(r"hf/hub|/var/lib/modelswap", line):
                places.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert [line for line in places if "modelswap_hf_cache:" in line], places
    assert all(line.startswith("roles/modelswap_defaults/defaults/main.yml:") for line in places), places


def test_an_input_other_roles_read_is_defined_once_where_every_role_sees_it():
    """A role's input that another role reads (the migration's preflight, model_purge and model_fetch
    settings, fleet_status's vllm_service_port) is defined in the shared defaults, which every role
    depends on: in the owning role's own defaults it would be undefined wherever that role is not
    loaded, and the reader would repeat it as `| default(...)` or import the role for nothing."""
    shared = load_yaml(REPO / "roles" / SHARED / "defaults" / "main.yml") or {}
    problems = []
    for owner in ROLES:
        names = {name for name in inputs(owner) if name.startswith(f"{owner}_")}
        own = load_yaml(REPO / "roles" / owner / "defaults" / "main.yml") or {}
        for reader in ROLES:
            if reader in (owner, SHARED):
                continue
            for pattern in CODE_FILES:
                for path in sorted((REPO / "roles" / reader).glob(pattern)):
                    for n, line in enumerate(path.read_text().splitlines(), 1):
                        if line.lstrip().startswith("#"):
                            continue
                        where = f"roles/{reader}/{path.relative_to(REPO / 'roles' / reader)}:{n}"
                        problems += [f"{where}: {why}" for why in misplaced(line, owner, names, own, shared)]
    assert not problems, "\n".join(problems)


def misplaced(line: str, owner: str, names: set[str], own: dict, shared: dict) -> list[str]:
    """Why a reader's `line` reads an input of `owner` that is not where every role sees it."""
    found = []
    for name in inputs_read(line, names):
        if name in own:
            found.append(f"reads {name}, defined in roles/{owner}/defaults/main.yml")
        elif name not in shared:
            found.append(f"reads {name}, which no defaults define")
    return found


def test_the_check_catches_an_input_read_where_it_is_not_defined():
    names = {"vllm_service_port", "vllm_service_read"}
    line = "    url: \"http://h:{{ vllm_service_port }}/v1/models\""
    assert misplaced(line, "vllm_service", names, {"vllm_service_port": 8000}, {}) == [
        "reads vllm_service_port, defined in roles/vllm_service/defaults/main.yml"]
    assert misplaced(line, "vllm_service", names, {}, {}) == ["reads vllm_service_port, which no defaults define"]
    assert misplaced(line, "vllm_service", names, {}, {"vllm_service_port": 8000}) == []
    # a parameter passed to an entry point is set, not read
    assert misplaced("    vllm_service_read: \"{{ x }}\"", "vllm_service", names, {}, {}) == []


@pytest.mark.parametrize("line, read", [
    ("    endpoint: \"{{ model_fetch_endpoint or omit }}\"", ["model_fetch_endpoint"]),
    ("  when: model_fetch_peers | bool", ["model_fetch_peers"]),
    ("    model_fetch_listing: \"{{ __migrate_listing }}\"", []),  # a parameter it passes
    ("      (playbooks/deploy.yml -e model_fetch_peers=true)", []),  # an example in a message
    ("    x: \"{{ result.model_fetch_peers }}\"", []),  # an attribute, not the variable
])
def test_the_check_tells_a_read_from_a_parameter(line, read):
    assert inputs_read(line, {"model_fetch_endpoint", "model_fetch_peers", "model_fetch_listing"}) == read


def test_no_role_imports_a_task_file_without_tasks():
    """An empty task file imported only to load a role's variables hides a dependency: the shared
    defaults hold what others read, and entry points do something."""
    empty = [str(path.relative_to(REPO)) for path in sorted((REPO / "roles").glob("*/tasks/*.yml"))
             if not load_yaml(path)]
    assert not empty, empty
