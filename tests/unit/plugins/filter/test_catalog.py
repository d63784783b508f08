"""The catalog's one owner (plugins/module_utils/common/catalog.py) and its filters: one set of rules for
every role, so an entry the swap refuses is refused before the purge and the download."""
from __future__ import annotations

import pathlib

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.modelswap.vllm.plugins.filter.catalog import catalog_entry, catalog_problems
from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog
from ansible_collections.modelswap.vllm.plugins.module_utils.store import cache_layout

REPO = pathlib.Path(__file__).resolve().parents[4]
GOOD = {"repo_id": "lab/tiny-a", "revision": "main", "served_model_name": "tiny-a",
        "vllm_args": {"dtype": "float32"}}


@pytest.mark.parametrize("repo_id", ["gpt2", "bert-base-uncased", "lab/tiny-a", "Org_1.x/Model-7B.v1_2"])
def test_single_name_and_namespaced_repo_ids_are_accepted(repo_id):
    assert catalog.repo_id_problem(repo_id) == ""
    assert catalog.entry_problems("m", dict(GOOD, repo_id=repo_id)) == []
    assert cache_layout.validate_repo_id(repo_id) == repo_id


@pytest.mark.parametrize("repo_id, says", [
    ("", "not a non-empty string"), (None, "not a non-empty string"),
    ("a/b/c", "malformed"), ("org/name\n", "malformed"), ("-x", "malformed"),
    ("org--x/y", "'--'"), ("org/x..y", "'..'"), ("org/x.git", "'.git'"),
])
def test_bad_repo_ids_are_named(repo_id, says):
    problem = catalog.repo_id_problem(repo_id)
    assert says in problem
    with pytest.raises(cache_layout.StoreError) as exc:
        cache_layout.validate_repo_id(repo_id)
    assert str(exc.value) == problem                 # the store says what the catalog says


@pytest.mark.parametrize("change, says", [
    ({"revision": "a..b"}, "revision 'a..b'"),
    ({"revision": "main\nExecStart=/x"}, "revision"),
    ({"served_model_name": "bad name"}, "served_model_name 'bad name'"),
    ({"vllm_args": "tp=8"}, "vllm_args must be a mapping"),
    ({"vllm_args": {"extra_args": ["--port=1"]}}, "--port"),
    ({"allow_patterns": "*.safetensors"}, "allow_patterns must be a list"),
    ({"ignore_patterns": [1]}, "ignore_patterns must be a list"),
])
def test_entry_problems_name_the_value(change, says):
    problems = catalog.entry_problems("m", dict(GOOD, **change))
    assert len(problems) == 1 and says in problems[0], problems


def test_selection_problems_name_unknown_models_and_the_entry():
    models = {"tiny-a": GOOD, "bad": dict(GOOD, repo_id="a/b/c")}
    assert catalog.selection_problems(models, "tiny-a") == []
    assert "unknown model name 'nope'" in catalog.selection_problems(models, "nope")[0]
    assert "the catalog has bad, tiny-a" in catalog.selection_problems(models, "nope")[0]
    assert "modelswap_keep" in catalog.selection_problems(models, "tiny-a", ["gone"])[0]
    assert "malformed" in catalog.selection_problems(models, "bad")[0]
    assert "empty" in catalog.selection_problems({}, "x")[0]
    assert "not a mapping" in catalog.selection_problems(["x"], "x")[0]


def test_normalized_entry_carries_the_defaults():
    out = catalog_entry({"gpt2": {"repo_id": "gpt2"}}, "gpt2")
    assert out == {"name": "gpt2", "repo_id": "gpt2", "revision": catalog.DEFAULT_REVISION,
                   "served_model_name": "gpt2", "vllm_args": {}}
    kept = catalog_entry({"m": dict(GOOD, allow_patterns=["*.json"], ignore_patterns=[])}, "m")
    assert kept["allow_patterns"] == ["*.json"] and kept["ignore_patterns"] == []
    # lenient for actions that need no entry (rollback), strict on request
    assert catalog_entry({}, "gone")["repo_id"] == ""
    with pytest.raises(AnsibleFilterError, match="unknown model name 'gone'"):
        catalog_entry({"m": GOOD}, "gone", strict=True)
    assert catalog_problems({"m": GOOD}, "m") == []


def test_every_role_judges_entries_with_the_one_filter():
    """preflight, model_fetch, vllm_service and the migration's read refuse an entry through the
    catalog's rules (vllm_service's judge, vllm_service_checks through its layout, calls the catalog
    itself; the migration's one read per host, the migrate_read action, calls catalog.target_refusals,
    the rule behind the catalog_refusals filter); no role
    spells a repo-id rule or the revision default of its own."""
    judges = {"preflight/tasks/validate.yml": "modelswap.vllm.catalog_refusals(",
              "model_fetch/tasks/validate.yml": "modelswap.vllm.catalog_problems(",
              "vllm_service/tasks/validate.yml": "modelswap.vllm.vllm_service_layout).problems",
              "migrate/tasks/read.yml": "modelswap.vllm.migrate_read:"}
    for path, judge in judges.items():
        assert judge in (REPO / "roles" / path).read_text(), path
    assert "catalog.target_refusals(" in (REPO / "plugins" / "action" / "migrate_read.py").read_text()
    assert "catalog.target_refusals(" in (REPO / "plugins" / "filter" / "catalog.py").read_text()
    checks = (REPO / "plugins" / "module_utils" / "serving" / "vllm_service_checks.py").read_text()
    assert "catalog.selection_problems(" in checks
    settings = (REPO / "plugins" / "module_utils" / "serving" / "vllm_service_settings.py").read_text()
    assert "vllm_service_checks.settings_problems(" in settings
    for path in (REPO / "roles").rglob("*.yml"):
        text = path.read_text()
        assert "default('main')" not in text and "repo_id_re" not in text, path
