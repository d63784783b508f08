# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""The model catalog's one owner: what a catalog entry may hold and what it means.

A catalog (``modelswap_models``) maps a name to an entry::

    kimi-k2.5-int4:
      repo_id: moonshotai/Kimi-K2.5      # 'name' or 'namespace/name' (the Hub's rules)
      revision: main                     # a commit, branch or tag (default: main)
      served_model_name: kimi-k2.5       # default: the catalog name
      vllm_args: {tensor_parallel_size: 8}
      allow_patterns: ["*.safetensors"]  # optional globs of the download
      ignore_patterns: []
      quality: {}                        # optional: the quality gate (common/quality_settings.py)

Every role (preflight, model_fetch, model_purge, vllm_service, migrate's preview) and every
module reads entries through here (filters ``catalog_problems`` and ``catalog_entry`` in
plugins/filter/catalog.py), so an entry is accepted everywhere or refused before anything
changes, with the same sentence. Pure functions.
"""
from __future__ import annotations

import re

from ansible_collections.modelswap.vllm.plugins.module_utils.common import vllm_args
from ansible_collections.modelswap.vllm.plugins.module_utils.common.quality_settings import quality_problems, quality_settings

DEFAULT_REVISION = "main"
# The full-string rules (\Z, not $: "$" also matches before a trailing newline).
COMMIT_RE = re.compile(r"^[0-9a-f]{40}\Z")
# huggingface_hub's REPO_ID_REGEX plus its extra rules (no "--" or "..", no ".git" suffix).
_REPO_NAME = r"(?!-)(?!\.)[A-Za-z0-9_.\-]{1,96}(?<!-)(?<!\.)"
REPO_ID_RE = re.compile(r"^(?:%s/)?%s\Z" % (_REPO_NAME, _REPO_NAME))
# A catalog key (vllm_service_model, modelswap_serve): the unit's comment and file names.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+:@-]{0,127}\Z")
# A served model name (--served-model-name, the unit's Description=): vLLM takes any string;
# these characters cover names like "kimi-k2.5", "org/Model-7B", "llama3:8b".
SERVED_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+:@/-]{0,255}\Z")
# A branch, tag or commit (hf_snapshot resolves it; it lands in the deployment record).
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}\Z")
KEYS = ("repo_id", "revision", "served_model_name", "vllm_args", "allow_patterns", "ignore_patterns", "quality")


def repo_id_problem(repo_id) -> str:
    """Why ``repo_id`` is not a Hub repo id ('' when it is one): ``gpt2`` and ``org/name``."""
    if repo_id is None or repo_id == "":
        return ("the entry has no repo_id: repo id %r is not a non-empty string such as 'gpt2' or "
                "'namespace/name'" % (repo_id,))
    if not isinstance(repo_id, str):
        return "repo id %r is not a non-empty string" % (repo_id,)
    if repo_id.count("/") > 1 or not REPO_ID_RE.match(repo_id):
        return ("repo id %r is malformed: use 'name' or 'namespace/name' with letters, digits, "
                "'-', '_', '.' (at most 96 each, not starting or ending with '-' or '.')" % repo_id)
    if "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return "repo id %r is malformed: it may not contain '--' or '..' nor end in '.git'" % repo_id
    return ""


def revision_problem(revision) -> str:
    """Why ``revision`` is not a commit, branch or tag name ('' when it is one)."""
    if not isinstance(revision, str) or not REVISION_RE.match(revision) or ".." in revision:
        return ("revision %r is unusable: the revision must be a commit, branch or tag name "
                "(letters, digits, '.', '_', '/', '-'; no '..')" % (revision,))
    return ""


def _patterns_problem(key, value) -> str:
    if value is None or (isinstance(value, list) and all(isinstance(x, str) and x for x in value)):
        return ""
    return "%s must be a list of glob strings such as ['*.safetensors', '*.json'], got %r" % (key, value)


def entry_problems(name, entry, names=None) -> list:
    """What makes a catalog entry unusable, one sentence each (empty: usable). Every value that
    reaches the Hub, the cache, the unit file or vLLM's command line: the name (the unit's
    comment), repo_id, revision, served_model_name (``Description=``, ``--served-model-name``),
    vllm_args (rendered once, so a reserved flag in any spelling is named here), the
    download's patterns and the quality gate (whose reference must be one of ``names``, the
    catalog's, when given)."""
    problems = []
    if not isinstance(name, str) or not NAME_RE.match(name):
        problems.append("the catalog name %r is not usable: use 1-128 letters, digits and "
                        "'.', '_', '+', ':', '@', '-' (starting with a letter or digit); it is "
                        "written into the unit file" % (name,))
    if not isinstance(entry, dict):
        problems.append("the entry must be a mapping with repo_id and optional revision, "
                        "served_model_name, vllm_args, allow_patterns, ignore_patterns; got %s"
                        % type(entry).__name__)
        return problems
    for problem in (repo_id_problem(entry.get("repo_id")),
                    revision_problem(entry.get("revision", DEFAULT_REVISION))):
        if problem:
            problems.append(problem)
    served = entry.get("served_model_name")
    if served not in (None, "") and (not isinstance(served, str) or not SERVED_NAME_RE.match(served)):
        problems.append("served_model_name %r is not usable: use 1-256 letters, digits and "
                        "'.', '_', '+', ':', '@', '/', '-' (starting with a letter or digit); "
                        "it is written into the unit file" % (served,))
    try:
        vllm_args.vllm_args_argv(entry.get("vllm_args"))
    except vllm_args.ArgsError as exc:
        problems.append(str(exc))
    for key in ("allow_patterns", "ignore_patterns"):
        problem = _patterns_problem(key, entry.get(key))
        if problem:
            problems.append(problem)
    problems.extend(quality_problems(entry.get("quality"), names))
    return problems


def selection_problems(models, name, keep=()) -> list:
    """Why ``name`` (and the keep list) cannot be picked from the catalog ``models``, then why
    its entry is unusable (empty: it can be used)."""
    if not isinstance(models, dict) or not models:
        return ["the catalog (modelswap_models) is %s: define at least one model"
                % ("empty" if isinstance(models, dict) or not models else "not a mapping")]
    problems = []
    if name not in models:
        problems.append("unknown model name %r: the catalog has %s; add it to the catalog or pick "
                        "one of those" % (name, ", ".join(sorted(map(str, models)))))
    unknown = [k for k in (keep or []) if k not in models]
    if unknown:
        problems.append("unknown model name(s) %s in modelswap_keep: the catalog has %s"
                        % (", ".join(map(str, unknown)), ", ".join(sorted(map(str, models)))))
    if name in models:
        problems.extend(entry_problems(name, models[name], list(models)))
    return problems


def target_refusals(models, name, keep=()) -> list:
    """Why a run cannot migrate to ``name`` (keeping ``keep``), as the operator reads it: an unknown
    target, its entry's problems, unknown keep names (the sentences preflight and the migration's
    preview fail with; empty: it can)."""
    names = ", ".join(sorted(map(str, models))) if isinstance(models, dict) else ""
    if not isinstance(models, dict) or not models or name not in models:
        return ["unknown model name %r (modelswap_serve): the catalog modelswap_models has %s; add it to the "
                "catalog or fix modelswap_serve" % (name, names or "no models")]
    out = []
    problems = entry_problems(name, models[name], list(models))
    if problems:
        out.append("catalog entry %r is invalid: %s; nothing was changed" % (name, "; ".join(problems)))
    out.extend("unknown model name %r in modelswap_keep: the catalog has %s" % (k, names)
               for k in (keep or []) if k not in models)
    return out


def normalized(name, entry) -> dict:
    """The entry with its defaults: revision ``main``, served_model_name the catalog name, no
    vllm_args; the download's patterns only when the entry has them (absent: every file), and the
    quality gate's settings with their defaults only when it has one. Call after entry_problems
    found nothing."""
    entry = entry if isinstance(entry, dict) else {}
    out = {
        "name": name,
        "repo_id": entry.get("repo_id") or "",
        "revision": entry.get("revision") or DEFAULT_REVISION,
        "served_model_name": entry.get("served_model_name") or name,
        "vllm_args": entry.get("vllm_args") or {},
    }
    out.update((key, entry[key]) for key in ("allow_patterns", "ignore_patterns")
               if entry.get(key) is not None)
    quality = quality_settings(name, entry.get("quality"))
    if quality is not None:
        out["quality"] = quality
    return out
