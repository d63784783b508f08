# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""What a vLLM serving host has and serves, read before anything changes (the module
vllm_service_info).

``gather`` takes the module's option values and a ``HostCommands`` (systemctl, the virtualenv's
python), reads the deployment record, the units, the port's listeners, the model's snapshot and
the installed vLLM, and returns the module's result; the module is a shell around it.
"""
from __future__ import annotations

import os

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import deployment_record
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit_state
from ansible_collections.modelswap.vllm.plugins.module_utils.store import snapshot_check
from ansible_collections.modelswap.vllm.plugins.module_utils.serving.served_model import (
    exec_start_argv,
    model_from_argv,
    parse_systemctl_show,
)

VERSION_SNIPPET = "import importlib.metadata as m; print(m.version('vllm'))"
UNIT_FACT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "NRestarts", "FragmentPath",
                        "ExecStart", "ControlGroup", "UnitFileState", "NeedDaemonReload")

NO_UNIT = {"loaded": False, "active_state": None, "sub_state": None, "main_pid": 0, "n_restarts": 0,
           "fragment_path": None, "unit_file_state": None, "model": None, "need_daemon_reload": False,
           "running_model": None}


class FactsError(Exception):
    """The module fails with this message (unusable options, an unreadable record)."""


def process_model(pid: int, proc_root: str = "/proc"):
    """The model the process ``pid`` was started with, from its command line: what a running
    vLLM really serves, whatever the unit file says now. None when it is gone or not vLLM."""
    if not pid or pid <= 0:
        return None
    try:
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as handle:
            argv = [arg.decode("utf-8", "replace") for arg in handle.read().split(b"\0") if arg]
    except OSError:
        return None
    return model_from_argv(argv)


def unit_facts(commands, unit: str, proc_root: str = "/proc") -> dict:
    """The state of ``unit``, the model its ExecStart serves (as systemd loaded it), whether its
    file changed since (``need_daemon_reload``) and the model its running main process was
    started with (``running_model``); not loaded (with the reason) when systemd cannot be asked."""
    systemctl = commands.which("systemctl")
    if not systemctl:
        return dict(NO_UNIT, reason="systemctl not found")
    rc, out, err = commands.run([systemctl, "show", "--property=" + ",".join(UNIT_FACT_PROPERTIES), "--", unit])
    if rc != 0:
        # systemd is not running (a container without it, a build host): no unit can be loaded
        return dict(NO_UNIT, reason=(err or out).strip()[:300])
    show = parse_systemctl_show(out)
    loaded = show.get("LoadState") == "loaded"
    main_pid = int(show.get("MainPID") or 0) if (show.get("MainPID") or "0").isdigit() else 0
    return {
        "loaded": loaded,
        "active_state": show.get("ActiveState"),
        "sub_state": show.get("SubState"),
        "main_pid": main_pid,
        "n_restarts": int(show.get("NRestarts") or 0) if (show.get("NRestarts") or "0").isdigit() else 0,
        "fragment_path": show.get("FragmentPath") or None,
        "unit_file_state": show.get("UnitFileState") or None,
        "model": model_from_argv(exec_start_argv(show.get("ExecStart", ""))) if loaded else None,
        "need_daemon_reload": show.get("NeedDaemonReload") == "yes",
        "running_model": process_model(main_pid, proc_root) if show.get("ActiveState") == "active" else None,
    }


def model_label(path) -> str:
    """``org/name@commit12`` for a snapshot path of the Hugging Face cache; the path otherwise."""
    parts = str(path or "").rstrip("/").split("/")
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return "%s@%s" % (parts[-3][len("models--"):].replace("--", "/"), parts[-1][:12])
    return str(path)


def restart_reasons(unit) -> list:
    """Why an active unit must restart although its files are the target's: an interrupted swap
    wrote them and was killed before the restart (systemd has not loaded them, or the process
    that runs was started from the old ones)."""
    unit = unit if isinstance(unit, dict) else {}
    if unit.get("active_state") != "active":
        return []
    reasons = []
    if unit.get("need_daemon_reload"):
        reasons.append("the unit file changed since systemd loaded it")
    running, loaded = unit.get("running_model"), unit.get("model")
    if running and loaded and running != loaded:
        reasons.append("the running process serves %s, the unit says %s" % (model_label(running), model_label(loaded)))
    return reasons


def vllm_facts(commands, venv, binary) -> dict:
    """The vLLM executable (``binary``, else the virtualenv's ``bin/vllm``) and the installed
    ``vllm`` version, read by the virtualenv's python (None when it cannot be read)."""
    binary = binary or os.path.join(venv, "bin", "vllm")
    python = os.path.join(venv or os.path.dirname(binary).rsplit("/bin", 1)[0], "bin", "python")
    out = {"binary": binary, "exists": os.path.isfile(binary) and os.access(binary, os.X_OK),
           "python": python, "version": None}
    if os.path.isfile(python) and os.access(python, os.X_OK):
        rc, stdout, _err = commands.run([python, "-c", VERSION_SNIPPET])
        if rc == 0 and stdout.strip():
            out["version"] = stdout.strip().splitlines()[-1]
    return out


def port_facts(port: int, unit: str, replaces, listeners_on=vllm_unit_state.port_listeners) -> dict:
    """The port's listeners, each with a one-line ``text``, and those outside the units."""
    listeners = listeners_on(port)
    for entry in listeners:
        entry["text"] = vllm_unit_state.describe_listener(entry)
    return {"port": port, "listeners": listeners,
            "foreign": vllm_unit_state.foreign_listeners(listeners, unit, replaces)}


def gather(params: dict, commands, listeners_on=vllm_unit_state.port_listeners) -> dict:
    """The module's result from its option values; FactsError when it must fail."""
    why = deployment_record.facts_options_problem(params["unit"], params["replaces"], params["port"],
                                                  params["model"]["repo_id"] if params["model"] else None)
    if why:
        raise FactsError("vllm_service_info: %s" % why)
    try:
        record = deployment_record.read(params["record_path"])
    except deployment_record.RecordError as exc:
        raise FactsError("vllm_service_info: %s" % exc)
    result = {"changed": False, "record": record, "deployment": deployment_record.current(record),
              "previous": deployment_record.previous(record), "unit": unit_facts(commands, params["unit"]),
              "replaces": [dict(unit_facts(commands, name), unit=name) for name in params["replaces"]],
              "files": {path: os.path.exists(path) for path in params["paths"]}}
    if params["port"] is not None:
        result["port"] = port_facts(params["port"], params["unit"], params["replaces"], listeners_on)
    if params["model"]:
        model = params["model"]
        result["snapshot"] = snapshot_check.check(
            model["name"], model["repo_id"], model["revision"], record=record, cache_dir=params["cache_dir"],
            path=params["snapshot_path"], mode=params["verification"])
    if params["venv"] or params["binary"]:
        result["vllm"] = vllm_facts(commands, params["venv"], params["binary"])
    return result
