# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""What must not go: the protections (served model, target, keep list, protected paths), the
items each covers, and ``build_protections`` from the catalog names and what the host says."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ansible_collections.modelswap.vllm.plugins.module_utils.store.cache_layout import (
    COMMIT_RE, StoreError, is_within, parse_repo_folder, repo_folder_name, validate_repo_id)
from ansible_collections.modelswap.vllm.plugins.module_utils.store.model_store import Item
from ansible_collections.modelswap.vllm.plugins.module_utils.store.plan_inputs import PlanError, catalog_entry


@dataclass
class Protection:
    rule: str            # served | target | keep | path
    label: str           # human words: "the served model 'x' (deployment record /p)"
    folder: str = ""     # a cache repo folder ...
    commit: str = ""     # ... and one revision of it ("" = every revision)
    dir_name: str = ""   # a plain model directory
    path: str = ""       # a path that is neither (outside the store)

    def as_dict(self) -> dict:
        d = {"rule": self.rule, "what": self.label}
        if self.folder:
            rtype, repo_id = parse_repo_folder(self.folder)
            d["repo_id"] = repo_id
            d["revision"] = self.commit or "*"
        if self.dir_name or self.path:
            d["path"] = self.path
        return d


def protect_model(store, repo_id: str, revision: str, rule: str, label: str,
                  repo_type: str = "model") -> Protection:
    """Protect one revision of a repo (every revision when it cannot be pinned to a commit)."""
    folder = repo_folder_name(repo_id, repo_type)
    commit = revision if revision and COMMIT_RE.match(revision) else ""
    if not commit and revision:
        repo = store.repos.get(folder)
        commit = (repo.commit_for(revision) if repo else None) or ""
    return Protection(rule=rule, label=label, folder=folder, commit=commit)


def protect_path(store, path: str, rule: str, label: str) -> Protection:
    """Protect what a path points into: a snapshot, a repo, a plain model dir, or the path itself."""
    real = os.path.realpath(path)
    if store.cache_dir and is_within(real, store.cache_dir) and real != store.cache_dir:
        parts = os.path.relpath(real, store.cache_dir).split(os.sep)
        if parse_repo_folder(parts[0]):
            commit = parts[2] if len(parts) >= 3 and parts[1] == "snapshots" else ""
            return Protection(rule=rule, label=label, folder=parts[0], commit=commit, path=real)
    if store.models_dir and is_within(real, store.models_dir) and real != store.models_dir:
        name = os.path.relpath(real, store.models_dir).split(os.sep)[0]
        return Protection(rule=rule, label=label, dir_name=name, path=real)
    return Protection(rule=rule, label=label, path=real)


def protect_model_ref(store, ref: str, rule: str, label: str) -> Protection:
    """A vLLM model argument: a path, or a repo id (then every cached revision of it)."""
    if os.path.isabs(ref) or ref.startswith("."):
        return protect_path(store, ref, rule, label)
    try:
        validate_repo_id(ref)
    except StoreError:
        return Protection(rule=rule, label=label, path=ref)
    return Protection(rule=rule, label=label, folder=repo_folder_name(ref))


def protecting(item: Item, protections) -> Protection | None:
    """The first protection that covers ``item`` (None when it may go)."""
    for p in protections:
        if item.kind == "repo" and p.folder == item.folder:
            return p
        if item.kind == "revision" and p.folder == item.folder and p.commit in ("", item.commit):
            return p
        if item.kind == "dir":
            if p.dir_name == item.name:
                return p
            if p.path and (is_within(p.path, item.path) or is_within(item.path, p.path)):
                return p
    return None


def items_protected_by(store, protection: Protection) -> list:
    """The store items a protection covers (what purging that model would delete)."""
    if protection.folder:
        repo = store.repos.get(protection.folder)
        if repo is None:
            return []
        if protection.commit:
            rev = repo.revisions.get(protection.commit)
            return [Item("revision", folder=repo.folder, commit=rev.commit, path=rev.path)] if rev else []
        return [Item("repo", folder=repo.folder, path=repo.path)]
    if protection.dir_name and protection.dir_name in store.dirs:
        d = store.dirs[protection.dir_name]
        return [Item("dir", name=d.name, path=d.path)]
    return []


def build_protections(store, *, models=None, target=None, target_commit: str = "", keep=(),
                      served=None, record=None, record_path: str = "", unit=None,
                      unit_name: str = "", protect_paths=(), processes=()) -> dict:
    """Protections and the served model, from the catalog names and what the host says.

    ``record`` is the deployment record (dict or None), ``unit`` what served_model.served_from_unit
    returned (or None), ``processes`` the running vLLM servers (served_model.served_by_processes).
    Unknown catalog names raise PlanError.
    """
    protections = []
    served_prot = []
    served_info = {"name": None, "repo_id": None, "commit": None, "path": None, "sources": [],
                   "unit_active": unit.get("active") if unit else False}
    if served:
        entry = catalog_entry(models, served, "served")
        label = "the served model %r (served option)" % served
        served_prot.append(protect_model(store, entry["repo_id"], entry["revision"], "served", label))
        served_info.update(name=served, repo_id=entry["repo_id"], commit=served_prot[-1].commit or None)
        served_info["sources"].append("option")
    if record:
        name = record.get("model")
        label = "the served model %r (deployment record %s)" % (name or record.get("repo_id"), record_path)
        if record.get("repo_id"):
            try:
                validate_repo_id(record["repo_id"])
            except StoreError as exc:
                raise PlanError("the deployment record %s: %s; fix the record" % (record_path, exc))
            served_prot.append(protect_model(store, record["repo_id"], record.get("commit") or "",
                                             "served", label))
        if record.get("path"):
            served_prot.append(protect_path(store, record["path"], "served", label))
        served_info.update({k: served_info[k] or record.get(k) for k in ("repo_id", "commit", "path")})
        served_info["name"] = served_info["name"] or name
        served_info["sources"].append("deployment_record")
    if unit and unit.get("model"):
        label = "the model of unit %s (%s, ExecStart)" % (unit_name, unit.get("unit_state"))
        p = protect_model_ref(store, unit["model"], "served", label)
        served_prot.append(p)
        served_info["path"] = served_info["path"] or unit["model"]
        served_info["sources"].append("unit")
    running = []
    for proc in processes or ():
        label = "the model of the running vLLM server, PID %s" % proc["pid"]
        running.append(protect_model_ref(store, proc["model"], "served", label))
        served_prot.append(running[-1])
        served_info["path"] = served_info["path"] or proc["model"]
        if "process" not in served_info["sources"]:
            served_info["sources"].append("process")
    protections.extend(served_prot)
    target_info = None
    if target:
        entry = catalog_entry(models, target, "target")
        commit = target_commit or entry["revision"]
        protections.append(protect_model(store, entry["repo_id"], commit, "target",
                                         "the target model %r" % target))
        target_info = entry
    for name in keep or ():
        entry = catalog_entry(models, name, "keep")
        protections.append(protect_model(store, entry["repo_id"], entry["revision"], "keep",
                                         "model %r of the keep list" % name))
    for path in protect_paths or ():
        protections.append(protect_path(store, path, "path", "protected path %s" % path))
    served_items = []
    for p in served_prot:
        for item in items_protected_by(store, p):
            if item not in served_items:
                served_items.append(item)
    # A served model that is also the target or kept is not "the served model's" to purge.
    others = [p for p in protections if p.rule != "served"]
    served_items = [i for i in served_items if protecting(i, others) is None]
    served_label = repr(served_info["name"] or served_info["repo_id"] or served_info["path"] or "?")
    return {"protections": protections, "served_items": served_items, "served": served_info,
            "served_label": served_label, "target": target_info, "running": running}
