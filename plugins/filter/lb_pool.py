# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""Filters of the lb_pool role: the pool as read (HAProxy's stats CSV or a state hook's list), the
floor's verdict, and the result each entry point publishes.

The logic lives in plugins/module_utils/serving/lb_pool.py (table-tested in
tests/unit/plugins/filter/test_lb_pool.py); these wrappers turn its errors into
AnsibleFilterError, whose message the failed task shows.
"""
from __future__ import annotations

import re

from ansible.errors import AnsibleFilterError
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import lb_pool


def _wrap(func):
    def run(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except lb_pool.PoolError as exc:
            raise AnsibleFilterError(str(exc))
    run.__name__ = func.__name__
    run.__doc__ = func.__doc__
    return run


def lb_pool_haproxy_servers(text, backend, source="the stats"):
    """The servers of an HAProxy backend from its stats CSV."""
    return lb_pool.haproxy_servers(text, backend, source)


def lb_pool_hook_servers(value):
    """The servers a state hook set in lb_pool_hook_servers, checked."""
    return lb_pool.hook_servers(value)


def lb_pool_view(servers, server, min_serving=1, leaving=None, pool="the pool", lb_type="haproxy"):
    """The pool as this host sees it and the floor's verdict on taking it out."""
    return lb_pool.pool_view(servers, server, min_serving, leaving, pool, lb_type)


def lb_pool_result(view, action, **kwargs):
    """The fact an entry point publishes (lb_pool_result)."""
    return lb_pool.pool_result(action, view, **kwargs)


def lb_pool_haproxy_sessions(text, backend, server):
    """The sessions HAProxy holds on one server now (its requests in flight)."""
    return lb_pool.haproxy_sessions(text, backend, server)


def lb_pool_read_failure(result):
    """A failed pool entry point as its caller keeps it (``{"failed": true, "msg"}``): lb_pool's
    own words, without Ansible's account of where its filter failed."""
    msg = str((result or {}).get("msg") or "the pool could not be read")
    return {"failed": True, "msg": re.sub(r"^(?s:.*)The filter plugin '[^']+' failed: ", "", msg)}


def lb_pool_rejoin_failure(view, timeout):
    """The message of a rejoin the load balancer did not confirm."""
    return lb_pool.rejoin_failure(view, timeout)


class FilterModule:
    def filters(self):
        return {name: _wrap(func) for name, func in (
            ("lb_pool_haproxy_servers", lb_pool_haproxy_servers),
            ("lb_pool_hook_servers", lb_pool_hook_servers),
            ("lb_pool_view", lb_pool_view),
            ("lb_pool_result", lb_pool_result),
            ("lb_pool_haproxy_sessions", lb_pool_haproxy_sessions),
            ("lb_pool_rejoin_failure", lb_pool_rejoin_failure),
            ("lb_pool_read_failure", lb_pool_read_failure),
        )}
