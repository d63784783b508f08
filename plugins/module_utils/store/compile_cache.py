# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""vLLM's caches of a host, one folder per model, as part of the store: listed, sized, pruned.

The vllm_service role points ``VLLM_CACHE_ROOT`` at ``<root>/<repo folder>`` (``models--org--name``,
the store's own name for the model; serving.vllm_service_settings.compile_cache_root). vLLM keeps
its compiled graphs there (``torch_compile_cache/<hash>/``, the hash over the model's
configuration, vLLM's code and the compiler, with inductor's and triton's caches beside them), so a
swap back to a model still in the store starts warm, and a model the store no longer holds leaves a
folder nothing will read again: ``prune_plan`` names those, ``remove`` deletes them.

Deletion stays inside the root: only a direct child whose name is a repo folder, a real folder
(never a link), is ever removed, and never one of the kept repos (the served model, its fallback).
"""
from __future__ import annotations

import os
import shutil
import stat

from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import allocated_under, listed
from ansible_collections.modelswap.vllm.plugins.module_utils.store import cache_layout


class CompileCacheError(Exception):
    """A root that cannot be used (the message is final)."""


def root_problem(root) -> str:
    """Why ``root`` cannot hold the caches ('' when it can): absolute, not ``/``."""
    if not isinstance(root, str) or not os.path.isabs(root):
        return "the compile cache root must be an absolute path, got %r" % (root,)
    if not root.strip(os.sep):
        return "the compile cache root cannot be /"
    return ""


def entries(root: str) -> list:
    """The model folders under ``root``: folder, repo_id, path, bytes; what is not a model's folder
    (vLLM's own files when a cache root is shared, a link) is left out. A missing root lists
    nothing."""
    found = []
    for name in listed(root):
        parsed = cache_layout.parse_repo_folder(name)
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if parsed is None or parsed[0] != "model" or not stat.S_ISDIR(st.st_mode):
            continue
        found.append({"folder": name, "repo_id": parsed[1], "path": path, "bytes": allocated_under(path)})
    return found


def store_repos(store_dir: str) -> set:
    """Repo ids the store holds: model folders with at least one snapshot."""
    held = set()
    for name in listed(store_dir):
        parsed = cache_layout.parse_repo_folder(name)
        if parsed and parsed[0] == "model" and listed(os.path.join(store_dir, name, "snapshots")):
            held.add(parsed[1])
    return held


def prune_plan(found, held, keep) -> tuple:
    """(prune, kept): the caches of models the store no longer holds, except the ``keep`` repo
    ids; each row with the ``reason`` it goes or stays."""
    prune, kept = [], []
    keep = set(keep or [])
    for row in found:
        if row["repo_id"] in keep:
            kept.append(dict(row, reason="kept: named in keep (served or its fallback)"))
        elif row["repo_id"] in held:
            kept.append(dict(row, reason="kept: the model is in the store"))
        else:
            prune.append(dict(row, reason="pruned: the model is no longer in the store"))
    return prune, kept


def remove(root: str, rows) -> tuple:
    """Delete the planned folders; (removed, left): ``left`` rows carry the ``cause``. Each path is
    checked again first: a direct child of ``root`` named like a repo folder, a real folder."""
    removed, left = [], []
    for row in rows:
        path = os.path.join(root, row["folder"])
        if os.path.dirname(path) != root.rstrip(os.sep) or cache_layout.parse_repo_folder(row["folder"]) is None:
            left.append(dict(row, cause="not a model folder directly under %s" % root))
            continue
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            removed.append(row)            # gone already (a rerun, another run)
            continue
        if not stat.S_ISDIR(st.st_mode):
            left.append(dict(row, cause="no longer a folder (a link or a file): left alone"))
            continue
        errors = []
        shutil.rmtree(path, onerror=lambda _f, p, exc: errors.append("%s: %s" % (p, exc[1])))
        if os.path.lexists(path):
            left.append(dict(row, cause="; ".join(errors[:3]) or "still there"))
        else:
            removed.append(row)
    return removed, left
