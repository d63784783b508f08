# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""What disk_plan and model_purge share on the host: options, the store, the served model.

Thin glue between the modules' options and the pure planners (store_scan, disk_plan,
served_model): validates the store folders, scans them, reads the deployment record and the
vLLM unit, and builds the protections. It takes plain values (the options as a dict, a
command_runner.HostCommands), not the AnsibleModule: every failure raises StoreError with a
message that names the action, the object, the cause and the fix (the module fails with it), and
warnings are collected on the state host_state returns (the module warns with them).
"""
from __future__ import annotations

import os
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import target_listing
from ansible_collections.modelswap.vllm.plugins.module_utils.store import compile_cache
from ansible_collections.modelswap.vllm.plugins.module_utils.store import disk_plan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import plan_inputs
from ansible_collections.modelswap.vllm.plugins.module_utils.store import protections
from ansible_collections.modelswap.vllm.plugins.module_utils.store import target_needs
from ansible_collections.modelswap.vllm.plugins.module_utils.store import store_scan
from ansible_collections.modelswap.vllm.plugins.module_utils.common import procfs
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import served_model
from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import nearest_existing

DEFAULT_RECORD = "/var/lib/modelswap/deployment.json"


class StoreError(Exception):
    """The store or the host's state cannot be read; the message is final (the module fails with it)."""


# Options both modules take (their DOCUMENTATION describes each).
STORE_ARGS = dict(
    cache_dir=dict(type="path"),
    models_dir=dict(type="path"),
    models=dict(type="dict", default={}),
    target=dict(type="str"),
    keep=dict(type="list", elements="str", default=[]),
    served=dict(type="str"),
    deployment_record=dict(type="path", default=DEFAULT_RECORD),
    vllm_unit=dict(type="str", default="vllm.service"),
    protect_paths=dict(type="list", elements="path", default=[]),
    allow_served_purge=dict(type="bool", default=False),
    scan_workers=dict(type="int", default=1),
)
# disk_plan's planning options beyond the store's (migrate_facts plans with them too).
PLAN_ARGS = dict(
    headroom=dict(type="str", default="5%"),
    candidates=dict(type="list", elements="str"),
    clean_orphans=dict(type="bool", default=True),
    download_rate=dict(type="str"),
    allow_missing_store=dict(type="bool", default=False),
    compile_cache_root=dict(type="path"),
)


def fs_info(path: str) -> dict:
    st = os.statvfs(path)
    return {
        "path": path,
        "total_bytes": st.f_blocks * st.f_frsize,
        "free_bytes": st.f_bfree * st.f_frsize,
        "available": st.f_bavail * st.f_frsize,
        "available_bytes": st.f_bavail * st.f_frsize,
        "block_size": st.f_frsize,
        "device": os.stat(path).st_dev,
    }


def option_problem(params: dict) -> str:
    """Why the options both modules share are unusable (names the option and the fix), or ''."""
    if params.get("scan_workers") is not None and params["scan_workers"] < 1:
        return "scan_workers must be 1 or more (threads that scan the cache), got %d" % params["scan_workers"]
    for path in params.get("protect_paths") or ():
        if not os.path.isabs(path):
            return ("protect_paths entry %r is not an absolute path, so it would protect nothing; write "
                    "the full path" % path)
    return ""


def store_dirs(params: dict, action: str):
    """(cache_dir, models_dir) as real paths; StoreError when neither is given or one is not a folder."""
    why = option_problem(params)
    if why:
        raise StoreError("%s: %s (nothing was changed)" % (action, why))
    if not params["cache_dir"] and not params["models_dir"]:
        raise StoreError("%s needs a model store: set cache_dir (a Hugging Face hub cache) and/or "
                         "models_dir (a folder of model directories)" % action)
    out = []
    for key in ("cache_dir", "models_dir"):
        path = params[key]
        if not path:
            out.append("")
            continue
        if not os.path.exists(path) and params.get("allow_missing_store"):
            out.append("")   # planned as empty: an earlier step of the same run creates it
            continue
        if not os.path.exists(path):
            raise StoreError("%s: %s %s does not exist; create it or fix the path (nothing was "
                             "changed)" % (action, key, path))
        if not os.path.isdir(path):
            raise StoreError("%s: %s %s is not a directory; point it at the store's folder "
                             "(nothing was changed)" % (action, key, path))
        out.append(os.path.realpath(path))
    return out[0], out[1]


def store_fs_path(params: dict, store) -> str:
    """The folder whose file system holds the store (for a store still to be created, the
    nearest existing parent of its path)."""
    return store.cache_dir or store.models_dir or nearest_existing(params["cache_dir"] or params["models_dir"])


def scan(params: dict, action: str):
    """(the scanned store, seconds the scan took); StoreError when the options or the folders are unusable."""
    cache_dir, models_dir = store_dirs(params, action)
    started = time.monotonic()
    try:
        store = store_scan.scan_store(cache_dir, models_dir, workers=max(1, params["scan_workers"]))
    except OSError as exc:
        raise StoreError("%s: cannot scan the model store (%s); check permissions" % (action, exc))
    return store, time.monotonic() - started


def running_vllm_servers(proc: str = procfs.PROC) -> list:
    """The vLLM servers running on the host, whoever started them (served_by_processes()).
    Servers in containers are left out: their model paths are the container's."""
    processes = []
    for pid in procfs.pids(proc):
        argv = procfs.process_argv(pid, proc)
        if argv and served_model.is_vllm_server(argv) and not procfs.other_mount_namespace(pid, proc):
            processes.append((pid, argv, procfs.process_cwd(pid, proc)))
    return served_model.served_by_processes(processes)


def host_state(params: dict, store, action: str, commands, target_commit: str = "") -> dict:
    """build_protections() from the options, the deployment record, the vLLM unit (read with
    ``commands``, a HostCommands) and the vLLM servers running on the host (one started by hand
    serves a model too). Its ``warnings`` are for the module to show; StoreError when the record or
    the options cannot be used."""
    try:
        record = (served_model.read_deployment_record(params["deployment_record"])
                  if params["deployment_record"] else None)
    except served_model.ServedError as exc:
        raise StoreError("%s: %s" % (action, exc))
    unit = served_model.read_unit(commands, params["vllm_unit"])
    try:
        state = protections.build_protections(
            store, models=params["models"], target=params["target"], target_commit=target_commit,
            keep=params["keep"], served=params["served"], record=record,
            record_path=params["deployment_record"], unit=unit, unit_name=params["vllm_unit"],
            protect_paths=params["protect_paths"], processes=running_vllm_servers())
    except plan_inputs.PlanError as exc:
        raise StoreError("%s: %s (nothing was changed)" % (action, exc))
    state["warnings"] = []
    if not state["served"]["sources"]:
        state["warnings"].append(
            "%s: the served model is unknown (no deployment record at %s, no model in unit "
            "%s, no vLLM server running): nothing is protected as served"
            % (action, params["deployment_record"], params["vllm_unit"]))
    return state


def compile_caches_on(root, device: int, action: str) -> dict:
    """{repo folder: allocated bytes} of the vLLM cache folders under ``root`` (compile_cache) on the
    store's file system ``device`` (a cache elsewhere frees nothing the target can use); {} without
    a root."""
    if not root:
        return {}
    problem = compile_cache.root_problem(root)
    if problem:
        raise StoreError("%s: %s: give the folder of vLLM's caches, one per model, or leave "
                         "compile_cache_root out (nothing was changed)" % (action, problem))
    found = {}
    for entry in compile_cache.entries(root):
        try:
            on_store = os.lstat(entry["path"]).st_dev == device
        except OSError:
            continue
        if on_store:
            found[entry["folder"]] = entry["bytes"]
    return found


def plan(params: dict, action: str, commands, listing=None) -> tuple:
    """(disk_plan's result, warnings, the scanned store, the host's state): read the store, its file system, the target's files (listed
    from the Hub, or ``listing``: hf_snapshot's listing made elsewhere), what the host serves, then
    plan. ``params`` are disk_plan's options; StoreError or plan_inputs.PlanError when it cannot."""
    timings, warnings = {}, []
    rate = plan_inputs.parse_bytes(params["download_rate"], "download_rate") if params["download_rate"] else 0
    store, timings["scan_s"] = scan(params, action)
    fs = fs_info(store_fs_path(params, store))
    headroom = plan_inputs.parse_headroom(params["headroom"], fs["total_bytes"])
    entry = plan_inputs.catalog_entry(params["models"], params["target"], "target") if params["target"] else None
    started = time.monotonic()
    target, listed = read_target(
        store, entry, name=params["target"], target_bytes=params["target_bytes"], block_size=fs["block_size"],
        endpoint=params["endpoint"], token=params["token"], http_endpoint_trusted=params["http_endpoint_trusted"],
        listing=listing)
    timings["hub_s"] = time.monotonic() - started
    started = time.monotonic()
    state = host_state(params, store, action, commands, target_commit=target.get("commit") or "")
    warnings.extend(state["warnings"])
    result = disk_plan.disk_plan(
        store, fs, state, target=target, listed_files=listed["files"] if listed else [],
        candidates=params["candidates"], models=params["models"], headroom_bytes=headroom, download_rate=rate,
        clean_orphans=params["clean_orphans"], allow_served_purge=params["allow_served_purge"],
        orphan_in_use=disk_plan.orphan_in_use(store),
        compile_caches=compile_caches_on(params.get("compile_cache_root"), fs["device"], action))
    timings["plan_s"] = time.monotonic() - started
    result["timings"] = {k: round(v, 4) for k, v in timings.items()}
    warnings.extend(disk_plan.store_warnings(store))
    return result, warnings, store, state


def read_target(store, entry, *, name, target_bytes, block_size: int, endpoint=None, token=None,
                http_endpoint_trusted: bool = False, listing=None) -> tuple:
    """(target, listed): the target as disk_plan reports it (plan_target plus target_needs) and
    its listing (list_target's, or ``listing`` made elsewhere; None when ``target_bytes`` says
    what it needs)."""
    listed = None
    if target_bytes is None and listing is not None:
        listed = target_listing.given_listing(entry, listing)
    elif target_bytes is None:
        listed = target_listing.list_target(
            entry["repo_id"], entry["revision"], cache_dir=store.cache_dir, endpoint=endpoint,
            token=token, allow_patterns=entry["allow_patterns"], ignore_patterns=entry["ignore_patterns"],
            http_endpoint_trusted=http_endpoint_trusted)
    target = target_needs.plan_target(entry, name, target_bytes, listed)
    if listed is not None:
        target.update(target_needs.target_needs(store, entry["repo_id"], listed["commit"], listed["files"], block_size))
    return target, listed
