# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The vllm_service role's refusals, in one place: the role's validate step and the migration's
preview judge a deployment with these functions, so a request the swap would refuse is refused by
the preview with the same sentence, before anything changes.

``settings_problems`` judges the role's variables (no host needed); ``host_problems`` what the
host has (its GPUs, what holds the port, whether the snapshot is fetched and verified). Each
returns sentences in the order the role checks them; the first is the one a run fails with.
"""
from __future__ import annotations

import json
import re

from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import replica_group
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit

ACTIONS = ("deploy", "rollback", "install")
ACCELERATORS = ("auto", "cuda", "cpu")
VERIFICATIONS = ("full", "size", "none")
UNIT_NAME_RE = re.compile(r"^[A-Za-z0-9@_.:-]+[.]service\Z")
CPU_LIST_RE = re.compile(r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*\Z")
KEY_BAD_RE = re.compile(r'[\r\n"\\]')


def _json(value) -> str:
    return json.dumps(value)


def _port_ok(port) -> bool:
    try:
        return 0 < int(port) < 65536
    except (TypeError, ValueError):
        return False


def slot_problem(s: dict) -> str:
    """The slot's basic settings (action, accelerator, unit, port, verification, replaces)."""
    replaces = s.get("replaces")
    replaces_ok = isinstance(replaces, (list, tuple)) and all(
        isinstance(u, str) and UNIT_NAME_RE.match(u) for u in replaces) and s.get("unit") not in replaces
    unit = s.get("unit")
    if (s.get("action") in ACTIONS and s.get("accelerator") in ACCELERATORS
            and isinstance(unit, str) and UNIT_NAME_RE.match(unit) and _port_ok(s.get("port"))
            and s.get("verification") in VERIFICATIONS and replaces_ok):
        return ""
    return ("vllm_service: invalid settings - vllm_service_action must be deploy, rollback or install "
            "(got %s), vllm_service_accelerator auto, cuda or cpu (got %s), vllm_service_unit a *.service "
            "name (got %s), vllm_service_port 1..65535 (got %s), vllm_service_verification full, size or "
            "none (got %s), vllm_service_replaces a list of *.service names other than the slot's own (got "
            "%s). Nothing was changed." % (s.get("action"), s.get("accelerator"), _json(unit), s.get("port"),
                                           s.get("verification"), _json(replaces)))


def settings_problems(s: dict) -> list:
    """Why the role's settings cannot be deployed (rollback and install check fewer), in the
    role's order. ``s``: action, accelerator, unit, port, verification, replaces, cpu_affinity,
    model, models, render (vllm_unit.unit_problems' settings), api_key, require_api_key, host,
    replica (replica_group.node_problems' arguments, with groups and hostname)."""
    problems = []
    why = slot_problem(s)
    if why:
        return [why]
    replica = dict(s.get("replica") or {})
    problems += replica_group.node_problems(replica.pop("groups", None), replica.pop("hostname", None), **replica)
    deploy = s.get("action") == "deploy"
    if deploy:
        unsafe = vllm_unit.unit_problems(s.get("render") or {})
        if unsafe:
            problems.append("vllm_service: refusing to render %s on %s: %s. Nothing was changed."
                            % (_json(s.get("unit")), s.get("host"), "; ".join(unsafe)))
    affinity = "" if s.get("cpu_affinity") is None else str(s.get("cpu_affinity"))
    if affinity and not CPU_LIST_RE.match(affinity):
        problems.append("vllm_service: vllm_service_cpu_affinity must be a CPU list such as 0, 0-3 or 0,2-3 "
                        "(got %s); leave it empty to let the service run on every CPU. Nothing was changed."
                        % _json(s.get("cpu_affinity")))
    if not deploy:
        return problems
    models = s.get("models") if isinstance(s.get("models"), dict) else {}
    model = s.get("model") or ""
    if not model or model not in models:
        problems.append("vllm_service: refusing to deploy '%s': it is not in the model catalog "
                        "(vllm_service_models / modelswap_models has %s). Add it to the catalog or pick "
                        "one of those; nothing was changed." % (model, ", ".join(sorted(models)) or "no model"))
        return problems
    entry = catalog.selection_problems(models, model)
    if entry:
        problems.append("vllm_service: catalog entry '%s' is invalid: %s; nothing was changed"
                        % (model, "; ".join(entry)))
        return problems
    key = s.get("api_key") or ""
    if (not key and s.get("require_api_key", True)) or KEY_BAD_RE.search(key):
        problems.append("vllm_service: vllm_service_api_key is %s; vLLM would serve without authentication. "
                        "Set it (from a vault) or set vllm_service_require_api_key=false on purpose. "
                        "Nothing was changed." % ("empty" if not key
                                                  else "not usable (it contains a quote, backslash or newline)"))
    return problems


def host_problems(s: dict, facts: dict, gpus: dict, *, allow_unfetched: bool = False) -> list:
    """Why this host cannot take the deployment: too few GPUs for the parallelism, a CPU host asked
    for more than one process, a port held by another process, a snapshot that is not fetched and
    verified (unless ``allow_unfetched``: a download comes first). ``facts``:
    vllm_service_facts' result; ``gpus``: gpu_ready's (empty for a CPU slot); ``s``: as
    settings_problems, plus accel (cuda or cpu) and parallel."""
    if s.get("action") != "deploy":
        return []
    problems = []
    model, host, parallel = s.get("model"), s.get("host"), int(s.get("parallel") or 1)
    have = len((gpus or {}).get("gpus") or [])
    if s.get("accel") == "cuda" and have < parallel:
        problems.append("vllm_service: refusing to deploy '%s' on %s: its vllm_args need %d GPUs (tensor x "
                        "pipeline x data parallel) and the host has %d. Lower the parallel sizes or deploy it "
                        "on a larger host; nothing was changed." % (model, host, parallel, have))
    if s.get("accel") == "cpu" and parallel != 1:
        reason = ((gpus or {}).get("nvml") or {}).get("reason") or "vllm_service_accelerator=cpu"
        problems.append("vllm_service: refusing to deploy '%s' on %s: the host has no NVIDIA GPU (%s), so it "
                        "serves on CPU, and its vllm_args ask for %d-way parallelism (tensor x pipeline x "
                        "data). This role serves CPU models as one process: set the parallel sizes to 1 or "
                        "deploy the model on a GPU host; nothing was changed." % (model, host, reason, parallel))
    snapshot = (facts or {}).get("snapshot") or {}
    if not snapshot.get("verified") and not allow_unfetched:
        problems.append("vllm_service: refusing to deploy '%s' on %s: %s. Nothing was changed."
                        % (model, host, snapshot.get("reason")))
    foreign = ((facts or {}).get("port") or {}).get("foreign") or []
    if foreign:
        problems.append("vllm_service: refusing to deploy on %s:%s: the port is held by a process outside %s "
                        "(%s). Stop it, choose another vllm_service_port, or, when it is a vLLM server set up "
                        "by hand that this slot takes over, name its unit in vllm_service_replaces (it is "
                        "stopped and disabled at the swap); nothing was changed."
                        % (host, s.get("port"), s.get("unit"), "; ".join(f.get("text", "") for f in foreign)))
    return problems
