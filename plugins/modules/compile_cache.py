#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: compile_cache
short_description: List vLLM's per-model caches and prune those of models the store no longer holds
version_added: "0.3.0"
description:
  - The C(modelswap.vllm.vllm_service) role gives every model its own vLLM cache root,
    C(<the service's home>/cache/vllm/models--org--name) (the store's name for the model), where vLLM
    keeps its compiled graphs keyed by the model's configuration. A swap back to a model still in
    the store then starts from its warm cache.
  - This module lists those folders with their sizes and, with O(state=pruned), removes the ones
    whose model is no longer in the store at O(store) (a purge removed it), except the repos in
    O(keep). Run it after a purge; a rerun prunes what an interrupted run left.
  - Only a direct child of O(root) whose name is a model's repo folder and which is a real folder
    (not a link) is ever removed; anything else under O(root) is left alone.
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
options:
  root:
    description:
      - The folder holding the per-model caches, an absolute path other than C(/). A missing
        folder holds no cache.
    type: path
    required: true
  store:
    description:
      - The model store (the Hugging Face hub cache folder, C(.../hub)) whose models keep their
        caches. A model folder with at least one snapshot counts as held.
    type: path
    required: true
  keep:
    description:
      - Repo ids whose caches stay even when the store does not hold them (the served model, its
        fallback).
    type: list
    elements: str
    default: []
  state:
    description:
      - C(pruned) removes the caches of models the store no longer holds; C(listed) only reports.
    type: str
    choices: [pruned, listed]
    default: pruned
attributes:
  check_mode:
    support: full
    details:
      - Lists in RV(pruned) what would be removed and removes nothing.
  diff_mode:
    support: full
    details:
      - The model folders under O(root) before and after.
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Prune the vLLM caches of the models the purge removed
  modelswap.vllm.compile_cache:
    root: /var/lib/vllm/cache/vllm
    store: /var/lib/modelswap/hf/hub
    keep: ["moonshotai/Kimi-K2.5"]
  become: true
"""

RETURN = r"""
caches:
  description: Every model folder under O(root) with its size, what happens to it and why.
  returned: always
  type: list
  elements: dict
  sample: [{"folder": "models--lab--tiny-a", "repo_id": "lab/tiny-a", "path": "/var/lib/vllm/cache/vllm/models--lab--tiny-a",
            "bytes": 1048576, "reason": "kept: the model is in the store"}]
pruned:
  description: The folders removed (in check mode, that would be removed).
  returned: always
  type: list
  elements: dict
  sample: []
left:
  description: Planned folders still on disk, with the cause; with any, the task failed.
  returned: always
  type: list
  elements: dict
  sample: []
total_bytes:
  description: The bytes of every model folder under O(root) before the prune.
  returned: always
  type: int
  sample: 1048576
freed_bytes:
  description: The bytes of RV(pruned).
  returned: always
  type: int
  sample: 0
msg:
  description: A one-line summary.
  returned: always
  type: str
  sample: "/var/lib/vllm/cache/vllm: 2 model cache(s), 1.0 MiB; 1 pruned (512.0 KiB)"
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common.units import human_bytes
from ansible_collections.modelswap.vllm.plugins.module_utils.store import compile_cache


def argument_spec():
    return dict(
        root=dict(type="path", required=True),
        store=dict(type="path", required=True),
        keep=dict(type="list", elements="str", default=[]),
        state=dict(type="str", choices=["pruned", "listed"], default="pruned"),
    )


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    p = module.params
    empty = dict(changed=False, caches=[], pruned=[], left=[], total_bytes=0, freed_bytes=0)
    problem = compile_cache.root_problem(p["root"])
    if problem:
        module.fail_json(msg="compile_cache: " + problem, **empty)
    root = p["root"].rstrip("/")
    found = compile_cache.entries(root)
    prune, kept = compile_cache.prune_plan(found, compile_cache.store_repos(p["store"]), p["keep"])
    if p["state"] == "listed":
        prune, kept = [], [dict(r, reason="would be " + r["reason"]) for r in prune] + kept
    removed, left = (prune, []) if module.check_mode else compile_cache.remove(root, prune)
    freed = sum(row["bytes"] for row in removed)
    total = sum(row["bytes"] for row in found)
    result = dict(changed=bool(removed), caches=sorted(prune + kept, key=lambda r: r["folder"]),
                  pruned=removed, left=left, total_bytes=total, freed_bytes=freed)
    gone = {row["folder"] for row in removed}
    if module._diff:
        result["diff"] = {"before_header": root, "after_header": root,
                          "before": "".join(row["folder"] + "\n" for row in found),
                          "after": "".join(row["folder"] + "\n" for row in found if row["folder"] not in gone)}
    summary = "%s: %d model cache(s), %s; %d pruned (%s)" % (
        root, len(found), human_bytes(total), len(removed), human_bytes(freed))
    if left:
        module.fail_json(msg="%s; left: %s" % (summary, "; ".join("%s (%s)" % (r["folder"], r["cause"]) for r in left)),
                         **result)
    module.exit_json(msg=summary, **result)


if __name__ == "__main__":
    main()
