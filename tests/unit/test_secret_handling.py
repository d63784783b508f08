"""Secrets stay out of logs, results and process lists (issue 14, items 6 and 7; house style rule 3).

An audit of every role option, module option and task that carries a Hub token or an API key:
- each such role option (meta/argument_specs.yml) and module option is `no_log`;
- a task of a module outside this collection that reads a secret variable, or that copies or reads
  the saved configuration files (the API key file among them), runs with `no_log`;
- no task hands a secret over in `environment:` (Ansible writes it on the remote command line:
  `ps` and a -vvv log show it);
- the locustfile reads a remote worker's API key from the 0600 file its environment names, and
  refuses a file that others can read.
"""
from __future__ import annotations

import ast
import os
import re

import pytest
import yaml

from tests.support.modules import REPO

pytestmark = pytest.mark.unit

SECRET_NAME = re.compile(r"(^|_)(token|api_key|secret|password|passwd)$")
# options that name where a secret is, not the secret itself
NOT_A_SECRET = re.compile(r"_(file|path|dir)$")
ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir())
MODULES = sorted(p for p in (REPO / "plugins" / "modules").glob("*.py") if p.name != "__init__.py")


def role_options():
    for role in ROLES:
        path = REPO / "roles" / role / "meta" / "argument_specs.yml"
        if not path.is_file():
            continue
        for entry, spec in (yaml.safe_load(path.read_text())["argument_specs"] or {}).items():
            for name, option in (spec.get("options") or {}).items():
                yield role, entry, name, option


def secret_role_options():
    return [(r, e, n, o) for r, e, n, o in role_options()
            if SECRET_NAME.search(n) and not NOT_A_SECRET.search(n) and o.get("type", "str") in ("str", "raw")]


def module_options(path):
    """(name, keywords) of every `name=dict(...)` in the module's argument spec."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", None) == "dict" and node.arg:
            yield node.arg, {k.arg: k.value for k in node.value.keywords}


def test_the_audit_finds_the_secret_options():
    names = {n for _unused, _unused, n, _unused in secret_role_options()}
    assert {"benchmark_api_key", "model_purge_hub_token", "preflight_hub_token", "model_fetch_token",
            "vllm_service_api_key"} <= names


@pytest.mark.parametrize("role, entry, name, option", secret_role_options(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_secret_role_option_is_no_log(role, entry, name, option):
    assert option.get("no_log") is True, (
        f"roles/{role}/meta/argument_specs.yml ({entry}): {name} carries a secret; add `no_log: true`")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_every_secret_module_option_is_no_log(path):
    bad = []
    for name, kw in module_options(path):
        kind = kw.get("type")
        if SECRET_NAME.search(name) and not NOT_A_SECRET.search(name) \
                and isinstance(kind, ast.Constant) and kind.value in ("str", "raw"):
            no_log = kw.get("no_log")
            if not (isinstance(no_log, ast.Constant) and no_log.value is True):
                bad.append(name)
    assert not bad, f"plugins/modules/{path.name}: options {bad} carry a secret; declare them no_log=True"


def secret_variables():
    names = {n for _unused, _unused, n, o in secret_role_options()}
    return names | {"modelswap_hub_token"}


def tasks_of(node):
    """Every task in a task list, blocks opened (block, rescue and always)."""
    for task in node or []:
        if not isinstance(task, dict):
            continue
        yield task
        for key in ("block", "rescue", "always"):
            yield from tasks_of(task.get(key))


def role_tasks():
    for role in ROLES:
        for sub in ("tasks", "handlers"):
            for path in sorted((REPO / "roles" / role / sub).glob("*.yml")):
                for task in tasks_of(yaml.safe_load(path.read_text())):
                    yield f"roles/{role}/{sub}/{path.name}", task


TASK_KEYS = {"name", "when", "loop", "loop_control", "register", "become", "become_user", "vars",
             "delegate_to", "tags", "no_log", "changed_when", "failed_when", "environment", "async",
             "poll", "until", "retries", "delay", "check_mode", "throttle", "notify", "listen",
             "ignore_errors", "run_once", "block", "rescue", "always", "args", "delegate_facts",
             "diff", "timeout", "any_errors_fatal"}


def module_of(task):
    mods = [k for k in task if k not in TASK_KEYS]
    return mods[0] if mods else None


def mentions(value, names):
    text = yaml.safe_dump(value)
    return sorted(n for n in names if re.search(r"\b%s\b" % re.escape(n), text))


def test_no_task_hands_a_secret_over_in_its_environment():
    names = secret_variables()
    bad = [(where, task.get("name"), mentions(task["environment"], names))
           for where, task in role_tasks() if task.get("environment") and mentions(task["environment"], names)]
    assert not bad, f"secrets in `environment:` (the remote command line): {bad}"


def test_tasks_of_other_modules_that_touch_a_secret_run_with_no_log():
    names = secret_variables()
    bad, seen = [], 0
    for where, task in role_tasks():
        module = module_of(task)
        if module is None or module.startswith("modelswap.vllm.") or module in (
                "ansible.builtin.import_role", "ansible.builtin.include_role", "ansible.builtin.set_fact",
                "ansible.builtin.import_tasks", "ansible.builtin.include_tasks", "ansible.builtin.assert"):
            continue
        touched = mentions({"args": task[module], "loop": task.get("loop")}, names)
        # the saved configuration's files include the API key file (vllm_service vars/main.yml)
        if "__vllm_service.saved_files }}" in yaml.safe_dump(task.get("loop")) \
                and module in ("ansible.builtin.copy", "ansible.builtin.slurp", "ansible.builtin.fetch"):
            touched.append("__vllm_service.saved_files (holds the API key file)")
        if "__vllm_service.secret_path" in yaml.safe_dump(task[module]) \
                and module in ("ansible.builtin.copy", "ansible.builtin.template", "ansible.builtin.slurp"):
            touched.append("__vllm_service.secret_path")
        if touched:
            seen += 1
            if task.get("no_log") is not True:
                bad.append((where, task.get("name"), touched))
    assert seen >= 5        # the audit saw the tasks it is about
    assert not bad, f"tasks that carry a secret without no_log: {bad}"


# --- the locustfile's key hand-over ----------------------------------------------------------------

@pytest.fixture(scope="module")
def locustfile():
    """The locustfile's read_api_key on its own (importing the locustfile would import Locust,
    which monkey-patches this test process with gevent)."""
    source = (REPO / "roles" / "benchmark" / "files" / "locustfile.py").read_text()
    [fn] = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "read_api_key"]
    namespace = {"os": os}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "locustfile.py", "exec"), namespace)
    return type("Locustfile", (), {"read_api_key": staticmethod(namespace["read_api_key"])})


def test_a_worker_reads_its_api_key_from_the_file_its_environment_names(locustfile, tmp_path):
    key = tmp_path / "api_key"
    key.touch(mode=0o600)
    key.write_text("worker-key-5d1e\n")
    env = {"MODELSWAP_BENCH_API_KEY_FILE": str(key), "MODELSWAP_BENCH_API_KEY": "not-this-one"}
    assert locustfile.read_api_key(env) == "worker-key-5d1e"
    assert locustfile.read_api_key({"MODELSWAP_BENCH_API_KEY": "local-key"}) == "local-key"
    assert locustfile.read_api_key({"MODELSWAP_BENCH_API_KEY_FILE": ""}) is None
    assert locustfile.read_api_key({}) is None


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_key_file_that_others_can_read_is_refused(locustfile, tmp_path, mode):
    key = tmp_path / "api_key"
    key.write_text("worker-key-5d1e")
    os.chmod(key, mode)
    with pytest.raises(SystemExit) as exc:
        locustfile.read_api_key({"MODELSWAP_BENCH_API_KEY_FILE": str(key)})
    assert "readable by others" in str(exc.value) and "0600" in str(exc.value)
    assert "worker-key-5d1e" not in str(exc.value)
    assert key.read_text() == "worker-key-5d1e"        # nothing changed


def test_a_missing_key_file_says_which(locustfile, tmp_path):
    with pytest.raises(SystemExit) as exc:
        locustfile.read_api_key({"MODELSWAP_BENCH_API_KEY_FILE": str(tmp_path / "gone")})
    assert "cannot read the API key file" in str(exc.value) and "MODELSWAP_BENCH_API_KEY_FILE" in str(exc.value)


def test_a_symlinked_key_file_is_not_followed(locustfile, tmp_path):
    real = tmp_path / "real"
    real.touch(mode=0o600)
    real.write_text("k")
    link = tmp_path / "api_key"
    link.symlink_to(real)
    with pytest.raises(SystemExit, match="cannot read the API key file"):
        locustfile.read_api_key({"MODELSWAP_BENCH_API_KEY_FILE": str(link)})
