# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The plan's inputs checked and turned into values: sizes, headroom and a catalog entry, and
PlanError (NotInStore) for a bad one.

The lowest of the planning files (plan_inputs <- protections <- purge_items <- disk_plan): the
others raise its errors, callers catch them from here.
"""
from __future__ import annotations

import re

from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog
from ansible_collections.modelswap.vllm.plugins.module_utils.common.catalog import DEFAULT_REVISION


class PlanError(Exception):
    """Bad input or a plan that cannot be made; the message names object, cause and fix."""


class NotInStore(PlanError):
    """An item that names nothing in the store."""


# --------------------------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------------------------
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "m": 1024 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gib": 1024 ** 3,
    "t": 1024 ** 4, "tib": 1024 ** 4, "p": 1024 ** 5, "pib": 1024 ** 5,
    "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4, "pb": 1000 ** 5,
}
_SIZE_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, what: str = "size") -> int:
    """'10GiB'/'10G' (binary), '10GB' (decimal), '1048576' or an int -> bytes; >= 0."""
    if isinstance(value, bool):
        raise PlanError("%s %r is not a size" % (what, value))
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise PlanError("%s %r is not a size: use bytes or a number with K/M/G/T (binary, also "
                            "KiB/MiB/GiB/TiB) or KB/MB/GB/TB (decimal)" % (what, value))
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise PlanError("%s %r is negative: it must be zero or more" % (what, value))
    return int(number * _UNITS[unit])


def parse_headroom(value, fs_total: int) -> int:
    """Headroom as bytes: '5%' is 5 % of the file system's size, else a size (see parse_bytes)."""
    text = str(value).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise PlanError("headroom %r is not a percentage like '5%%'" % (value,))
        if pct < 0:
            raise PlanError("headroom %r is negative: it must be between 0%% and 100%%" % (value,))
        if pct > 100:
            raise PlanError("headroom %r is over 100%% of the file system" % (value,))
        return int(fs_total * pct / 100.0)
    return parse_bytes(value, "headroom")


# --------------------------------------------------------------------------------------------
# catalog
# --------------------------------------------------------------------------------------------
def catalog_entry(models, name: str, role: str) -> dict:
    """The catalog entry ``name`` (validated); ``role`` says where the name came from."""
    if not isinstance(models, dict) or not models:
        raise PlanError("%s %r cannot be looked up: the model catalog (modelswap_models) is empty "
                        "or not a mapping" % (role, name))
    if name not in models:
        raise PlanError("unknown model name %r (%s): the catalog has %s; add it to modelswap_models "
                        "or fix the name" % (name, role, ", ".join(sorted(map(str, models)))))
    problems = entry_problems(name, models[name])
    if problems:
        raise PlanError("; ".join(problems))
    entry = models[name]
    return {
        "name": name,
        "repo_id": entry["repo_id"],
        "revision": str(entry.get("revision") or DEFAULT_REVISION),
        "allow_patterns": list(entry.get("allow_patterns") or []) or None,
        "ignore_patterns": list(entry.get("ignore_patterns") or []) or None,
    }


def entry_problems(name: str, entry) -> list:
    """What is wrong with one catalog entry (empty when valid): the catalog's own rules, the
    same the swap applies, so the plan never counts a target the deploy would refuse."""
    if not isinstance(entry, dict):
        return ["catalog entry %r is not a mapping" % name]
    return ["catalog entry %r: %s" % (name, problem) for problem in catalog.entry_problems(name, entry)]
