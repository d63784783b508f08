#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: migrate_info
short_description: Read everything a migration's plan needs from one host, in one call
version_added: "0.2.0"
description:
  - Read-only. What the C(migrate) role plans a host's migration from - what the host serves (the
    deployment record, the serving unit and the units it replaces, the port's listeners, whether the
    target's snapshot is fetched and verified), whether the wanted vLLM is installed (the fingerprint
    the install step writes, else the virtualenv's own answer), whether the unit and its environment
    files are the ones the controller would render (checksums; the API key file only as yes or no),
    the disk plan (as M(modelswap.vllm.disk_plan)) and what the download would fetch (as
    M(modelswap.vllm.hf_snapshot) plans it).
  - The target's files come from O(listing), which the controller made once for the whole fleet
    (M(modelswap.vllm.hf_snapshot) in check mode with C(return_listing)) - the host asks the Hub nothing
    and needs no huggingface_hub, so it runs with the host's own Python, before vLLM is installed too.
  - One host-side call instead of a dozen tasks - the controller's cost per host is per task, so a
    fleet's preview is bound by this count (see the README's figures).
  - With O(lease), the host's lease comes first, in the same call - the one thing this module may
    write - taken or renewed as M(modelswap.vllm.host_lease) does it (in check mode only read),
    and a lease another run holds fails the read before anything else is read, naming the holder.
    The lease is a run's lock, not the host's state.
  - Role-private in spirit (the C(migrate) role's read step) but usable alone.
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Reads the same in check mode; O(lease) is then only read.
  diff_mode:
    support: none
options:
  listing:
    description:
      - The target's files at its commit, as M(modelswap.vllm.hf_snapshot) returned them with
        C(return_listing=true) (C({commit, files})).
    type: dict
    required: true
  service:
    description: The serving slot to read (options of M(modelswap.vllm.vllm_service_info)).
    type: dict
    required: true
    suboptions:
      unit: {description: The slot's systemd unit., type: str, default: vllm.service}
      replaces: {description: Units set up outside modelswap that the slot replaces., type: list, elements: str, default: []}
      port: {description: The serving port (its listeners are reported)., type: int}
      record_path: {description: The deployment record., type: path, default: /var/lib/modelswap/deployment.json}
      snapshot_path: {description: An explicit snapshot folder of the target., type: path}
      cache_dir: {description: The Hugging Face cache the target is fetched into., type: path}
      verification: {description: How the target's snapshot must be verified., type: str, choices: [full, size, none], default: full}
      paths: {description: Files whose existence is reported., type: list, elements: path, default: []}
  install:
    description: The vLLM virtualenv and the install the controller wants there.
    type: dict
    required: true
    suboptions:
      venv: {description: The virtualenv., type: path, required: true}
      expected:
        description:
          - What the install step's fingerprint must say (C(version), and the source keys it writes);
            empty values are not compared. Without a fingerprint only C(version) is compared, with the
            version the virtualenv's python reports.
        type: dict
        default: {}
  config:
    description: The slot's configuration files to compare with what the controller would render.
    type: dict
    default: {}
    suboptions:
      files:
        description: Files whose sha1 and text are returned (C(null) when absent); not secrets, they are shown in diffs.
        type: list
        elements: path
        default: []
      secret_path: {description: The API key file., type: path}
      secret_sha1:
        description: The sha1 the API key file would have (never logged). Only RV(config.secret_matches) says whether it has.
        type: str
        default: ""
  store:
    description:
      - The model store and the plan's rules, as M(modelswap.vllm.disk_plan) takes them. The Hub is never
        asked (O(listing) has the target's files).
    type: dict
    required: true
    suboptions:
      target: {description: Catalog name of the model to plan for (protected from purging)., type: str}
      models: {description: "The model catalog, name to C({repo_id, revision, ...}), as M(modelswap.vllm.disk_plan) takes it.", type: dict, default: {}}
      cache_dir: {description: The Hugging Face hub cache of the store., type: path}
      models_dir: {description: A folder of plain model directories., type: path}
      keep: {description: Catalog names never to purge., type: list, elements: str, default: []}
      served: {description: Catalog name of a model the host serves besides the record's and the unit's., type: str}
      deployment_record: {description: The host's deployment record., type: path, default: /var/lib/modelswap/deployment.json}
      vllm_unit: {description: The unit that runs vLLM (its model is protected as served)., type: str, default: vllm.service}
      protect_paths: {description: Extra paths never to purge., type: list, elements: path, default: []}
      allow_served_purge: {description: Allow the plan to purge the served model (downtime)., type: bool, default: false}
      scan_workers: {description: Threads that scan cache repos., type: int, default: 1}
      headroom: {description: "Free space to keep after the target - bytes or a percentage of the file system.", type: str, default: 5%}
      candidates: {description: "What may be purged, in order (default - every unprotected item, least recently used first).", type: list, elements: str}
      clean_orphans: {description: Count orphaned partial downloads as reclaimable., type: bool, default: true}
      download_rate: {description: Bytes per second for the download time estimate (C(1.25G) or bytes)., type: str}
      allow_missing_store: {description: A store folder that does not exist yet counts as empty (an earlier step creates it)., type: bool, default: false}
      compile_cache_root: {description: "The folder of vLLM's caches, one per model - a purge that removes a model frees its folder too.", type: path}
  purge:
    description: How the purge step would act on the plan (the options of the C(model_purge) role).
    type: dict
    default: {}
    suboptions:
      allowed: {description: Purging is allowed; when false RV(purge) is null., type: bool, default: true}
      all_listed: {description: Delete every candidate instead of the shortest prefix that fits., type: bool, default: false}
      clean_orphans: {description: Reclaim orphaned partial downloads and stale locks., type: bool, default: true}
  fetch:
    description: How the download would store the target.
    type: dict
    default: {}
    suboptions:
      local_dir: {description: A plain folder the download would store the target in instead of the cache., type: path}
      verify: {description: The verification the download would do., type: str, choices: [full, size], default: full}
  lease:
    description:
      - The host's lease to take (or renew) before the read, with the options of
        M(modelswap.vllm.host_lease); omitted, the lease is not touched.
    type: dict
    suboptions:
      path: {description: The lease file., type: path, default: /var/lib/modelswap/lease.json}
      state: {description: C(held) takes or renews it; C(read) only reports it., type: str, choices: [held, read], default: held}
      run_id: {description: The id of this run (required with O(lease.state=held))., type: str, default: ""}
      controller: {description: The controller the run started on., type: str, default: ""}
      user: {description: The user who started the run., type: str, default: ""}
      pid: {description: The PID of the run's C(ansible-playbook) (C(0) - unknown)., type: int, default: 0}
      ttl: {description: Seconds until the lease expires unless renewed., type: int, default: 14400}
      break_lease: {description: The run id of a dead run whose lease may be taken over., type: str, default: ""}
      purpose: {description: What the lease is for., type: str, default: migrate}
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Read the host for the migration to the target the controller listed
  modelswap.vllm.migrate_info:
    listing: "{{ target_listing.listing }}"
    service: {unit: vllm.service, port: 8000, cache_dir: /var/lib/modelswap/hf/hub}
    install: {venv: /opt/modelswap/venvs/vllm-0.32.0, expected: {version: 0.32.0}}
    store: {cache_dir: /var/lib/modelswap/hf/hub, models: "{{ modelswap_models }}", target: kimi-k2.5-int4}
  register: host_read
"""

RETURN = r"""
lease:
  description:
    - What M(modelswap.vllm.host_lease) returns for O(lease) (C(action), C(reason), C(lease), C(previous),
      C(taken_over), C(path), C(changed); C(holder) and C(msg) when another run holds it).
  returned: when O(lease) is given
  type: dict
service:
  description: What M(modelswap.vllm.vllm_service_info) returns for the slot and the target.
  returned: success
  type: dict
install:
  description: The virtualenv's vLLM.
  returned: success
  type: dict
  contains:
    fingerprint: {description: The install step's fingerprint (null when absent)., type: dict}
    version: {description: The installed vLLM version (from the fingerprint or the virtualenv)., type: str}
    source: {description: "C(fingerprint) or C(virtualenv): where the version came from.", type: str}
    exists: {description: The vllm executable is there., type: bool}
    matches: {description: The wanted vLLM is installed (no install needed)., type: bool}
config:
  description: The configuration files.
  returned: success
  type: dict
  contains:
    sha1: {description: Path to the sha1 of its content (null when absent)., type: dict}
    text:
      description: Path to its text, for the preview's diffs (null when larger than 256 KiB or not UTF-8; absent files are left out).
      type: dict
    secret_matches: {description: The API key file holds what the controller would write., type: bool}
disk:
  description: The disk plan, as M(modelswap.vllm.disk_plan) returns it.
  returned: success
  type: dict
purge:
  description:
    - What M(modelswap.vllm.model_purge) would delete for the plan (its check-mode result, plus C(items)),
      or null when there is nothing to reclaim.
  returned: success
  type: dict
fetch:
  description: What the download would do, as M(modelswap.vllm.hf_snapshot) plans it.
  returned: success
  type: dict
  contains:
    commit: {description: The target's commit., type: str}
    verified: {description: A verified manifest covers every file (nothing to fetch or verify)., type: bool}
    would_fetch: {description: "Files and bytes to download, files to verify (as hf_snapshot's check mode).", type: dict}
    snapshot_path: {description: The snapshot folder., type: str}
    in_flight:
      description:
        - The download that holds the target's repository lock now (C(pid), C(host), C(since), C(run)), such as
          one a killed controller left running, which the download step follows; null when the lock is free.
      type: dict
timings:
  description: Seconds each part of the read took.
  returned: success
  type: dict
"""

import platform
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common import host_lease
from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import migrate_facts
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import store_context

SERVICE_OPTIONS = dict(
    unit=dict(type="str", default="vllm.service"),
    replaces=dict(type="list", elements="str", default=[]),
    port=dict(type="int"),
    record_path=dict(type="path", default="/var/lib/modelswap/deployment.json"),
    snapshot_path=dict(type="path"),
    cache_dir=dict(type="path"),
    verification=dict(type="str", choices=["full", "size", "none"], default="full"),
    paths=dict(type="list", elements="path", default=[]),
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            listing=dict(type="dict", required=True),
            service=dict(type="dict", required=True, options=SERVICE_OPTIONS),
            install=dict(type="dict", required=True, options=dict(
                venv=dict(type="path", required=True),
                expected=dict(type="dict", default={}),
            )),
            config=dict(type="dict", default={}, apply_defaults=True, options=dict(
                files=dict(type="list", elements="path", default=[]),
                secret_path=dict(type="path"),
                secret_sha1=dict(type="str", no_log=True, default=""),
            )),
            store=dict(type="dict", required=True,
                       options=dict(store_context.STORE_ARGS, **store_context.PLAN_ARGS)),
            purge=dict(type="dict", default={}, apply_defaults=True, options=dict(
                allowed=dict(type="bool", default=True),
                all_listed=dict(type="bool", default=False),
                clean_orphans=dict(type="bool", default=True),
            )),
            fetch=dict(type="dict", default={}, apply_defaults=True, options=dict(
                local_dir=dict(type="path"),
                verify=dict(type="str", choices=["full", "size"], default="full"),
            )),
            lease=dict(type="dict", options=dict(
                host_lease.LEASE_OPTIONS,
                state=dict(type="str", choices=["held", "read"], default="held"),
                run_id=dict(type="str", default=""),
            )),
        ),
        supports_check_mode=True,
    )
    lease = None
    if module.params["lease"]:
        # first: a plan read while another run changes the host would be stale
        wanted = module.params["lease"]
        lease = host_lease.outcome(wanted["path"], {key: wanted[key] for key in host_lease.REQUEST_FIELDS},
                                   time.time(), module.check_mode, platform.node())
        if lease.get("failed"):
            module.fail_json(msg=lease["msg"], lease=lease)
        if lease["taken_over"]:
            module.warn("host_lease: %s" % lease["reason"])
    try:
        result = migrate_facts.gather(module.params, HostCommands.of(module))
    except migrate_facts.ReadError as exc:
        module.fail_json(msg=str(exc))
    for warning in result.pop("warnings"):
        module.warn(warning)
    if lease is not None:
        # the lease file is the one thing this module writes (in check mode: would write)
        result.update(lease=lease, changed=lease["changed"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
