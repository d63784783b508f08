# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""What a host serves now: its deployment record, the ExecStart of its vLLM unit, and the
vLLM servers running on it (also those started by hand or under another unit).

The deployment record (default /var/lib/modelswap/deployment.json, written by the vllm_service
role) is ``{"model": name, "repo_id": ..., "commit": ..., "path": ..., "previous": {...}}``.
The unit's ExecStart comes from ``systemctl show`` (``{ path=... ; argv[]=vllm serve X ... ; }``)
or from the unit file's ``ExecStart=`` line. Either names the model by path or by repo id.

Parsing is pure (argv, ExecStart, the record's JSON) and unit-tested directly;
``read_deployment_record`` and ``read_unit`` read the host (``read_unit`` runs systemctl through
the command_runner.HostCommands it is given: ``HostCommands.of(module)`` in a module,
``HostCommands.local()`` or one built from plain functions in a test).
"""
from __future__ import annotations

import os
import re
import shlex

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import deployment_record as record_file


class ServedError(Exception):
    """A record or unit that exists but cannot be understood (message is final)."""


RECORD_KEYS = ("model", "repo_id", "commit", "path")


def read_deployment_record(path: str):
    """What the record says is served (its RECORD_KEYS), None when the file does not exist or
    notes only fetched models; ServedError when it is unreadable, malformed or names no model.
    The file's reading and shape rules are deployment_record.read's (one reader of the record)."""
    try:
        data = record_file.read(path)
    except record_file.RecordError as exc:
        raise ServedError("%s (the served model must be known)" % exc)
    if data is None:
        return None
    if not any(data.get(k) for k in RECORD_KEYS) and "fetched" in data:
        return None     # models fetched (model_fetch notes them) but none deployed yet
    if not any(data.get(k) for k in RECORD_KEYS):
        raise ServedError("the deployment record %s names no model (expected keys %s)"
                          % (path, ", ".join(RECORD_KEYS)))
    return {k: data.get(k) for k in RECORD_KEYS}


def parse_systemctl_show(text: str) -> dict:
    """``Key=Value`` lines of ``systemctl show`` -> dict (values may contain '=')."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value
    return out


def exec_start_argv(value: str) -> list:
    """argv of an ExecStart, from ``systemctl show`` form or a unit file line's value."""
    value = value.strip()
    if "argv[]=" in value:
        argv = value.split("argv[]=", 1)[1]
        argv = argv.split(" ; ", 1)[0]
        return argv.split()
    if not value:
        return []
    # unit-file syntax: optional prefixes @-:+! before the command
    value = value.lstrip("@-:+!")
    try:
        return shlex.split(value)
    except ValueError:
        return value.split()


def model_from_argv(argv: list):
    """The model a vLLM command line serves (a path or a repo id), or None."""
    model = None
    for i, tok in enumerate(argv):
        if tok == "--model" and i + 1 < len(argv):
            model = argv[i + 1]
        elif tok.startswith("--model="):
            model = tok.split("=", 1)[1]
    if model:
        return model
    for i, tok in enumerate(argv):
        # `vllm serve MODEL` or `python -m vllm.entrypoints.cli.main serve MODEL`
        if tok == "serve" and i > 0 and os.path.basename(argv[i - 1]).startswith("vllm"):
            if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                return argv[i + 1]
    return None


def is_vllm_server(argv: list) -> bool:
    """`vllm serve ...` (also run by a Python interpreter) or `python -m vllm.entrypoints...`."""
    for i, tok in enumerate(argv[:3]):
        if os.path.basename(tok).startswith("vllm") and i + 1 < len(argv) and argv[i + 1] == "serve":
            return i == 0 or os.path.basename(argv[0]).startswith("python")
    return any(tok == "-m" and nxt.startswith("vllm.entrypoints") for tok, nxt in zip(argv, argv[1:]))


def served_by_processes(processes, exists=os.path.exists) -> list:
    """[{"pid", "model"}] of the vLLM servers among ``processes``, (pid, argv, cwd) tuples.

    A relative model argument that names a folder under the process's working folder is made
    absolute (as vLLM prefers a local folder to a repo id); otherwise it stays as it is. Forked
    workers repeat their parent's command line: one entry per model, the lowest PID.
    """
    found = {}
    for pid, argv, cwd in sorted(processes, key=lambda p: p[0]):
        if not is_vllm_server(argv):
            continue
        model = model_from_argv(argv)
        if not model:
            continue
        if cwd and not os.path.isabs(model) and exists(os.path.join(cwd, model)):
            model = os.path.normpath(os.path.join(cwd, model))
        found.setdefault(model, {"pid": pid, "model": model})
    return list(found.values())


def served_from_unit(show: dict):
    """{"model", "active", "unit_state"} from parsed ``systemctl show`` output; None if no unit."""
    if show.get("LoadState") not in ("loaded",):
        return None
    model = model_from_argv(exec_start_argv(show.get("ExecStart", "")))
    return {
        "model": model,
        "active": show.get("ActiveState") in ("active", "activating", "reloading", "deactivating"),
        "unit_state": show.get("ActiveState", "unknown"),
    }


def exec_start_from_unit_file(text: str) -> str:
    """The last ``ExecStart=`` value of a unit file (continuation lines joined)."""
    value = ""
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("ExecStart="):
            value = line.split("=", 1)[1]
    return value


UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
             "/lib/systemd/system", "/usr/lib/systemd/system")


def read_unit(commands, unit: str):
    """What ``unit`` serves, via ``systemctl show`` (run with ``commands``, a HostCommands: under
    the C locale, which the parser reads); the unit file when systemd is not running.

    Returns served_from_unit()'s dict or None when the unit does not exist.
    """
    if not unit:
        return None
    systemctl = commands.which("systemctl")
    if systemctl:
        rc, out, err = commands.run(
            [systemctl, "show", "--property=LoadState,ActiveState,ExecStart", "--", unit])
        if rc == 0:
            show = parse_systemctl_show(out)
            if show.get("LoadState") == "loaded" or show.get("LoadState") == "not-found":
                return served_from_unit(show)
    for directory in UNIT_DIRS:
        path = os.path.join(directory, unit)
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError:
            continue
        model = model_from_argv(exec_start_argv(exec_start_from_unit_file(text)))
        return {"model": model, "active": None, "unit_state": "unknown (systemd not running)"}
    return None


def served_reading(response) -> dict:
    """What a server's ``/v1/models`` said, from the ansible.builtin.uri read of it:
    ``{"names": [served model names], "why": None, or why it named none}``."""
    response = response if isinstance(response, dict) else {}
    if response.get("skipped"):
        return {"names": [], "why": "/v1/models was not asked (the task was skipped)"}
    status = response.get("status")
    if status == 200:
        data = (response.get("json") or {}).get("data") if isinstance(response.get("json"), dict) else None
        if not isinstance(data, list):
            return {"names": [], "why": "/v1/models answered without a model list"}
        names = [str(item["id"]) for item in data if isinstance(item, dict) and item.get("id")]
        return {"names": names, "why": None if names else "/v1/models lists no model"}
    if isinstance(status, int) and status > 0:
        return {"names": [], "why": "/v1/models answered HTTP %d" % status}
    msg = str(response.get("msg") or "no answer")
    # uri's "Status code was -1 and not [200]: Request failed: <(urllib's) error [Errno 111] ...>"
    found = re.search(r"Request failed: <\w+ error (.*)>", msg)
    why = found.group(1) if found else msg.rsplit("failed: ", 1)[-1].rsplit("failure: ", 1)[-1]
    return {"names": [], "why": "/v1/models does not answer: %s" % why[:160]}


def _names(names) -> str:
    return ", ".join(names)


def status_problems(record, served, service, pool=None, served_why=None, drained=False,
                    unit: str = "vllm.service") -> list:
    """Where a host's deployment record, its service, what its server says it serves and its
    place in the pool disagree: one line per problem, each ending with the fix ([] when they agree).

    record: the current deployment (deployment_record.current: ``model``, ``served_model_name``,
    ``path``) or None. served: the names ``/v1/models`` lists (``served_reading``), [] when it
    named none, for ``served_why``. service: the unit's ActiveState (None: not loaded). pool:
    lb_pool.host_pool's dict, or None. drained: the drain mark an interrupted migrate.yml leaves
    (only then does a rerun put the host back in the pool).
    """
    served = [str(name) for name in served or []]
    state = service or "not loaded"
    problems = []
    if record:
        name = record.get("model") or record.get("served_model_name") or "?"
        expected = record.get("served_model_name") or record.get("model")
        # a server started without --served-model-name lists its model's path
        matches = bool(served) and (expected in served or (record.get("path") or "") in served)
        if state != "active":
            problems.append("record names %s, but %s is %s%s: rerun migrate.yml to repair it" % (
                name, unit, state, " and %s answers on its port" % _names(served) if served else ""))
        elif served and not matches:
            problems.append("record names %s, serves %s: rerun migrate.yml to repair it" % (name, _names(served)))
        elif not served:
            problems.append("record names %s and %s is active, but it serves nothing%s: wait if it is starting, "
                            "else read its journal (journalctl -u %s)"
                            % (name, unit, " (%s)" % served_why if served_why else "", unit))
    elif served:
        problems.append("serves %s, but no deployment record names a model: rerun migrate.yml to repair it"
                        % _names(served))
    pool = pool or {}
    if pool.get("type") == "haproxy" and pool.get("found") is not None:
        where = pool.get("label") or pool.get("status")
        if served and not pool["found"]:
            problems.append("serves but not in the pool: add it to the backend, or set lb_pool_server to "
                            "its server's name there")
        elif served and not pool.get("serving"):
            if pool.get("admin") in ("maint", "drain") and drained:
                why, fix = " (an interrupted migrate.yml drained it)", "rerun migrate.yml to rejoin it"
            elif pool.get("admin") in ("maint", "drain"):
                # a rerun of migrate.yml puts back only a host its own drain took out
                why, fix = (" (not drained by migrate.yml)",
                            "put it back with the lb_pool role (tasks_from: rejoin) if it should serve")
            else:
                why = " (health check %s)" % pool["check"] if pool.get("check") else ""
                fix = "check that HAProxy reaches its vLLM port"
            problems.append("serves but %s in the pool%s: %s" % (where, why, fix))
        elif not served and pool.get("serving"):
            problems.append("%s in the pool but serves nothing%s: take it out (lb_pool tasks_from: drain) or "
                            "rerun migrate.yml" % (where, " (%s)" % served_why if served_why else ""))
    return problems
