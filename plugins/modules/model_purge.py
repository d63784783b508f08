#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_purge
short_description: Delete cached models safely, inside configured roots only
version_added: "0.1.0"
description:
  - Removes Hugging Face cache repos or single revisions with the semantics of huggingface_hub's
    C(HFCacheInfo.delete_revisions) (blobs that a remaining revision or another repo
    shares survive), and removes plain model directories.
  - The paths to delete are planned once, from the module's own scan, and deleted exactly as
    planned (through huggingface_hub's C(DeleteCacheStrategy) for healthy repos); nothing is
    derived from where a link points at delete time. With the locks held, right before deleting,
    every planned path is checked again (same inode and type, reached through no symlink, a blob
    a regular file in its repo's C(blobs) folder) and every affected repo is scanned again; if
    anything changed since the plan (a snapshot link retargeted, a planned file gone or replaced, a
    new revision or ref), the module fails naming the changes and deletes nothing.
  - Refuses, before deleting anything and with a message naming the item and the rule, the
    served model (from the deployment record, the running vLLM unit, any running vLLM server
    and O(served)), the target,
    O(keep) models, O(protect_paths), anything outside O(roots), a root itself, a path that
    leaves the roots through a symlink, and a revision whose snapshot links point outside its
    repo (huggingface_hub would delete the link targets).
  - Holds every download lock of an affected repo (C(<cache>/.locks/<repo>/*.lock), non-blocking)
    while it deletes; a repo with a live download is refused.
  - Cleans orphaned partial downloads (C(blobs/*.incomplete)) and stale lock files only in
    repos where it can take every lock, never like C(hf cache prune).
  - Check mode returns the list and the bytes that would be freed, and a diff of the store's
    contents. A real run reports the bytes actually freed, measured on the file system
    (C(statvfs)); a second run reports C(changed=false).
  - A real run is verified. huggingface_hub's C(DeleteCacheStrategy) only logs a path it cannot
    delete (an immutable file, an NFS C(root_squash) mount, a task without become) and returns, so
    after each item's deletion every planned path is looked at again on disk; one still there (and
    still what was planned) is removed once more, and what stays is named with its cause. Then the
    module fails (after deleting the rest of the plan) with a message naming the item, the first
    paths left and the cause; RV(removed) lists only what is really gone, RV(left) what is not,
    RV(freed_bytes) what the file system really freed.
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
  - modelswap.vllm.store
options:
  items:
    description:
      - What to delete. Each is a catalog name (its pinned revision), a repo id C(org/name) (every
        revision), C(org/name@<commit>), a plain directory name under O(models_dir), or an absolute
        path (a repo folder, a C(snapshots/<commit>) folder, a model directory).
      - Items are checked all together first; one refusal deletes nothing.
    type: list
    elements: str
    default: []
  roots:
    description:
      - Folders deletions must stay inside (compared after resolving symlinks). A root itself is never
        deleted. Defaults to O(cache_dir) and O(models_dir).
    type: list
    elements: path
  target:
    description:
      - Catalog name of the model being deployed; protected.
    type: str
  allow_served_purge:
    description:
      - Allow deleting the served model (downtime). Still refused while its vLLM unit runs, while
        any vLLM server process serves it, or when its state is unknown.
    type: bool
    default: false
  missing:
    description:
      - What to do with an item that is not in the store. C(ignore) reports it under RV(absent)
        (already purged, so a rerun is idempotent); C(fail) fails before deleting anything.
    type: str
    choices: [ignore, fail]
    default: ignore
  clean_orphans:
    description:
      - Delete orphaned C(*.incomplete) partial downloads in repos where no download holds a lock.
      - Also delete payloads of the shared (Xet) store that no link in the cache references.
    type: bool
    default: true
  clean_stale_locks:
    description:
      - Delete lock files (and lock folders of repos no longer cached) that nobody holds.
    type: bool
    default: true
attributes:
  check_mode:
    support: full
    details: Lists what would go and the bytes it would free; touches nothing.
  diff_mode:
    support: full
    details: Before and after listings of the store (one line per revision, directory, partial file).
requirements:
  - huggingface_hub >= 1.0 on the host when Hugging Face cache items are deleted.
notes:
  - Set C(ansible_python_interpreter) for this task to a Python with huggingface_hub (on serving
    hosts, the vLLM virtualenv's).
  - The planned bytes are allocated bytes; on a busy file system the measured RV(freed_bytes) also
    counts what other writers did meanwhile.
seealso:
  - module: modelswap.vllm.disk_plan
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Purge what the disk plan proposed
  modelswap.vllm.model_purge:
    cache_dir: /var/lib/modelswap/hf/hub
    models: "{{ modelswap_models }}"
    target: "{{ modelswap_serve }}"
    keep: "{{ modelswap_keep }}"
    items: "{{ plan.purge }}"
    missing: fail

- name: Only clean orphaned partial downloads and stale locks
  modelswap.vllm.model_purge:
    cache_dir: /data/hf/hub
"""

RETURN = r"""
removed:
  description:
    - What was (check mode, would be) deleted, with the bytes each frees (as planned).
    - In a real run only the items whose planned paths are all gone from the disk; an item with
      something left is under RV(left) instead.
  returned: always
  type: list
  elements: dict
  sample: [{"item": "org/old", "kind": "repo", "path": "/data/hf/hub/models--org--old", "bytes": 1073741824}]
absent:
  description: Items not in the store (nothing to do).
  returned: always
  type: list
  elements: str
orphans_removed:
  description: Partial downloads deleted (or to delete in check mode), with their bytes.
  returned: always
  type: list
  elements: dict
orphans_busy:
  description: Partial downloads left alone because a download holds their repo's lock.
  returned: always
  type: list
  elements: str
locks_removed:
  description: Stale lock files or lock folders deleted (or to delete).
  returned: always
  type: list
  elements: str
shared_removed:
  description:
    - Payloads of the cache-wide shared (Xet) store C(<cache>/blobs/<xx>/<hash>) removed (check mode,
      to remove) with their C(.refs) and C(.lock) - those whose last link the purge removes and, with
      O(clean_orphans), those no link in the cache references (what an interrupted deletion left).
    - A payload goes only when no link left in the cache references it, checked under its lock from
      the links on disk, not only from its C(.refs).
  returned: always
  type: list
  elements: dict
  sample: [{"path": "/data/hf/hub/blobs/3f/3f9a...", "bytes": 1073745920, "size": 1073741824,
            "why": "its last link goes with org/old", "unreferenced": false}]
shared_kept:
  description: Planned shared-store payloads a real run kept, each with C(because) (a link that
    reaches it by then, its lock held by a download, a manifest that cannot be read).
  returned: always
  type: list
  elements: dict
planned_bytes:
  description: Allocated bytes the purge frees by the plan (deletions, orphans, stale locks,
    unreferenced shared-store payloads).
  returned: always
  type: int
expected_freed_size:
  description:
    - Apparent bytes of the cache blobs the purge deletes, counted as huggingface_hub's
      DeleteCacheStrategy.expected_freed_size counts them (a blob another revision still links is
      not counted; a shared-store payload only when its last link goes). From the plan, so check
      mode returns the same figure as the real run.
  returned: always
  type: int
changes:
  description: When the store changed between the plan and the deletion, what changed (nothing
    was deleted).
  returned: failure
  type: list
  elements: str
freed_bytes:
  description: Bytes actually freed, measured with statvfs before and after (null in check mode).
  returned: always
  type: int
left:
  description:
    - What a real run could not delete, one row per item (an item, a repo's revisions or a plain
      directory, as C(org/name), C(org/name@<commit>,...) or its path), with the paths still on
      disk (the deepest that failed, e.g. an immutable blob inside a repo folder) and the cause
      (the error's text, e.g. C(Operation not permitted), C(Permission denied)). The module
      fails whenever it is not empty.
  returned: when the module deleted (not in check mode, nor when there was nothing to delete)
  type: list
  elements: dict
  sample: [{"item": "org/old", "paths": ["/data/hf/hub/models--org--old/blobs/9f86d0..."],
            "cause": "Operation not permitted"}]
diff:
  description: Store listing before and after.
  returned: when diff mode is on
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.modelswap.vllm.plugins.module_utils.store import model_purge
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import store_context
from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands

ACTION = model_purge.ACTION

ARGUMENT_SPEC = dict(
    store_context.STORE_ARGS,
    items=dict(type="list", elements="str", default=[]),
    roots=dict(type="list", elements="path"),
    missing=dict(type="str", choices=["ignore", "fail"], default="ignore"),
    clean_orphans=dict(type="bool", default=True),
    clean_stale_locks=dict(type="bool", default=True),
)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True,
                           required_one_of=[("cache_dir", "models_dir")])
    p = module.params
    try:
        # read: the store, the roots, what the host serves
        store, _unused = store_context.scan(p, ACTION)
        roots = model_purge.purge_roots(store, p["roots"])
        state = store_context.host_state(p, store, ACTION, HostCommands.of(module))
    except store_context.StoreError as exc:
        module.fail_json(msg=str(exc))
    except model_purge.PurgeError as exc:
        module.fail_json(msg=str(exc), **exc.details)
    for warning in state["warnings"]:
        module.warn(warning)
    try:
        # plan: every item judged (one refusal deletes nothing), the paths, orphans, stale locks
        plan = model_purge.plan_purge(
            store, state, roots=roots, items=p["items"], models=p["models"], missing=p["missing"],
            allow_served_purge=p["allow_served_purge"], unit_name=p["vllm_unit"],
            clean_orphans=p["clean_orphans"], clean_stale_locks=p["clean_stale_locks"])
        result = plan.result()
        if module._diff:
            result["diff"] = model_purge.purge_diff(store, plan)
        if module.check_mode or not result["changed"]:
            module.exit_json(**result)
        if plan.needs_huggingface_hub() and model_purge.DeleteCacheStrategy is None:
            module.fail_json(msg=missing_required_lib("huggingface_hub"), exception=str(model_purge.HF_IMPORT_ERROR))
        # apply: with the locks held and the plan re-checked, delete exactly it
        result = model_purge.apply_purge(store, plan, result, clean_stale_locks=p["clean_stale_locks"])
    except model_purge.PurgeError as exc:
        module.fail_json(msg=str(exc), **exc.details)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
