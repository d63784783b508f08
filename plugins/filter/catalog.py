# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Filters over the model catalog: the one place roles and the preview judge an entry.

The rules live in plugins/module_utils/common/catalog.py (unit-tested there).
"""
from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.modelswap.vllm.plugins.module_utils.common import catalog


def catalog_problems(models, name, keep=None):
    """Why ``name`` (and ``keep``) cannot be used from the catalog ``models``: unknown names,
    then every problem of its entry (a list of sentences; empty: usable)."""
    return catalog.selection_problems(models, name, keep or [])


def catalog_refusals(models, name, keep=None):
    """The sentences a migration to ``name`` is refused with (unknown target, invalid entry,
    unknown keep names); empty when it can go ahead."""
    return catalog.target_refusals(models, name, keep or [])


def catalog_entry(models, name, strict=False):
    """The entry ``name`` of the catalog with its defaults (revision main, served_model_name the
    name, ...). Roles check ``catalog_problems`` in their validate step and derive their
    variables with this (lazily, so it also runs for actions that need no entry: an unknown
    name gives the defaults alone); ``strict=true`` fails with the entry's problems instead."""
    if strict:
        problems = catalog.selection_problems(models, name)
        if problems:
            raise AnsibleFilterError("catalog entry %r is refused: %s" % (name, "; ".join(problems)))
    entry = models.get(name) if isinstance(models, dict) else None
    return catalog.normalized(name, entry)


class FilterModule:
    def filters(self):
        return {"catalog_problems": catalog_problems, "catalog_entry": catalog_entry,
                "catalog_refusals": catalog_refusals}
