# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""The plain data the migration's plan is made of: reading nested role results that may be
missing (``dig``), a mapping of inputs checked against its TypedDict (``checked``), and the
sizes and durations the plan prints (``bytes_text``, ``seconds_text``).

Pure stdlib, no I/O: the filters (plugins/filter/migrate.py) hand the roles' results here as
dicts; a result a role did not publish is None.
"""
from __future__ import annotations

from collections.abc import Mapping

from ansible_collections.modelswap.vllm.plugins.module_utils.common import units


class InputError(ValueError):
    """A mapping of inputs that its TypedDict does not describe (a key unknown or missing)."""


def dig(data, *path, default=None):
    """``data[path[0]][path[1]]...``, or ``default`` where a level is missing, None or not a dict."""
    for key in path:
        if not isinstance(data, dict) or key not in data or data[key] is None:
            return default
        data = data[key]
    return data


def checked(name: str, values, typed, required=()) -> dict:
    """``values`` as a plain dict after checking its keys against the TypedDict ``typed``: an
    unknown key (a typo at the call site) or a missing required one raises InputError."""
    keys = ", ".join(typed.__annotations__)
    if not isinstance(values, Mapping):
        raise InputError("%s takes a mapping of %s, not %s" % (name, keys, type(values).__name__))
    unknown = sorted(str(k) for k in values if k not in typed.__annotations__)
    if unknown:
        raise InputError("%s: unknown key(s) %s (it takes %s)" % (name, ", ".join(unknown), keys))
    missing = [k for k in required if k not in values]
    if missing:
        raise InputError("%s: missing key(s) %s" % (name, ", ".join(missing)))
    return dict(values)


def bytes_text(value) -> str:
    """1536 -> '1.5 KiB' (common/units.py); '?' for what is not a number (a missing fact)."""
    try:
        return units.human_bytes(value)
    except (TypeError, ValueError):
        return "?"


def seconds_text(value) -> str:
    """42 -> '42 s', 480 -> '8 min', 7200 -> '2.0 h'; '?' for what is not a number."""
    try:
        secs = float(value)
    except (TypeError, ValueError):
        return "?"
    if secs < 90:
        return f"{secs:.0f} s"
    if secs < 5400:
        return f"{secs / 60:.0f} min"
    return f"{secs / 3600:.1f} h"
