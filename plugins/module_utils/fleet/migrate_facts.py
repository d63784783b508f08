# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Everything a migration's plan needs from one host, read in one call (the module migrate_info).

A fleet's controller pays tens of milliseconds of CPU per task per host, so the migrate role asks
each host once for: what it serves (deployment record, unit, port, the replaced units), what is
installed (the fingerprint the install step writes, else the virtualenv's own answer), whether
the unit and its environment files are the ones the controller would render (checksums; the API
key file only as a yes/no), the disk plan and what the download would fetch (from the listing
the controller made once for the fleet, so the host asks the Hub nothing). The module is a
shell around ``gather``; every piece is the logic its own module uses (vllm_service_info,
disk_plan, hf_snapshot), so the preview and the steps agree.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_errors
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_locks
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_facts
from ansible_collections.modelswap.vllm.plugins.module_utils.store import plan_inputs
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_purge
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import store_context

# The module that reports this read (plugins/modules/migrate_info.py): its errors name it.
ACTION = "migrate_info"
# Written by the vllm_service role's install step into the virtualenv once vLLM is proved there.
FINGERPRINT_NAME = "modelswap-install.json"


class ReadError(Exception):
    """The host cannot be read as asked; the message is final (the module fails with it)."""


def read_bytes(path: str):
    """A configuration file's bytes (None when absent): a unit, an environment file, a key file."""
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ReadError("%s: cannot read %s (%s); run with become" % (ACTION, path, exc))


def sha1_hex(data: bytes) -> str:
    """What Ansible's template and copy compare."""
    return hashlib.sha1(data).hexdigest()


def read_fingerprint(venv: str):
    """The install step's fingerprint in ``venv`` (a dict), or None when absent or unreadable."""
    try:
        with open(os.path.join(venv, FINGERPRINT_NAME)) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def install_facts(commands, venv: str, expected: dict) -> dict:
    """Whether ``venv`` holds the vLLM the install step would install.

    The fingerprint is one small file read; without it (a virtualenv made by hand, or by an
    older modelswap) the virtualenv's own python says which vLLM it has (one process)."""
    fingerprint = read_fingerprint(venv)
    binary = os.path.join(venv, "bin", "vllm")
    out = {"venv": venv, "fingerprint": fingerprint, "binary": binary,
           "exists": os.path.isfile(binary) and os.access(binary, os.X_OK)}
    if fingerprint is not None:
        out["version"], out["source"] = fingerprint.get("version"), "fingerprint"
    else:
        out["version"] = vllm_service_facts.vllm_facts(commands, venv, None)["version"]
        out["source"] = "virtualenv"
    wanted = {k: v for k, v in (expected or {}).items() if v not in (None, "")}
    out["matches"] = bool(out["exists"] and out["version"] == wanted.get("version") and (
        fingerprint is None or all(fingerprint.get(k) == v for k, v in wanted.items())))
    return out


# The unit, its environment file and the route guard are a few KiB: their texts come back with
# the read, so the preview's diffs are made on the controller without a second call per host.
TEXT_LIMIT = 256 * 1024


def text_of(data: bytes):
    """A configuration file's text for a diff (None when too large or not UTF-8)."""
    if len(data) > TEXT_LIMIT:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def config_facts(files, secret_path: str, secret_sha1: str) -> dict:
    """Checksums and texts of the slot's configuration files (one read each), and whether the API
    key file holds what the controller would write (a yes/no: its content and checksum are never
    returned)."""
    sums, texts = {}, {}
    for path in files:
        data = read_bytes(path)
        sums[path] = None if data is None else sha1_hex(data)
        if data is not None:
            texts[path] = text_of(data)
    matches = None
    if secret_path:
        data = read_bytes(secret_path)
        matches = data is not None and sha1_hex(data) == secret_sha1
    return {"sha1": sums, "text": texts, "secret_matches": matches}


def purge_items(disk: dict, all_listed: bool) -> list:
    """What a purge deletes: the plan's shortest prefix of candidates that makes the target fit,
    or every candidate (model_purge_all_listed)."""
    return [c["item"] for c in disk["candidates"]] if all_listed else list(disk["purge"])


def purge_facts(disk: dict, store, state, options: dict, store_params: dict):
    """What model_purge would delete for this plan (its check-mode result: items, bytes each
    frees, orphans, stale locks), or None when there is nothing to reclaim or purging is off."""
    items = purge_items(disk, options["all_listed"])
    reclaim = options["clean_orphans"] and disk["orphans"]["reclaimable_bytes"] > 0
    if not options["allowed"] or not (items or reclaim):
        return None
    try:
        plan = model_purge.plan_purge(
            store, state, roots=model_purge.purge_roots(store, None), items=items, models=store_params["models"],
            missing="fail", allow_served_purge=store_params["allow_served_purge"],
            unit_name=store_params["vllm_unit"], clean_orphans=options["clean_orphans"],
            clean_stale_locks=options["clean_orphans"])
    except model_purge.PurgeError as exc:
        raise ReadError("%s: %s" % (ACTION, exc))
    return dict(plan.result(), items=items)


def fetch_facts(entry: dict, listing: dict, *, cache_dir, local_dir, verify: str) -> dict:
    """What model_fetch's download would do, planned by hf_snapshot's own job from the given
    listing: no huggingface_hub, no request (the controller listed the commit). ``in_flight``: the
    download that holds the target's repository lock now (one a killed controller left running),
    which the download would follow; None when the lock is free."""
    job = hf_snapshot.SnapshotJob(
        entry["repo_id"], hf=None, revision=entry["revision"], resolved_commit=listing["commit"],
        listing=listing, cache_dir=cache_dir or None, local_dir=local_dir or None,
        allow_patterns=entry["allow_patterns"], ignore_patterns=entry["ignore_patterns"], verify=verify)
    try:
        job.setup()
        plan = job.plan()
    except hf_errors.FetchError as exc:
        raise ReadError("%s: planning the download of %s: %s" % (ACTION, entry["repo_id"], exc))
    return {"commit": job.commit, "snapshot_path": job.layout.snapshot(job.commit),
            "listing_source": job.listing_source, "verified": plan["noop"],
            "in_flight": hf_locks.lock_in_flight(job.layout.lock_path),
            "would_fetch": {"files": plan["fetch"], "bytes": plan["bytes_to_fetch"], "verify": plan["verify"]}}


def gather(params: dict, commands) -> dict:
    """The module's result from its option values; ReadError (or the pieces' own errors, turned
    into ReadError) when it must fail."""
    timings = {}
    started = time.monotonic()
    listing = params["listing"]
    models, target = params["store"]["models"], params["store"]["target"]
    try:
        entry = plan_inputs.catalog_entry(models, target, "target")
    except plan_inputs.PlanError as exc:
        raise ReadError("%s: %s" % (ACTION, exc))
    commit = listing["commit"] if isinstance(listing, dict) else None
    service_params = dict(params["service"], model={"name": target, "repo_id": entry["repo_id"],
                                                    "revision": commit or entry["revision"]})
    service_params.setdefault("venv", None)
    service_params.setdefault("binary", None)
    try:
        service = vllm_service_facts.gather(service_params, commands)
    except vllm_service_facts.FactsError as exc:
        raise ReadError(str(exc))
    timings["service_s"] = time.monotonic() - started

    started = time.monotonic()
    install = install_facts(commands, params["install"]["venv"], params["install"]["expected"])
    config = config_facts(params["config"]["files"], params["config"]["secret_path"],
                          params["config"]["secret_sha1"])
    timings["install_config_s"] = time.monotonic() - started

    started = time.monotonic()
    store_params = dict(params["store"], target_bytes=None, endpoint=None, token=None, http_endpoint_trusted=False)
    try:
        disk, warnings, store, state = store_context.plan(store_params, ACTION, commands, listing=listing)
    except store_context.StoreError as exc:
        raise ReadError(str(exc))
    except plan_inputs.PlanError as exc:
        raise ReadError("%s: %s" % (ACTION, exc))
    timings["disk_s"] = time.monotonic() - started
    started = time.monotonic()
    purge = purge_facts(disk, store, state, params["purge"], store_params)
    timings["purge_s"] = time.monotonic() - started

    started = time.monotonic()
    fetch = None
    store_ready = bool(store_params["cache_dir"] and os.path.isdir(store_params["cache_dir"])
                       or params["fetch"]["local_dir"])
    if listing is not None and store_ready:
        fetch = fetch_facts(entry, listing, cache_dir=store_params["cache_dir"],
                            local_dir=params["fetch"]["local_dir"], verify=params["fetch"]["verify"])
    elif listing is not None:     # the store is still to be created: everything is to fetch
        files = disk.get("target", {})
        fetch = {"commit": commit, "snapshot_path": None, "listing_source": "given", "verified": False,
                 "would_fetch": {"files": sorted(listing["files"]), "verify": [],
                                 "bytes": files.get("download_bytes", 0)}}
    timings["fetch_s"] = time.monotonic() - started
    return {"changed": False, "service": service, "install": install, "config": config,
            "disk": disk, "purge": purge, "fetch": fetch, "warnings": warnings,
            "timings": {k: round(v, 4) for k, v in timings.items()}}
