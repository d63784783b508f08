"""Roles talk through their interfaces only: no role reads or sets another role's private
`__<role>_*` variables or renders another role's templates and files; it calls the other role's
documented entry points (include_role/import_role tasks_from) and reads what they publish
(vllm_service_layout, vllm_service_expected, lb_pool_result, ...)."""
from __future__ import annotations

import re

import pytest

from tests.support.modules import REPO

pytestmark = pytest.mark.unit

ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir())
TEXT_FILES = ("**/*.yml", "**/*.yaml", "**/*.j2")


def crossings(role: str, text: str) -> list[str]:
    """What a role's file `text` reaches into elsewhere: another role's private variable, or a
    path to another role's folder (role_path | dirname, or roles/<other>/)."""
    found = []
    for other in ROLES:
        if other == role:
            continue
        for match in re.finditer(rf"(?<![\w]){re.escape('__' + other)}_\w+", text):
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
