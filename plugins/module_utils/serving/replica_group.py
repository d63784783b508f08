# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Replica groups: several hosts that serve one model together (vLLM's multi-node
multiprocessing backend), judged and rendered from ``modelswap_replica_groups``.

The inventory names each group once, its nodes in order::

    modelswap_replica_groups:
      kimi-fp8:
        nodes: [gpu-a01, gpu-a02]     # node rank 0 (the first) runs the API server
        master_port: 29501            # the head's torch rendezvous port (optional)
        distributed_timeout: 600      # seconds a node waits for the others (optional)

Node rank 0, the head, runs ``vllm serve`` with its API; every other node runs ``--headless``.
Every node gets ``--nnodes``, ``--node-rank``, ``--master-addr`` (the head's address),
``--master-port`` and ``--distributed-timeout-seconds`` (without it a head whose worker never
comes waits gloo's 30 minutes with its port closed), and ``VLLM_HOST_IP`` = its own address (vLLM
binds its message queues there). docs/multinode.md has the measurements behind these rules.

Pure functions; ``problems`` never raises and every sentence names the fix.
"""
from __future__ import annotations

import ipaddress
import re

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
IFNAME_RE = re.compile(r"[A-Za-z0-9_.:@-]{1,15}\Z")
KEYS = ("nodes", "master_port", "distributed_timeout")
DEFAULT_MASTER_PORT = 29501
# Long enough for the slowest node to load its share of a large model from local disk before the
# first collective; a worker that never comes fails the head after it (not after 30 minutes).
DEFAULT_DISTRIBUTED_TIMEOUT = 600
PROBLEM_PREFIX = "modelswap_replica_groups: "
FIX = " Nothing was changed."


def _int(value):
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def group_problems(groups) -> list:
    """Why the groups mapping cannot be used (the whole inventory's, not one host's)."""
    if groups is None or groups == {}:
        return []
    if not isinstance(groups, dict):
        return [PROBLEM_PREFIX + "must be a mapping of group name -> {nodes: [host, ...]}, got %s."
                % type(groups).__name__ + FIX]
    problems, seen = [], {}
    for name, group in groups.items():
        where = PROBLEM_PREFIX + "group %r" % (name,)
        if not isinstance(name, str) or not NAME_RE.match(name):
            problems.append(where + " is not a usable name (letters, digits, '_', '.', '-')." + FIX)
            continue
        if not isinstance(group, dict):
            problems.append(where + " must be a mapping with `nodes: [head, worker, ...]`, got %s."
                            % type(group).__name__ + FIX)
            continue
        unknown = sorted(str(k) for k in group if k not in KEYS)
        if unknown:
            problems.append(where + " has unknown keys %s (known: %s)." % (", ".join(unknown), ", ".join(KEYS)) + FIX)
        nodes = group.get("nodes")
        if not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
            problems.append(where + ": `nodes` must be a list of inventory host names, the head first." + FIX)
            continue
        if len(nodes) < 2:
            problems.append(where + " has %d node; a group serves one model across two or more hosts "
                            "(a single host needs no group)." % len(nodes) + FIX)
        if len(set(nodes)) != len(nodes):
            problems.append(where + " lists a node twice: %s." % ", ".join(sorted({n for n in nodes if nodes.count(n) > 1})) + FIX)
        for node in dict.fromkeys(nodes):
            if node in seen:
                problems.append(PROBLEM_PREFIX + "%s is a node of both %r and %r; a host serves one group. "
                                "Remove it from one of them." % (node, seen[node], name) + FIX)
            else:
                seen[node] = name
        port = group.get("master_port", DEFAULT_MASTER_PORT)
        if _int(port) is None or not 0 < _int(port) < 65536:
            problems.append(where + ": master_port must be a TCP port (1..65535), got %r." % (port,) + FIX)
        timeout = group.get("distributed_timeout", DEFAULT_DISTRIBUTED_TIMEOUT)
        if _int(timeout) is None or _int(timeout) < 1:
            problems.append(where + ": distributed_timeout must be a positive number of seconds, got %r."
                            % (timeout,) + FIX)
    return problems


def node(groups, hostname):
    """This host's place in its group: {group, nodes, rank, nnodes, head, headless, master_port,
    distributed_timeout}; None for a host in no group or when the groups are refused."""
    return None if group_problems(groups) else _place(groups, hostname)


def _place(groups, hostname):
    """node() for groups group_problems accepted."""
    for name, group in (groups or {}).items():
        nodes = group["nodes"]
        if hostname in nodes:
            rank = nodes.index(hostname)
            return {
                "group": name,
                "nodes": list(nodes),
                "rank": rank,
                "nnodes": len(nodes),
                "head": nodes[0],
                "headless": rank > 0,
                "master_port": _int(group.get("master_port", DEFAULT_MASTER_PORT)),
                "distributed_timeout": _int(group.get("distributed_timeout", DEFAULT_DISTRIBUTED_TIMEOUT)),
            }
    return None


def places(groups, hosts) -> dict:
    """{host: node(groups, host)} for many hosts, the groups judged once (not once per host)."""
    valid = not group_problems(groups)
    return {host: _place(groups, host) if valid else None for host in hosts or []}


def rollout_units(groups, hosts) -> list:
    """The hosts in rollout units, in the hosts' order: a group's nodes among ``hosts`` together (in
    rank order, where its first node stands), every other host alone. A rollout counts units, so a
    group stops and starts in one batch. Refused groups count as none (the plan refuses them)."""
    hosts = list(hosts or [])
    where = places(groups, hosts)
    units, placed = [], set()
    for host in hosts:
        if host in placed:
            continue
        place = where[host]
        unit = [n for n in place["nodes"] if n in hosts] if place else [host]
        placed.update(unit)
        units.append(unit)
    return units


def _address_problem(what, value) -> str:
    try:
        ipaddress.ip_address(str(value))
        return ""
    except ValueError:
        return ("%s is %r, not an IP address: vLLM binds its message queues and gloo its sockets "
                "there. Set vllm_service_node_address to the host's address on the network the "
                "nodes share." % (what, value))


def node_problems(groups, hostname, *, parallel_sizes=None, accelerator="", enforce_eager=False,
                  address="", master_addr="", ifname="", inventory_hosts=None) -> list:
    """Why this host cannot serve its place in its group: the groups refused, a node not in the
    inventory, parallel sizes the group cannot split, addresses that are not IPs. Empty for a host
    in no group (and valid groups)."""
    problems = group_problems(groups)
    if problems:
        return problems
    place = _place(groups, hostname)
    if place is None:
        return []
    where = PROBLEM_PREFIX + "group %r" % place["group"]
    if inventory_hosts is not None:
        missing = [n for n in place["nodes"] if n not in inventory_hosts]
        if missing:
            problems.append(where + " names %s, not in the inventory. Fix the name or add the host."
                            % ", ".join(missing) + FIX)
    sizes = {k: _int((parallel_sizes or {}).get(k) or 1) or 1
             for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")}
    if sizes["data_parallel_size"] > 1:
        problems.append(where + ": the model sets data_parallel_size=%d; data parallel across nodes "
                        "takes vLLM's data-parallel flags, which a group does not render. Serve each "
                        "replica as its own host or group." % sizes["data_parallel_size"] + FIX)
    total = sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"]
    if total % place["nnodes"]:
        values = (place["nnodes"], sizes["tensor_parallel_size"], sizes["pipeline_parallel_size"], total,
                  place["nnodes"])
        problems.append(where + " has %d nodes, and the model's tensor_parallel_size x "
                        "pipeline_parallel_size = %d x %d = %d GPUs cannot be split evenly across them: "
                        "nodes x GPUs per node must equal it. Set the parallel sizes to a multiple of %d "
                        "or change the group's nodes." % values + FIX)
    if accelerator == "cpu" and sizes["pipeline_parallel_size"] > 1 and enforce_eager:
        problems.append(where + ": on CPU, vLLM 0.32's pipeline parallel with enforce_eager dies at the "
                        "first completion (its warm-up skips the dummy run that allocates the second "
                        "stage's tensors). Remove enforce_eager from the entry and set "
                        "VLLM_USE_AOT_COMPILE: '0' in vllm_service_env, or use tensor parallel." + FIX)
    for what, value in (("vllm_service_node_address of %s" % hostname, address),
                        ("the head's address (%s's vllm_service_node_address)" % place["head"], master_addr)):
        why = _address_problem(what, value)
        if why:
            problems.append(where + ": " + why + FIX)
    if ifname and not IFNAME_RE.match(str(ifname)):
        problems.append(where + ": vllm_service_node_ifname %r is not a network interface name." % (ifname,) + FIX)
    return problems


def play_problems(groups, hostname, play_hosts) -> list:
    """A group is changed as one unit: every node of this host's group must be in the play's
    batch and reachable (not left out by --limit or serial, not failed or unreachable).
    ``play_hosts``: ansible_play_batch."""
    place = node(groups, hostname)
    if place is None:
        return []
    absent = [n for n in place["nodes"] if n not in (play_hosts or [])]
    if not absent:
        return []
    return [PROBLEM_PREFIX + "%s is a node of group %r, whose %s %s not in this play (left out by "
            "--limit or serial, unreachable, or failed earlier). A group is stopped and started as one unit: "
            "run it with all of %s. Nothing was changed on %s."
            % (hostname, place["group"], ", ".join(absent), "is" if len(absent) == 1 else "are",
               ", ".join(place["nodes"]), hostname)]


def behind_problems(groups, hostname, reached) -> list:
    """A group is changed as one unit: why this host may not go on when a node of its group did not
    reach the same step of this run (it failed earlier, and its failure was rescued, so it is still
    in the play's batch). ``reached``: {node: whether it reached the step}."""
    place = node(groups, hostname)
    if place is None:
        return []
    behind = [n for n in place["nodes"] if n != hostname and not (reached or {}).get(n)]
    if not behind:
        return []
    return [PROBLEM_PREFIX + "%s is a node of group %r, whose %s did not get this far in this run (%s own "
            "failure says why). A group is stopped and started as one unit: nothing was changed on %s."
            % (hostname, place["group"], ", ".join(behind), "its" if len(behind) == 1 else "their", hostname)]


def per_node_parallel(place, parallel) -> int:
    """The GPUs one node of the group uses (the whole model's on a host in no group)."""
    parallel = _int(parallel) or 1
    if not place:
        return parallel
    return max(1, parallel // place["nnodes"])


def serve_flags(place, master_addr) -> list:
    """The ``vllm serve`` flags of a node: the group's size, its rank, the head's rendezvous;
    ``--headless`` on every node but the head. Empty for a host in no group."""
    if not place:
        return []
    flags = ["--headless"] if place["headless"] else []
    return flags + ["--nnodes", str(place["nnodes"]), "--node-rank", str(place["rank"]),
                    "--master-addr", str(master_addr), "--master-port", str(place["master_port"]),
                    "--distributed-timeout-seconds", str(place["distributed_timeout"])]


def node_env(place, address, ifname="") -> dict:
    """The environment a node needs: VLLM_HOST_IP (its own address) and, with an interface name,
    the socket interface of gloo (CPU and the control plane) and NCCL. Empty for a host in no group."""
    if not place:
        return {}
    env = {"VLLM_HOST_IP": str(address)}
    if ifname:
        env.update(GLOO_SOCKET_IFNAME=str(ifname), NCCL_SOCKET_IFNAME=str(ifname))
    return env
