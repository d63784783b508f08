# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The vLLM command line and the systemd syntax of its unit and environment files.

A catalog entry's ``vllm_args`` (``{tensor_parallel_size: 8, enable_expert_parallel: true, ...}``)
becomes the argv of ``vllm serve <snapshot path>``; the argv becomes a systemd ``ExecStart=``
value; environment variables become ``EnvironmentFile=`` lines. Pure functions, used by the
role's filters (plugins/filter/vllm_service.py) and unit-tested directly.

Rules of the argv rendering (documented in roles/vllm_service/README.md):

- ``key: value`` -> ``--key-with-dashes value``; ``true`` -> ``--flag``; ``false`` and ``null`` ->
  nothing (vLLM's default; pass ``--no-flag`` through ``extra_args`` where vLLM has one);
  a list -> ``--key v1 v2`` (argparse ``nargs``); a mapping -> ``--key '<JSON>'``.
- Known arguments come first in a fixed, readable order; the rest follow sorted by name, so the
  rendering (and the unit's checksum) depends only on the content.
- ``extra_args`` (a list of strings) is appended verbatim, after a check of its flags.
- The role owns the model path, ``--host``, ``--port`` and ``--served-model-name``; the API key
  never goes on a command line (the environment file carries it). Those flags (and the others
  of ``RESERVED``) are refused in ``vllm_args`` and in ``extra_args`` in every spelling vLLM's
  parser accepts: ``--x y``, ``--x=y``, ``--x.k v`` (its dotted JSON form), underscores for
  dashes (``--api_key``), and unambiguous abbreviations (argparse's ``allow_abbrev``:
  ``--api-k`` is ``--api-key``).

Every value of the role's settings that reaches the unit file is checked here too
(``unit_problems``; a catalog entry's values: module_utils/common/catalog.py): names and paths are restricted to safe characters with full-string rules, so
no newline, ``%`` specifier or quote can add a directive to the unit or a line to an
environment file.
"""
from __future__ import annotations

import json
import re

# Arguments rendered first, in this order (the example fleet's flags and the common ones).
ORDER = (
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    "enable_expert_parallel", "max_model_len", "gpu_memory_utilization", "max_num_seqs",
    "max_num_batched_tokens", "dtype", "quantization", "kv_cache_dtype", "trust_remote_code",
    "enforce_eager",
)
# Set by the role, never by a catalog entry (vllm_args keys and extra_args flags alike).
RESERVED = {
    "model": "the snapshot path is the role's (vllm_service_snapshot_path / the fetched snapshot)",
    "host": "use vllm_service_host",
    "port": "use vllm_service_port",
    "served_model_name": "set served_model_name on the catalog entry, not in vllm_args",
    "api_key": "a key on the command line leaks into process lists and logs; use vllm_service_api_key",
    "revision": "the snapshot path already pins the commit",
    "download_dir": "the host serves a verified local snapshot; it never downloads at start",
    "config": "a YAML file of arguments would set what the role owns (host, port, API key) "
              "unseen; put the arguments in vllm_args",
    "uds": "a Unix socket replaces vllm_service_host/vllm_service_port, which the readiness "
           "probe and the benchmark use",
    "headless": "a headless vLLM serves no API; the role serves one slot with an API server",
    "grpc": "the gRPC server replaces the HTTP API whose routes the role guards and probes",
    "middleware": "the role adds its route guard (vllm_service_guard_routes); other middleware "
                  "could answer before it",
}
# The full-string rules (re.fullmatch, or \Z: "$" also matches before a trailing newline).
KEY_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


class ArgsError(ValueError):
    """A catalog entry or environment that cannot be rendered (message is final)."""


def flag_name(word):
    """The option name vLLM's parser reads from an argv word, or None for a value or a
    positional: ``--api_key=x`` -> ``api-key``; ``--hf-overrides.rope.factor`` -> ``hf-overrides``
    (FlexibleArgumentParser: underscores become dashes before the first ``.``, ``=`` ends it)."""
    word = str(word)
    if not word.startswith("--") or word == "--":
        return None
    return word[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-").lower()


def reserved_flag(name):
    """The RESERVED key an option name sets, or None. An abbreviation counts: argparse takes
    any unambiguous prefix of a long option (``--api-k`` is ``--api-key``, ``--hos`` ``--host``)."""
    if not name:
        return None
    for key in RESERVED:
        if key.replace("_", "-").startswith(name):
            return key
    return None


def _refuse_reserved(where, name):
    """Refuse a reserved flag, naming it but never its value (it may be a key)."""
    key = reserved_flag(name)
    if key is None:
        return
    flag = "--" + key.replace("_", "-")
    spelled = "" if name == key.replace("_", "-") else " (vLLM reads --%s as %s)" % (name, flag)
    raise ArgsError("%s sets %s%s, which the role owns: %s. Remove it from the catalog entry"
                    % (where, flag, spelled, RESERVED[key]))


def _scalar(key, value):
    if isinstance(value, bool):  # pragma: no cover - handled by the caller
        raise AssertionError(key)
    if isinstance(value, float):
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if "\n" in value or "\x00" in value:
            raise ArgsError("vllm_args.%s contains a newline or NUL; a unit's ExecStart cannot "
                            "carry it" % key)
        return value
    raise ArgsError("vllm_args.%s has a value of type %s; use a string, number, boolean, list "
                    "or mapping" % (key, type(value).__name__))


def vllm_args_argv(vllm_args) -> list:
    """The flags of a catalog entry's ``vllm_args`` mapping (``extra_args`` appended)."""
    if vllm_args is None:
        vllm_args = {}
    if not isinstance(vllm_args, dict):
        raise ArgsError("vllm_args must be a mapping of vLLM argument names to values, got %s"
                        % type(vllm_args).__name__)
    extra = vllm_args.get("extra_args") or []
    if isinstance(extra, str) or not isinstance(extra, list) or \
            not all(isinstance(x, str) for x in extra):
        raise ArgsError("vllm_args.extra_args must be a list of strings (one argv word each), "
                        "e.g. ['--tool-call-parser', 'kimi_k2']")
    for index, word in enumerate(extra):
        if "\n" in word or "\r" in word or "\x00" in word:
            raise ArgsError("vllm_args.extra_args[%d] contains a newline or NUL; a unit's "
                            "ExecStart cannot carry it" % index)
        _refuse_reserved("vllm_args.extra_args[%d]" % index, flag_name(word))
    keys = [k for k in vllm_args if k != "extra_args"]
    for key in keys:
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise ArgsError("vllm_args key %r is not a vLLM argument name (lower_snake_case, "
                            "e.g. max_model_len)" % (key,))
        if key in RESERVED:
            raise ArgsError("vllm_args.%s is not allowed: %s" % (key, RESERVED[key]))
        _refuse_reserved("vllm_args.%s" % key, key.replace("_", "-"))
    for key in PARALLEL_KEYS:
        value = vllm_args.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ArgsError("vllm_args.%s must be a positive integer, got %r" % (key, value))
    gmu = vllm_args.get("gpu_memory_utilization")
    if gmu is not None and (isinstance(gmu, bool) or not isinstance(gmu, (int, float))
                            or not 0 < gmu <= 1):
        raise ArgsError("vllm_args.gpu_memory_utilization must be a fraction in (0, 1], got %r"
                        % (gmu,))
    ordered = [k for k in ORDER if k in vllm_args] + sorted(k for k in keys if k not in ORDER)
    argv = []
    for key in ordered:
        value = vllm_args[key]
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value, sort_keys=True, separators=(",", ":"))]
        elif isinstance(value, list):
            if not value:
                continue
            argv.append(flag)
            argv += [_scalar(key, v) for v in value]
        else:
            argv += [flag, _scalar(key, value)]
    return argv + list(extra)


def serve_argv(vllm_bin, model_path, served_model_name, host, port, vllm_args=None,
               middleware=None) -> list:
    """``[vllm, serve, PATH, --host, H, --port, P, --served-model-name, N, <vllm_args>]``, and
    ``--middleware M`` (the role's route guard) before the catalog's arguments when given."""
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
    return [str(vllm_bin), "serve", str(model_path), "--host", str(host), "--port", str(port),
            "--served-model-name", str(served_model_name)] + guard + vllm_args_argv(vllm_args)


def parallel_size(vllm_args) -> int:
    """GPUs one replica set needs: tensor x pipeline x data parallel sizes."""
    vllm_args = vllm_args or {}
    total = 1
    for key in PARALLEL_KEYS:
        total *= int(vllm_args.get(key) or 1)
    return total


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


def systemd_exec(argv) -> str:
    """An argv list as an ``ExecStart=`` value (the first word must be an absolute path)."""
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
    {"parallel", "enforce_eager", "gpu_memory_utilization"}."""
    argv = [str(a) for a in (argv or [])]
    sizes = {}
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
    parallel = 1
    for size in sizes.values():
        parallel *= max(1, size)
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
    host, hardening, env (the layers merged), and, when ``guard`` is true, guard_dir and
    open_routes (guard_env's rules); a missing key is not checked."""
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
        problems.append(str(exc))
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
