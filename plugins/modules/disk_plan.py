#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: disk_plan
short_description: Plan the disk space a model swap needs, and what to purge for it
version_added: "0.1.0"
description:
  - Read-only. Measures the file system that holds the model store (a Hugging Face hub cache
    and/or a folder of plain model directories), the bytes the target model still needs, and
    the bytes orphaned partial downloads hold; proposes an ordered purge (least recently used
    first, unless O(candidates) gives an order) with the bytes each item would really free,
    and returns a verdict C(fits), C(fits_after_purge) or C(does_not_fit).
  - The target's needed bytes are its files at the pinned revision (from the cache's tree
    listing, or the Hub's file list, honouring allow/ignore patterns) minus the blobs already in
    the cache, so a partly cached model needs only the rest. Or an explicit O(target_bytes).
  - Freed bytes are allocated bytes (what C(df) sees), computed with huggingface_hub's deletion
    rules. A revision's blob goes only when no remaining revision links it, so blobs shared
    between revisions are counted once; a hard-linked file only when its last link goes.
  - Never proposes the served model (from the deployment record, the vLLM unit and every running
    vLLM server on the host, also one started by hand or under another unit, whose command line
    names the model; a server in a container is not seen), the target or the O(keep) models.
    If only purging the served model would make room, the verdict says so and names the
    downtime it implies; it is proposed only with O(allow_served_purge=true).
  - The cache scan is a single C(os.scandir) walk, several times faster than
    C(huggingface_hub.scan_cache_dir) on big caches (see tests/bench/bench_disk_plan.py).
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
  - modelswap.vllm.store
options:
  target:
    description:
      - Catalog name of the model to make room for. It is protected from purging.
      - It is planned into O(cache_dir), or onto the file system of O(models_dir) when O(cache_dir)
        is not set.
      - One of O(target) and O(target_bytes) is required.
    type: str
  target_bytes:
    description:
      - Bytes the target still needs, when the Hub is unreachable. Used as is; the Hub is not asked.
    type: int
  endpoint:
    description:
      - The Hub endpoint to list the target's files from (default C(HF_ENDPOINT) or huggingface.co).
    type: str
  token:
    description:
      - Hub token for private or gated repos. Never logged or returned.
    type: str
  http_endpoint_trusted:
    description:
      - With a O(token), listing the target on a plain C(http://) endpoint is refused before any request
        (the token would cross the network in clear text). C(true) says that endpoint is on a network
        you trust (the lab's local Hub on its own bridge). Without a token, C(http://) is always allowed.
      - The target's file list, from the Hub or the cache's tree listing, is refused when a path or blob
        id in it is unsafe (C(..), an absolute path, a control character, an id that is not hex).
    type: bool
    default: false
  headroom:
    description:
      - Free space to keep after the download, as a percentage of the file system's size
        (C(5%)) or a size (C(20GiB), C(20G) binary, C(20GB) decimal, or bytes).
    type: str
    default: "5%"
  candidates:
    description:
      - What may be purged, in this order. Each is a catalog name (its pinned revision), a repo id
        C(org/name) (every revision), C(org/name@<commit>), a plain directory name under
        O(models_dir), or an absolute path in the store.
      - Unset means every unprotected item, least recently used first.
      - A candidate that is protected, or is not in the store, is an error - except a catalog name
        whose revision is not in the store (already purged, as on the rerun of an interrupted purge),
        which is listed in RV(excluded) with C(rule=absent).
    type: list
    elements: str
  allow_served_purge:
    description:
      - Allow the plan to purge the served model when nothing else makes room (downtime).
    type: bool
    default: false
  clean_orphans:
    description:
      - Count orphaned partial downloads (C(*.incomplete) whose download lock nobody holds) as
        reclaimable; they are reclaimed first.
      - So are payloads of the shared (Xet) store C(<cache>/blobs) that no link in the cache
        references (model_purge removes them with the same option).
    type: bool
    default: true
  download_rate:
    description:
      - Expected download speed per second (a size, e.g. C(400MiB)) to estimate downtime.
    type: str
  fail_on_does_not_fit:
    description:
      - Fail when the verdict is C(does_not_fit) (the plan is still returned).
    type: bool
    default: false
  allow_missing_store:
    description:
      - Plan a O(cache_dir) or O(models_dir) that does not exist yet as empty, on the file system of
        its nearest existing parent. For the preview of a run whose earlier step creates the store
        (the migrate role's install step). Off, a missing folder is an error, so a mistyped path
        is not planned as an empty store.
    type: bool
    default: false
  compile_cache_root:
    description:
      - The folder of vLLM's caches, one C(models--org--name) folder per model (the vllm_service
        role's C(VLLM_CACHE_ROOT) parent, see M(modelswap.vllm.compile_cache)).
      - A step that removes a model's last revision frees its cache folder too (the purge prunes it
        with the model), counted when the folder is on the store's file system.
      - Leave it out where caches are not pruned with their models (plain model folders, O(models_dir)).
    type: path
requirements:
  - huggingface_hub >= 1.0 on the host, only to list the target's files on the Hub (not needed with
    O(target_bytes) or when the cache already holds the pinned revision's tree listing).
notes:
  - Set C(ansible_python_interpreter) for this task to a Python with huggingface_hub (on serving
    hosts, the vLLM virtualenv's).
seealso:
  - module: modelswap.vllm.model_purge
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Plan room for the target model
  modelswap.vllm.disk_plan:
    cache_dir: /var/lib/modelswap/hf/hub
    models: "{{ modelswap_models }}"
    target: kimi-k2.5-int4
    keep: "{{ modelswap_keep }}"
    headroom: 5%
    endpoint: https://huggingface.co
    token: "{{ hf_token }}"
  register: plan

- name: Plan offline with a known size, purging only the listed models in this order
  modelswap.vllm.disk_plan:
    cache_dir: /data/hf/hub
    models_dir: /data/models
    models: "{{ modelswap_models }}"
    target: kimi-k2.5-int4
    target_bytes: "{{ 547 * 1000 ** 3 }}"
    candidates: [old-llama, /data/models/scratch-finetune]
    fail_on_does_not_fit: true
"""

RETURN = r"""
verdict:
  description: C(fits), C(fits_after_purge) or C(does_not_fit).
  returned: always
  type: str
  sample: fits_after_purge
fits:
  description: Whether the target fits (now, or after the proposed purge).
  returned: always
  type: bool
reason:
  description: Why, in words (names the downtime when only the served model would make room).
  returned: always
  type: str
summary:
  description: One line for humans (free, needed, to purge, verdict).
  returned: always
  type: str
  sample: "free 120.0 GiB; needed 510.0 GiB (+50.0 GiB headroom); purge 498.0 GiB: org/old; fits_after_purge"
filesystem:
  description: The file system the target lands on.
  returned: always
  type: dict
  contains:
    path: {description: A path on it (the store folder)., type: str}
    total_bytes: {description: Its size., type: int}
    free_bytes: {description: Free bytes (root's view)., type: int}
    available_bytes: {description: Bytes available to unprivileged users (what the plan uses)., type: int}
    block_size: {description: Fundamental block size., type: int}
target:
  description: What the target needs.
  returned: always
  type: dict
  contains:
    name: {description: Catalog name., type: str}
    repo_id: {description: Repo id., type: str}
    revision: {description: The catalog's revision., type: str}
    commit: {description: The commit it resolves to (null with target_bytes)., type: str}
    source: {description: "Where the file list came from: hub, tree_cache or explicit.", type: str}
    files: {description: Files after allow/ignore patterns., type: int}
    total_bytes: {description: Their size., type: int}
    cached_bytes: {description: Size of those already in the cache., type: int}
    missing_files: {description: Distinct blobs still to download., type: int}
    download_bytes: {description: Bytes to download., type: int}
    needed_bytes: {description: "Disk bytes the download will take (blocks, links).", type: int}
headroom_bytes:
  description: Headroom in bytes.
  returned: always
  type: int
required_bytes:
  description: needed_bytes + headroom_bytes.
  returned: always
  type: int
shortfall_bytes:
  description: Bytes missing even after every allowed purge (0 unless does_not_fit).
  returned: always
  type: int
orphans:
  description: Partial downloads (C(*.incomplete)) with their lock state, and the payloads of the
    shared (Xet) store that no link references.
  returned: always
  type: dict
  contains:
    reclaimable_bytes: {description: "Bytes of the partial downloads no download holds, plus the unreferenced
      shared payloads on the target's file system.", type: int}
    in_use_bytes: {description: Bytes of those a live download holds., type: int}
    files: {description: "Each with path, repo_id, bytes, state (reclaimable or in_use).", type: list}
    shared: {description: "Payloads of the shared (Xet) store no link references, each with path, bytes
      (allocated, with its .refs and .lock) and size.", type: list}
candidates:
  description:
    - Purge candidates in order, each with the bytes it frees after the ones before it.
    - C(bytes) are the store's; C(compile_cache_bytes) the model's vLLM cache folder that goes with
      it (see O(compile_cache_root)); C(cumulative_bytes) counts both.
  returned: always
  type: list
  elements: dict
  sample: [{"item": "org/old", "kind": "repo", "bytes": 1073741824, "cumulative_bytes": 1073741824,
            "compile_cache_bytes": 0, "order": 1, "path": "/data/hf/hub/models--org--old", "models": ["old"]}]
purge:
  description: The items to purge (the shortest prefix of candidates that makes it fit).
  returned: always
  type: list
  elements: str
purge_bytes:
  description: Bytes the proposed purge frees in the store (orphans included), what M(modelswap.vllm.model_purge) deletes.
  returned: always
  type: int
purge_compile_cache_bytes:
  description: Bytes of the vLLM cache folders pruned with the proposed purge's models (under O(compile_cache_root)).
  returned: always
  type: int
purge_orphans:
  description: Whether the plan reclaims orphaned partial downloads.
  returned: always
  type: bool
protected:
  description: What is protected and why (rule served, target, keep or path).
  returned: always
  type: list
  elements: dict
excluded:
  description: Store items that are not candidates, and why.
  returned: always
  type: list
  elements: dict
served:
  description: The served model as the host knows it (name, repo_id, commit, path, sources, unit_active).
  returned: always
  type: dict
served_purge:
  description: When only purging the served model would make room, what it would free and the downtime.
  returned: always
  type: dict
downtime:
  description: Whether the proposed purge includes the served model.
  returned: always
  type: bool
compile_caches:
  description: The vLLM cache folders under O(compile_cache_root) on the store's file system.
  returned: always
  type: dict
  contains:
    bytes: {description: Their allocated bytes., type: int}
    folders: {description: How many., type: int}
store:
  description: Counts of what was scanned, and scan warnings; on a Xet-layout cache
    C(shared_payloads) and C(shared_bytes) count the shared store's payloads, each once.
  returned: always
  type: dict
timings:
  description: Seconds spent scanning, asking the Hub, planning.
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.store import disk_plan
from ansible_collections.modelswap.vllm.plugins.module_utils.store import plan_inputs
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import store_context
from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands

ACTION = "disk_plan"

ARGUMENT_SPEC = dict(
    store_context.STORE_ARGS,
    **store_context.PLAN_ARGS,
    target_bytes=dict(type="int"),
    endpoint=dict(type="str"),
    token=dict(type="str", no_log=True),
    http_endpoint_trusted=dict(type="bool", default=False),
    fail_on_does_not_fit=dict(type="bool", default=False),
)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True,
                           required_one_of=[("cache_dir", "models_dir"), ("target", "target_bytes")])
    p = module.params
    if p["target_bytes"] is not None and p["target_bytes"] < 0:
        module.fail_json(msg="%s: target_bytes %d is negative: give the bytes the target needs (0 or more)"
                             % (ACTION, p["target_bytes"]))
    try:
        result, warnings, _store, _state = store_context.plan(p, ACTION, HostCommands.of(module))
    except store_context.StoreError as exc:
        module.fail_json(msg=str(exc))
    except plan_inputs.PlanError as exc:
        module.fail_json(msg="%s: %s" % (ACTION, exc))
    for warning in warnings:
        module.warn(warning)
    if p["fail_on_does_not_fit"] and result["verdict"] == "does_not_fit":
        result["changed"] = False
        module.fail_json(msg=disk_plan.does_not_fit_message(p["target"], result["filesystem"]["path"], result["reason"]), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
