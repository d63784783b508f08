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
