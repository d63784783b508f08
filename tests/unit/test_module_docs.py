"""Every module's documentation parses, renders, and its EXAMPLES use it as documented (issue 9).

Per module in plugins/modules/: DOCUMENTATION, EXAMPLES and RETURN are YAML of the expected shape; every
EXAMPLES task that calls a `modelswap.vllm.*` module by FQCN passes only documented options
(or aliases), values inside `choices`, the `required` options, and the option groups the module
declares to AnsibleModule (required_one_of, mutually_exclusive, required_together, required_if;
judged only where the example's values are literals, not templates); `ansible-doc` renders it;
its header carries the Apache-2.0 licence and the sanity ignore file explains its missing GPLv3
header. A module's DOCUMENTATION and RETURN, and the collection's documentation fragments, speak
of the module only: no role variable (a word that starts with a role's name and ``_``, or with
``modelswap_``) is named there; the module's own options and return values and the collection's
plugin names that share such a prefix (benchmark_run, migrate_info...) are not variables.
"""
from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from ansible.parsing.splitter import parse_kv

from tests.support.modules import REPO

pytestmark = pytest.mark.unit

MODULES = sorted(p.stem for p in (REPO / "plugins" / "modules").glob("*.py") if not p.name.startswith("_"))
FQCN = "modelswap.vllm."
GROUPS = ("required_one_of", "mutually_exclusive", "required_together", "required_if")
SANITY_IGNORE = REPO / "tests" / "sanity" / "ignore-2.19.txt"
FRAGMENTS = sorted(p.stem for p in (REPO / "plugins" / "doc_fragments").glob("*.py") if not p.name.startswith("_"))
# Role variables are named after their role (roles/<role>/, e.g. model_fetch_resolved_commit) or
# shared by every role (modelswap_models); a path (/var/lib/modelswap_x) or a word inside another is not one.
ROLE_PREFIXES = tuple(sorted(p.name + "_" for p in (REPO / "roles").iterdir() if p.is_dir())) + ("modelswap_",)
ROLE_VARIABLE = re.compile(r"(?<![\w/-])(?:%s)\w+" % "|".join(map(re.escape, ROLE_PREFIXES)))
# The collection's own names that share a prefix: modules (benchmark_run, modelswap_info, migrate_info,
# vllm_service_info), module_utils, doc fragments, filters.
PLUGIN_NAMES = frozenset(p.stem for p in (REPO / "plugins").rglob("*.py"))


@lru_cache(maxsize=None)
def parsed(name: str) -> tuple[dict, dict]:
    """(the YAML blocks by variable name, the option groups passed to AnsibleModule)."""
    tree = ast.parse((REPO / "plugins" / "modules" / f"{name}.py").read_text())
    blocks, groups = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("DOCUMENTATION", "EXAMPLES", "RETURN"):
                blocks[node.targets[0].id] = ast.literal_eval(node.value)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "AnsibleModule":
            groups.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg in GROUPS})
    return blocks, groups


def fragment(fqcn: str) -> dict:
    """A documentation fragment's DOCUMENTATION (``ns.coll.name`` or ``ns.coll.name.VARIANT``):
    the collection's own from plugins/doc_fragments/, ansible-core's from its package."""
    ns, coll, name, *variant = fqcn.split(".")
    if (ns, coll) == ("modelswap", "vllm"):
        module = importlib.import_module(f"ansible_collections.modelswap.vllm.plugins.doc_fragments.{name}")
    else:
        assert (ns, coll) == ("ansible", "builtin"), f"a fragment this test cannot load: {fqcn}"
        module = importlib.import_module(f"ansible.plugins.doc_fragments.{name}")
    return yaml.safe_load(getattr(module.ModuleDocFragment, variant[0].upper() if variant else "DOCUMENTATION"))


def doc(name: str) -> dict:
    """DOCUMENTATION with its fragments merged the way ansible-doc does (the module's keys win)."""
    documentation = yaml.safe_load(parsed(name)[0]["DOCUMENTATION"])
    for fqcn in documentation.get("extends_documentation_fragment") or []:
        for key, entries in fragment(fqcn).items():
            own = documentation.setdefault(key, {})
            for entry, value in entries.items():
                own[entry] = {**value, **own.get(entry, {})}
    return documentation


def is_template(value) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def tasks_of(items):
    """Every task in an EXAMPLES list, blocks included."""
    for task in items or []:
        if not isinstance(task, dict):
            continue
        blocks = [task[k] for k in ("block", "rescue", "always") if k in task]
        if blocks:
            for block in blocks:
                yield from tasks_of(block)
        else:
            yield task


def module_call(task):
    """(module name, its options) for a task that calls a modelswap.vllm module, else None."""
    for key, value in task.items():
        if key.startswith(FQCN):
            args = parse_kv(value) if isinstance(value, str) else dict(value or {})
            args.update(task.get("args") or {})
            return key[len(FQCN):], args
    return None


def call_problems(module: str, args: dict) -> list[str]:
    if module not in MODULES:
        return [f"calls {FQCN}{module}, which is not a module of this collection"]
    options = doc(module).get("options") or {}
    names = {alias: name for name, opt in options.items() for alias in [name, *(opt.get("aliases") or [])]}
    problems = [f"option {key!r} is not documented for {FQCN}{module}" for key in args if key not in names]
    given = {names[k]: v for k, v in args.items() if k in names}
    for name, opt in options.items():
        if opt.get("required") and name not in given:
            problems.append(f"required option {name!r} is missing")
        value, choices = given.get(name), opt.get("choices")
        if name in given and choices and not is_template(value):
            values = value if isinstance(value, list) else [value]
            problems += [f"option {name}={v!r} is not one of {choices}" for v in values if not is_template(v) and v not in choices]
    groups = parsed(module)[1]
    for group in groups.get("required_one_of", []):
        if not any(k in given for k in group):
            problems.append(f"needs one of {list(group)} (required_one_of)")
    for group in groups.get("mutually_exclusive", []):
        if sum(k in given for k in group) > 1:
            problems.append(f"sets more than one of {list(group)} (mutually_exclusive)")
    for group in groups.get("required_together", []):
        if 0 < sum(k in given for k in group) < len(group):
            problems.append(f"sets only part of {list(group)} (required_together)")
    for key, value, requirements, *any_of in groups.get("required_if", []):
        if key in given and not is_template(given[key]) and given[key] == value:
            present = [r in given for r in requirements]
            if not (any(present) if any_of and any_of[0] else all(present)):
                problems.append(f"{key}={value!r} requires {list(requirements)} (required_if)")
    return problems


def fail(name: str, problems: list[str]) -> None:
    if problems:
        pytest.fail(f"module {name}:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.mark.parametrize("name", MODULES)
def test_doc_blocks_parse(name):
    blocks = parsed(name)[0]
    problems = [f"{var} is missing" for var in ("DOCUMENTATION", "EXAMPLES", "RETURN") if var not in blocks]
    fail(name, problems)
    for var, text in blocks.items():
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as exc:
            problems.append(f"{var} is not YAML: {exc}")
    fail(name, problems)
    documentation, examples, returns = (yaml.safe_load(blocks[v]) for v in ("DOCUMENTATION", "EXAMPLES", "RETURN"))
    if not isinstance(documentation, dict) or documentation.get("module") != name:
        problems.append(f"DOCUMENTATION is not a mapping with module: {name}")
    elif not isinstance(documentation.get("options", {}), dict):
        problems.append("DOCUMENTATION.options is not a mapping")
    if not isinstance(examples, list) or not examples:
        problems.append("EXAMPLES is not a non-empty list of tasks")
    if returns is not None and not isinstance(returns, dict):
        problems.append("RETURN is neither empty nor a mapping")
    fail(name, problems)


@pytest.mark.parametrize("name", MODULES)
def test_examples_use_documented_options(name):
    examples = yaml.safe_load(parsed(name)[0].get("EXAMPLES") or "[]") or []
    problems, calls_itself = [], False
    for task in tasks_of(examples):
        label = task.get("name")
        if not label:
            problems.append(f"an example task has no name: {task}")
        call = module_call(task)
        if call is None:
            continue
        calls_itself |= call[0] == name
        problems += [f"example {label!r}: {p}" for p in call_problems(*call)]
    if not calls_itself:
        problems.append(f"no example calls {FQCN}{name}")
    fail(name, problems)


@pytest.mark.parametrize("name", MODULES)
def test_attributes_say_what_the_module_supports(name):
    """Each module says, itself or through modelswap.vllm.attributes, how it runs in check mode and
    diff mode and on which platform; ansible-core's fragment only describes the attributes (its
    values are N/A), so ours must come first to win."""
    attributes = doc(name).get("attributes") or {}
    problems = []
    if (attributes.get("platform") or {}).get("support") != "full" or attributes["platform"].get("platforms") != "posix":
        problems.append(f"platform is {attributes.get('platform')}, not full support on posix")
    for key, allowed in (("check_mode", ("full", "partial")), ("diff_mode", ("full", "partial", "none"))):
        if (attributes.get(key) or {}).get("support") not in allowed:
            problems.append(f"{key} support is {(attributes.get(key) or {}).get('support')!r}, not one of {allowed}")
    fail(name, problems)


@pytest.mark.parametrize("name", MODULES)
def test_ansible_doc_renders(name):
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")
    ansible_doc = Path(sys.executable).parent / "ansible-doc"
    proc = subprocess.run([str(ansible_doc), "-t", "module", f"{FQCN}{name}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    problems = []
    if proc.returncode != 0 or "[ERROR]" in proc.stderr or "[WARNING]" in proc.stderr:
        problems.append(f"ansible-doc rc={proc.returncode}: {proc.stderr.strip()}")
    if not proc.stdout.startswith(f"> MODULE {FQCN}{name} "):
        problems.append(f"ansible-doc printed no page for {FQCN}{name}: {proc.stdout[:200]!r}")
    sections = ["EXAMPLES:"] + (["RETURN VALUES:"] if yaml.safe_load(parsed(name)[0].get("RETURN") or "") else [])
    for section in sections:
        if section not in proc.stdout:
            problems.append(f"ansible-doc page has no {section} section")
    fail(name, problems)


@pytest.mark.parametrize("name", MODULES)
def test_licence_header_and_sanity_ignore(name):
    header = (REPO / "plugins" / "modules" / f"{name}.py").read_text().splitlines()[:20]
    problems = [] if "# SPDX-License-Identifier: Apache-2.0" in header else [
        "no `# SPDX-License-Identifier: Apache-2.0` line in the first 20 lines"]
    entries = [line.split("#", 1) for line in SANITY_IGNORE.read_text().splitlines()]
    wanted = f"plugins/modules/{name}.py validate-modules:missing-gplv3-license"
    if not any(code.strip() == wanted and reason.strip() for code, *rest in entries for reason in rest[:1]):
        problems.append(f"{SANITY_IGNORE.relative_to(REPO)} lacks `{wanted}  # <reason>`")
    fail(name, problems)


def fragment_blocks(name: str) -> dict:
    """A documentation fragment's YAML strings by attribute (DOCUMENTATION and its variants)."""
    tree = ast.parse((REPO / "plugins" / "doc_fragments" / f"{name}.py").read_text())
    return {f"{cls.name}.{node.targets[0].id}": ast.literal_eval(node.value)
            for cls in tree.body if isinstance(cls, ast.ClassDef)
            for node in cls.body if isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def _strings_and_keys(value, texts: list, keys: set) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            keys.add(str(key))
            _strings_and_keys(item, texts, keys)
    elif isinstance(value, list):
        for item in value:
            _strings_and_keys(item, texts, keys)
    elif isinstance(value, str):
        texts.append(value)


def role_variables(blocks: dict) -> list[str]:
    """Each role variable the blocks' text names ('BLOCK names WORD: ...context...'). The blocks' own
    keys (options, suboptions, return values, sample keys) and the collection's plugin names are not
    role variables."""
    found = []
    for var, text in blocks.items():
        texts, keys = [], set()
        _strings_and_keys(yaml.safe_load(text), texts, keys)
        for string in texts:
            for match in ROLE_VARIABLE.finditer(string):
                if match.group(0) not in keys and match.group(0) not in PLUGIN_NAMES:
                    context = " ".join(string[max(0, match.start() - 50):match.end() + 30].split())
                    found.append(f"{var} names {match.group(0)!r}: ...{context}...")
    return found


@pytest.mark.parametrize("name", MODULES)
def test_documentation_and_return_speak_of_the_module_only(name):
    """A module's page describes its options and results, not a role's variables: a role passes the
    module its values, and the role's README says which variable becomes which option."""
    blocks = {var: text for var, text in parsed(name)[0].items() if var in ("DOCUMENTATION", "RETURN")}
    fail(name, role_variables(blocks))


@pytest.mark.parametrize("name", FRAGMENTS)
def test_documentation_fragments_speak_of_the_modules_only(name):
    fail(f"doc fragment {name}", role_variables(fragment_blocks(name)))


def test_role_variable_checker():
    """The rule itself: every role's prefix and modelswap_ are caught; the document's own keys, the
    collection's plugin names, FQCNs and paths are not."""
    assert {"model_fetch_", "vllm_service_", "migrate_", "modelswap_"} <= set(ROLE_PREFIXES)
    documentation = """
module: migrate_info
description:
  - The commit C(model_fetch_resolved_commit) holds, or C(-e modelswap_break_lease=<id>).
  - Reads as M(modelswap.vllm.vllm_service_info) and benchmark_run do, under /var/lib/modelswap_x.
options:
  migrate_run_id: {description: See O(migrate_run_id); the role's vllm_service_cpu_affinity., type: str}
"""
    assert [line.split(":")[0] for line in role_variables({"DOCUMENTATION": documentation})] == [
        "DOCUMENTATION names 'model_fetch_resolved_commit'", "DOCUMENTATION names 'modelswap_break_lease'",
        "DOCUMENTATION names 'vllm_service_cpu_affinity'"]
    assert role_variables({"RETURN": "lb_pool_state: {description: The pool., sample: {modelswap_x: 1}}"}) == []


@pytest.mark.parametrize("module, args, expected", [
    ("model_purge", {"cache_dir": "/c", "items": ["a"]}, []),
    ("model_purge", {"cache_dir": "/c", "bogus": 1}, ["option 'bogus' is not documented for modelswap.vllm.model_purge"]),
    ("model_purge", {"cache_dir": "/c", "missing": "explode"}, ["option missing='explode' is not one of ['ignore', 'fail']"]),
    ("model_purge", {"cache_dir": "/c", "missing": "{{ how }}"}, []),
    ("model_purge", {"items": ["a"]}, ["needs one of ['cache_dir', 'models_dir'] (required_one_of)"]),
    ("vllm_ready", {"port": 8000, "state": "stopped"}, ["state='stopped' requires ['unit'] (required_if)"]),
    ("vllm_ready", {"port": 8000, "state": "{{ how }}"}, []),
    ("no_such_module", {}, ["calls modelswap.vllm.no_such_module, which is not a module of this collection"]),
], ids=["ok", "unknown-option", "bad-choice", "templated-choice", "required-one-of", "required-if",
        "templated-required-if", "unknown-module"])
def test_checker_finds_bad_calls(module, args, expected):
    """The EXAMPLES check itself: each kind of mistake is reported, templated values are not judged."""
    assert call_problems(module, args) == expected


def test_checker_reads_free_form_args_and_blocks():
    examples = yaml.safe_load("""
- name: A block
  block:
    - name: Free-form
      modelswap.vllm.model_purge: cache_dir=/c missing=sometimes
""")
    (task,) = tasks_of(examples)
    assert module_call(task) == ("model_purge", {"cache_dir": "/c", "missing": "sometimes"})
    assert call_problems(*module_call(task)) == ["option missing='sometimes' is not one of ['ignore', 'fail']"]


def test_ansible_doc_shows_gpu_readys_options():
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-doc"), "-t", "module",
                           "modelswap.vllm.gpu_ready"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "gpu_memory_utilization" in proc.stdout and "shm_patterns" in proc.stdout
