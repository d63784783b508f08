# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""Filters of the fleet_status role: each host's place in its load balancer's pool, what its
server's /v1/models said, and where its record, service, server and pool disagree.

The judges are lb_pool.host_pool and served_model.served_reading / status_problems (pure, in
plugins/module_utils/serving/, table-tested in tests/unit/plugins/filter/test_fleet_status.py);
these filters only hand them what the role read. They never raise: what cannot be read is a
state of the table.
"""
from __future__ import annotations

from ansible_collections.modelswap.vllm.plugins.module_utils.serving import lb_pool, served_model


def fleet_status_pool(stats, lb_type, backend, server, source="the stats"):
    """This host's place in its pool (``lb_pool.host_pool``): ``{"type", "found", "status",
    "serving", "admin", "check", "label", "text"}``; "-" for none and hooks."""
    return lb_pool.host_pool(lb_type, stats, backend, server, source)


def fleet_status_served(response):
    """The names a server's /v1/models lists, from the uri read: ``{"names", "why"}``."""
    return served_model.served_reading(response)


def fleet_status_problems(record, served, service, pool=None, served_why=None, drained=False, unit="vllm.service"):
    """Where the host's record, service, server and pool disagree: one line each, with the fix."""
    return served_model.status_problems(record, served, service, pool, served_why, bool(drained), unit)


class FilterModule:
    def filters(self):
        return {"fleet_status_pool": fleet_status_pool, "fleet_status_served": fleet_status_served,
                "fleet_status_problems": fleet_status_problems}
