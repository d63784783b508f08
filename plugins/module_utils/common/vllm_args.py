# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""A catalog entry's ``vllm_args``: which flags it may set and the argv they render to.

Pure data and rules, below the store and the service: the catalog judges an entry with them
(common/catalog.py) and the unit renders the same argv (serving/vllm_unit.py).

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
    "headless": "a node runs headless when it is a worker of a replica group "
                "(modelswap_replica_groups: every node but the first)",
    "nnodes": "a replica group (modelswap_replica_groups) sets the number of nodes",
    "node_rank": "a replica group (modelswap_replica_groups) sets each node's rank from its order",
    "master_addr": "a replica group (modelswap_replica_groups) sets the head's address",
    "master_port": "set master_port on the replica group (modelswap_replica_groups)",
    "distributed_timeout_seconds": "set distributed_timeout on the replica group "
                                   "(modelswap_replica_groups)",
    "grpc": "the gRPC server replaces the HTTP API whose routes the role guards and probes",
    "shutdown_timeout": "use vllm_service_shutdown_timeout: the unit's TimeoutStopSec "
                        "(vllm_service_stop_timeout) is checked against the drain",
    "middleware": "the role adds its route guard (vllm_service_guard_routes); other middleware "
                  "could answer before it",
}
# The full-string rules (re.fullmatch, or \Z: "$" also matches before a trailing newline).
KEY_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
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


def parallel_size(vllm_args) -> int:
    """GPUs one replica set needs: tensor x pipeline x data parallel sizes."""
    vllm_args = vllm_args or {}
    total = 1
    for key in PARALLEL_KEYS:
        total *= int(vllm_args.get(key) or 1)
    return total
