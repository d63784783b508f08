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
- ``extra_args`` (a list of strings) is appended verbatim.
- The role owns the model path, ``--host``, ``--port`` and ``--served-model-name``; the API key
  never goes on a command line (the environment file carries it). Those keys are refused in
  ``vllm_args``.
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
# Set by the role, never by a catalog entry.
RESERVED = {
    "model": "the snapshot path is the role's (vllm_service_snapshot_path / the fetched snapshot)",
    "host": "use vllm_service_host",
    "port": "use vllm_service_port",
    "served_model_name": "set served_model_name on the catalog entry, not in vllm_args",
    "api_key": "a key on the command line leaks into process lists and logs; use vllm_service_api_key",
    "revision": "the snapshot path already pins the commit",
    "download_dir": "the host serves a verified local snapshot; it never downloads at start",
}
KEY_RE = re.compile(r"^[a-z][a-z0-9_]*$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


class ArgsError(ValueError):
    """A catalog entry or environment that cannot be rendered (message is final)."""


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
    keys = [k for k in vllm_args if k != "extra_args"]
    for key in keys:
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise ArgsError("vllm_args key %r is not a vLLM argument name (lower_snake_case, "
                            "e.g. max_model_len)" % (key,))
        if key in RESERVED:
            raise ArgsError("vllm_args.%s is not allowed: %s" % (key, RESERVED[key]))
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


def serve_argv(vllm_bin, model_path, served_model_name, host, port, vllm_args=None) -> list:
    """``[vllm, serve, PATH, --host, H, --port, P, --served-model-name, N, <vllm_args>]``."""
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
    return [str(vllm_bin), "serve", str(model_path), "--host", str(host), "--port", str(port),
            "--served-model-name", str(served_model_name)] + vllm_args_argv(vllm_args)


def parallel_size(vllm_args) -> int:
    """GPUs one replica set needs: tensor x pipeline x data parallel sizes."""
    vllm_args = vllm_args or {}
    total = 1
    for key in PARALLEL_KEYS:
        total *= int(vllm_args.get(key) or 1)
    return total


_SAFE_WORD = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


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
