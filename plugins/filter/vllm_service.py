# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Filters of the vllm_service role: the vLLM command line and systemd syntax.

The logic lives in plugins/module_utils/serving/ (vllm_unit.py, vllm_service_checks.py,
vllm_service_settings.py; unit-tested there); these are thin wrappers that
turn its errors into AnsibleFilterError.
"""
from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import replica_group
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_checks
from ansible_collections.modelswap.vllm.plugins.module_utils.common import vllm_args as vllm_args_rules
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_facts
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_settings as settings


def _wrap(func):
    def run(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except vllm_unit.ArgsError as exc:
            raise AnsibleFilterError(str(exc))
    run.__name__ = func.__name__
    run.__doc__ = func.__doc__
    return run


def vllm_serve_argv(vllm_args, vllm_bin, model_path, served_model_name, host, port, middleware=None):
    """The argv of ``vllm serve`` for a catalog entry's vllm_args (and the route guard)."""
    return vllm_unit.serve_argv(vllm_bin, model_path, served_model_name, host, port, vllm_args,
                                middleware=middleware)


def vllm_unit_problems(settings):
    """Why the role's settings cannot be written into the unit (a list; empty: they can)."""
    return vllm_unit.unit_problems(settings)


def vllm_guard_env(env, directory, routes):
    """The service environment with the route guard on PYTHONPATH and its open routes."""
    return vllm_unit.guard_env(env, directory, routes)


def vllm_parallel_size(vllm_args):
    """tensor x pipeline x data parallel size of a catalog entry's vllm_args."""
    return vllm_args_rules.parallel_size(vllm_args)


def systemd_exec(argv, why=""):
    """An argv list as a systemd ExecStart= value (``why``: why there is none, when it is empty)."""
    return vllm_unit.systemd_exec(argv, why)


def systemd_env_lines(env):
    """A mapping as sorted KEY="value" lines of a systemd EnvironmentFile."""
    return vllm_unit.env_lines(env)


def vllm_argv_settings(argv):
    """Parallel size, enforce_eager and gpu_memory_utilization of a rendered vllm serve argv."""
    return vllm_unit.argv_settings(argv)


def vllm_units_to_replace(units):
    """The replaced units (vllm_service_facts' replaces) a swap stops or disables."""
    return vllm_unit.units_to_replace(units)


def merge_env(*layers):
    """Merge environment mappings; later ones win, a null value removes a name."""
    return vllm_unit.merge_env(*layers)


def vllm_service_problems(settings):
    """Why the role's settings (what ``vllm_service_layout`` judges) cannot be deployed: sentences in the
    order the role checks them (empty: they can)."""
    return vllm_service_checks.settings_problems(settings)


def vllm_service_host_problems(settings, facts, gpus=None, allow_unfetched=False):
    """Why this host cannot take the deployment (GPUs, port, snapshot), from vllm_service_facts'
    and gpu_ready's results; ``allow_unfetched``: the snapshot may still be missing (a download
    comes first)."""
    return vllm_service_checks.host_problems(settings, facts, gpus or {}, allow_unfetched=allow_unfetched)


def vllm_service_settings(inputs, read=None):
    """Every derived setting of the slot, computed once: ``inputs`` the role's variables
    (``__vllm_service_inputs``), ``read`` what is known of the host ({service, vllm, gpus}: a
    caller's vllm_service_read, or validate's reads; ``gpus`` may list several reads, the first
    that ran counts)."""
    read = read if isinstance(read, dict) else {}
    gpus = read.get("gpus")
    gpus = settings.pick_gpus(*gpus) if isinstance(gpus, list) else settings.pick_gpus(gpus)
    return settings.derive(inputs, settings.facts_of(read), gpus)


def vllm_service_layout(inputs):
    """The slot's layout before the host is read (the layout entry point's fact, less the API key
    file's checksum), with the refusals of the role's settings as ``problems``."""
    return settings.layout(inputs)


def replica_node(groups, hostname):
    """The host's node of its replica group (group, nodes, rank, head, headless, ...); None for a
    host in no group."""
    return replica_group.node(groups, hostname)


def replica_play_problems(groups, hostname, play_hosts):
    """Why the host's replica group cannot be changed in this play: nodes left out or unreachable."""
    return replica_group.play_problems(groups, hostname, play_hosts)


def replica_behind_problems(groups, hostname, hostvars, fact, values=None):
    """Why the host's replica group may not go on: a node whose ``fact`` (in hostvars) is not set in
    this run, or not one of ``values`` (a node whose failure was rescued stays in the play's batch)."""
    place = replica_group.node(groups, hostname)
    if place is None:
        return []
    reached = {}
    for name in place["nodes"]:
        host = hostvars[name] if name in hostvars else {}
        value = host.get(fact) if hasattr(host, "get") else None
        reached[name] = value is not None and (values is None or value in values)
    return replica_group.behind_problems(groups, hostname, reached)


class FilterModule:
    def filters(self):
        return {
            "vllm_serve_argv": _wrap(vllm_serve_argv),
            "replica_behind_problems": replica_behind_problems,
            "vllm_service_problems": vllm_service_problems,
            "vllm_service_restart_reasons": _wrap(vllm_service_facts.restart_reasons),
            "vllm_service_host_problems": vllm_service_host_problems,
            "vllm_parallel_size": _wrap(vllm_parallel_size),
            "systemd_exec": _wrap(systemd_exec),
            "systemd_env_lines": _wrap(systemd_env_lines),
            "merge_env": _wrap(merge_env),
            "vllm_argv_settings": _wrap(vllm_argv_settings),
            "vllm_units_to_replace": _wrap(vllm_units_to_replace),
            "vllm_unit_problems": _wrap(vllm_unit_problems),
            "vllm_guard_env": _wrap(vllm_guard_env),
            "vllm_service_settings": vllm_service_settings,
            "vllm_service_layout": vllm_service_layout,
            "replica_node": replica_node,
            "replica_play_problems": replica_play_problems,
        }
