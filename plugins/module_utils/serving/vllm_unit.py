# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The vLLM command line and the systemd syntax of its unit and environment files.

A catalog entry's ``vllm_args`` (``{tensor_parallel_size: 8, enable_expert_parallel: true, ...}``)
becomes the argv of ``vllm serve <snapshot path>``; the argv becomes a systemd ``ExecStart=``
value; environment variables become ``EnvironmentFile=`` lines. Pure functions, used by the
role's filters (plugins/filter/vllm_service.py) and unit-tested directly.

The argv rendering and its rules (which flags a catalog entry may set) are common/vllm_args.py's,
below the service, since the catalog judges an entry with them too.

Every value of the role's settings that reaches the unit file is checked here too
(``unit_problems``; a catalog entry's values: common/catalog.py): names and paths are
restricted to safe characters with full-string rules, so no newline, ``%`` specifier or quote can add a directive to the unit or a line to an
environment file.
"""
from __future__ import annotations

import re

from ansible_collections.modelswap.vllm.plugins.module_utils.common.vllm_args import ArgsError, vllm_args_argv

# A catalog entry's flag rules (ORDER, RESERVED, the argv) are common/vllm_args.py's.
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def serve_argv(vllm_bin, model_path, served_model_name, host, port, vllm_args=None,
               middleware=None, shutdown_timeout=0, node_flags=()) -> list:
    """``[vllm, serve, PATH, --host, H, --port, P, --served-model-name, N, <vllm_args>]``, and
    ``--middleware M`` (the role's route guard) and ``--shutdown-timeout S`` (vLLM's own drain on
    SIGTERM: in-flight requests finish within S seconds, new ones are refused; 0 leaves vLLM's
    default, which aborts them) before the catalog's arguments when given; ``node_flags`` (a
    replica group's node: serving/replica_group.serve_flags) last."""
    if not model_path or not str(model_path).startswith("/"):
        raise ArgsError("the model path must be an absolute path to the verified snapshot, got %r"
                        % (model_path,))
    if not served_model_name:
        raise ArgsError("a served model name is required")
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise ArgsError("port must be an integer, got %r" % (port,))
    if not 0 < port < 65536:
        raise ArgsError("port must be in 1..65535, got %d" % port)
    guard = ["--middleware", str(middleware)] if middleware else []
    drain = shutdown_seconds(shutdown_timeout)
    drain_args = ["--shutdown-timeout", str(drain)] if drain else []
    return [str(vllm_bin), "serve", str(model_path), "--host", str(host), "--port", str(port),
            "--served-model-name", str(served_model_name)] + guard + drain_args + vllm_args_argv(vllm_args) \
        + [str(flag) for flag in node_flags]


# Seconds vLLM's teardown may take after its drain (engine, workers, the HTTP server) before
# systemd's TimeoutStopSec kills what is left.
STOP_MARGIN_S = 30


def shutdown_seconds(value) -> int:
    """vllm_service_shutdown_timeout as whole seconds (>= 0); ArgsError otherwise."""
    if isinstance(value, bool):
        raise ArgsError("vllm_service_shutdown_timeout must be whole seconds >= 0, got %r" % (value,))
    try:
        seconds = int(str(value).strip())
    except (TypeError, ValueError):
        raise ArgsError("vllm_service_shutdown_timeout must be whole seconds >= 0, got %r" % (value,))
    if seconds < 0:
        raise ArgsError("vllm_service_shutdown_timeout must be whole seconds >= 0, got %d" % seconds)
    return seconds


def stop_problems(shutdown_timeout, stop_timeout) -> list:
    """Why the unit's stop cannot let vLLM drain: the drain's seconds must be whole and >= 0, and
    TimeoutStopSec must leave vLLM its teardown after the drain (STOP_MARGIN_S)."""
    try:
        drain = shutdown_seconds(shutdown_timeout)
    except ArgsError as exc:
        return [str(exc)]
    try:
        stop = int(str(stop_timeout).strip())
    except (TypeError, ValueError):
        return ["vllm_service_stop_timeout must be whole seconds, got %r" % (stop_timeout,)]
    if stop < drain + STOP_MARGIN_S:
        return ["vllm_service_stop_timeout (%d s) must be at least vllm_service_shutdown_timeout (%d s) "
                "+ %d s: systemd kills what is left after it, and vLLM's teardown follows its drain; "
                "raise vllm_service_stop_timeout or shorten the drain" % (stop, drain, STOP_MARGIN_S)]
    return []


_SAFE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+\Z")


def systemd_quote(word) -> str:
    """One argv word in systemd's ExecStart syntax (specifiers and $ escaped)."""
    word = str(word)
    if "\n" in word or "\x00" in word:
        raise ArgsError("an ExecStart word cannot contain a newline or NUL: %r" % word)
    if _SAFE_WORD.match(word):
        quoted = word
    else:
        quoted = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    # systemd expands %-specifiers everywhere and $VAR / ${VAR} in ExecStart.
    return quoted.replace("%", "%%").replace("$", "$$")


def systemd_exec(argv, why="") -> str:
    """An argv list as an ``ExecStart=`` value (the first word must be an absolute path);
    ``why``: the reason there is no argv, said when there is none."""
    if not argv and why:
        raise ArgsError("no vllm serve command line: %s" % why)
    if not argv or not str(argv[0]).startswith("/"):
        raise ArgsError("ExecStart needs an absolute path to the program, got %r"
                        % (argv[0] if argv else None,))
    return " ".join(systemd_quote(w) for w in argv)


def env_lines(env) -> list:
    """``KEY="value"`` lines for a systemd EnvironmentFile, sorted by name."""
    if env is None:
        return []
    if not isinstance(env, dict):
        raise ArgsError("an environment must be a mapping of names to values")
    lines = []
    for name in sorted(env):
        value = env[name]
        if not isinstance(name, str) or not ENV_NAME_RE.match(name):
            raise ArgsError("environment variable name %r is not valid (letters, digits and _; "
                            "not starting with a digit)" % (name,))
        if value is None:
            continue
        if isinstance(value, bool):
            value = "1" if value else "0"
        value = str(value)
        if "\n" in value or "\r" in value or "\x00" in value:
            raise ArgsError("environment variable %s contains a newline or NUL; an "
                            "EnvironmentFile cannot carry it" % name)
        lines.append('%s="%s"' % (name, value.replace("\\", "\\\\").replace('"', '\\"')))
    return lines


def merge_env(*layers) -> dict:
    """Later mappings override earlier ones; a ``null`` value removes a name."""
    out = {}
    for layer in layers:
        for name, value in (layer or {}).items():
            if value is None:
                out.pop(name, None)
            else:
                out[name] = value
    return out


def argv_settings(argv) -> dict:
    """What a rendered ``vllm serve`` argv says about its resources (for budgets and GPU checks):
    {"parallel", "enforce_eager", "gpu_memory_utilization"}; ``parallel`` is this host's share
    (the GPUs of one node when ``--nnodes`` spreads the model over a replica group)."""
    argv = [str(a) for a in (argv or [])]
    sizes = {}
    nnodes = 1
    gmu = 0.9
    for i, word in enumerate(argv):
        key, eq, inline = word.partition("=")
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
        if key in ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                   "--data-parallel-size", "-dp"):
            try:
                sizes[key.lstrip("-")[0]] = int(value)
            except (TypeError, ValueError):
                pass
        elif key == "--gpu-memory-utilization":
            try:
                gmu = float(value)
            except (TypeError, ValueError):
                pass
        elif key == "--nnodes":
            try:
                nnodes = max(1, int(value))
            except (TypeError, ValueError):
                pass
    parallel = 1
    for size in sizes.values():
        parallel *= max(1, size)
    parallel = max(1, parallel // nnodes)
    return {"parallel": parallel, "enforce_eager": "--enforce-eager" in argv,
            "gpu_memory_utilization": gmu}


RUNNING_STATES = ("active", "activating", "reloading")


def units_to_replace(units) -> list:
    """Of vllm_service_facts' ``replaces`` (unit states), those a swap must stop or disable: loaded
    and running, or loaded and enabled (it would start at the next boot). Running ones first.
    A unit that is gone, or already stopped and disabled, is left alone."""
    loaded = [u for u in units or () if u.get("loaded")]
    running = [u for u in loaded if u.get("active_state") in RUNNING_STATES]
    return running + [u for u in loaded if u not in running and u.get("unit_file_state") == "enabled"]


# --- Values that reach the unit file and the route guard -----------------------------------------

# The role's route guard (roles/vllm_service/files/modelswap_vllm_guard.py), loaded by vLLM's
# --middleware option from a folder the role puts on the service's PYTHONPATH.
GUARD_MODULE = "modelswap_vllm_guard"
GUARD_MIDDLEWARE = GUARD_MODULE + ".RequireApiKey"
# Routes that may answer without the key: probes that run no inference and change nothing
# (/health and /metrics for vllm_ready and the benchmark, /ping, /version, /load).
OPEN_ROUTE_CHOICES = ("/health", "/ping", "/metrics", "/version", "/load")
UNIT_RE = re.compile(r"[A-Za-z0-9@_.:-]+[.]service\Z")
ACCOUNT_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}\Z")
PATH_RE = re.compile(r"/(?:[A-Za-z0-9._@+-]+/?)*\Z")
HOST_RE = re.compile(r"[A-Za-z0-9._:-]+\Z")
OPTION_RE = re.compile(r"[A-Z][A-Za-z]*\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def unit_problems(settings) -> list:
    """What makes the role's own settings unsafe to write into the unit or its environment files,
    one sentence each (empty: safe). ``settings``: unit, replaces, user, group, home, config_dir,
    host, hardening, env (the layers merged), shutdown_timeout with stop_timeout (stop_problems),
    and, when ``guard`` is true, guard_dir and open_routes (guard_env's rules); a missing key is
    not checked."""
    problems = []
    get = settings.get
    if "unit" in settings and not (isinstance(get("unit"), str) and UNIT_RE.match(get("unit"))):
        problems.append("vllm_service_unit %r is not a unit name (letters, digits, '@', '_', "
                        "'.', ':', '-', ending in .service)" % (get("unit"),))
    for unit in get("replaces") or ():
        if not isinstance(unit, str) or not UNIT_RE.match(unit):
            problems.append("vllm_service_replaces entry %r is not a unit name ending in .service"
                            % (unit,))
    for key in ("user", "group"):
        if key in settings and not (isinstance(get(key), str) and ACCOUNT_RE.match(get(key))):
            problems.append("vllm_service_%s %r is not an account name (lower-case letters, "
                            "digits, '_', '-'; at most 32)" % (key, get(key)))
    for key in ("home", "config_dir"):
        if key in settings and not (isinstance(get(key), str) and PATH_RE.match(get(key))):
            problems.append("vllm_service_%s %r is not an absolute path of letters, digits and "
                            "'.', '_', '@', '+', '-' (it is written into the unit file)"
                            % (key, get(key)))
    if "host" in settings and not (isinstance(get("host"), str) and HOST_RE.match(get("host"))):
        problems.append("vllm_service_host %r is not an address or host name" % (get("host"),))
    if "shutdown_timeout" in settings:
        problems.extend(stop_problems(get("shutdown_timeout"), get("stop_timeout")))
    for option, value in sorted((get("hardening") or {}).items(), key=lambda kv: str(kv[0])):
        if not isinstance(option, str) or not OPTION_RE.match(option):
            problems.append("vllm_service_hardening option %r is not a systemd option name"
                            % (option,))
        elif value is not None and (_CONTROL.search(str(value)) or str(value).endswith("\\")):
            problems.append("vllm_service_hardening.%s has a newline, control character or "
                            "trailing backslash; a unit line cannot carry it" % option)
    env = get("env") or {}
    try:
        env_lines(env)
    except ArgsError as exc:
        problems.append("vllm_service_env / vllm_service_nccl_env: %s" % exc
                        if not isinstance(env, dict) else str(exc))
    if not isinstance(env, dict):
        return problems
    if env.get("VLLM_API_KEY") is not None:
        problems.append("VLLM_API_KEY is set in vllm_service_env/vllm_service_nccl_env: the key "
                        "has a 0600 file of its own; set vllm_service_api_key instead")
    if get("guard"):
        try:
            guard_env(env, get("guard_dir"), get("open_routes"))
        except ArgsError as exc:
            problems.append(str(exc))
    return problems


def _truthy(value) -> bool:
    return str(value).strip().lower() not in ("", "0", "false", "no", "off", "none")


def guard_env(env, directory, routes) -> dict:
    """The service environment with the route guard: its folder first on PYTHONPATH and
    MODELSWAP_VLLM_OPEN_ROUTES. vLLM's Rust front end does not run Python middleware, so
    VLLM_USE_RUST_FRONTEND is refused while the guard is on."""
    env = dict(env or {})
    if _truthy(env.get("VLLM_USE_RUST_FRONTEND", "")):
        raise ArgsError("VLLM_USE_RUST_FRONTEND is set: vLLM's Rust front end does not run the "
                        "route guard, so every route but /v1 would answer without the key. "
                        "Remove it, or set vllm_service_guard_routes=false on purpose")
    if not isinstance(directory, str) or not PATH_RE.match(directory):
        raise ArgsError("the route guard's folder %r is not an absolute path" % (directory,))
    bad = [r for r in routes or () if r not in OPEN_ROUTE_CHOICES]
    if bad:
        raise ArgsError("vllm_service_open_routes may name only the probes %s, got %s"
                        % (", ".join(OPEN_ROUTE_CHOICES), ", ".join(map(str, bad))))
    if "/health" not in (routes or ()):
        raise ArgsError("vllm_service_open_routes must keep /health: the readiness probe "
                        "(vllm_ready) and load balancers read it without a key")
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = directory + (":" + str(path) if path else "")
    env["MODELSWAP_VLLM_OPEN_ROUTES"] = ",".join(routes or ())
    return env
