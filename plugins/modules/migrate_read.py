#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: migrate_read
short_description: The migration's one read of a host, in one task (refusals, lease, host read, GPUs)
version_added: "0.2.0"
description:
  - Ansible's cost on the controller is per task and host, skipped tasks included, so a fleet's
    preview is only as cheap as its number of tasks per host. This action plugin does the
    migration's read of one host in one task, in this order, and stops at the first failure.
  - First, on the controller, the refusals that need no host - the catalog's (an unknown target or
    keep name, an invalid entry, from the C(store) of O(info)) and the serving slot's settings (from
    O(layout_inputs)). A refusal fails the task before the host is reached, its sentence is
    C(msg) and every one is in C(refusals).
  - Then M(modelswap.vllm.migrate_info), with O(info) and the slot's paths derived from the
    layout (its unit, port, record, saved files, configuration files and API key file), and
    O(lease) when given - the host's lease first, in the same module run, as
    M(modelswap.vllm.host_lease) takes it (a preview only reads it; a run takes or renews it), so
    the read is never made while another run changes the host.
  - Then M(modelswap.vllm.gpu_ready) with O(gpus), when given, under the vLLM virtualenv's Python
    once it exists (nvidia-ml-py comes with vLLM), else under O(gpus_python).
  - The result is migrate_info's, with C(layout), C(lease) and C(gpus) added. It never reports a
    change (the lease is a run's lock, not the state the host converges to).
options:
  layout_inputs:
    description:
      - The serving slot's settings, as the C(vllm_service) role publishes the inputs it derives
        the slot's layout from.
    type: dict
    required: true
  secret_sha1:
    description: SHA-1 of the API key file the slot should have (compared on the host, never shown).
    type: str
    default: ""
  info:
    description:
      - M(modelswap.vllm.migrate_info)'s options C(listing), C(store), C(purge) and C(fetch); its
        C(service), C(install) and C(config) are derived from the layout.
    type: dict
    required: true
  extra_paths:
    description: More files for migrate_info to read besides the slot's saved files (the drain mark).
    type: list
    elements: str
    default: []
  lease:
    description: M(modelswap.vllm.host_lease)'s options, or nothing to leave the lease alone.
    type: dict
  gpus:
    description: M(modelswap.vllm.gpu_ready)'s options, or nothing for a host without GPUs to read.
    type: dict
  gpus_python:
    description: The Python that reads the GPUs before vLLM's virtualenv exists.
    type: str
    default: auto_silent
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Reads only; in check mode the lease is only read.
  diff_mode:
    support: none
seealso:
  - module: modelswap.vllm.migrate_info
  - module: modelswap.vllm.host_lease
  - module: modelswap.vllm.gpu_ready
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Read the host (the catalog, the lease, what it serves and has, the GPUs)
  modelswap.vllm.migrate_read:
    layout_inputs: "{{ slot_settings }}"
    lease: {path: /var/lib/modelswap/lease.json, state: held, run_id: "{{ run_id }}"}
    info:
      listing: "{{ listing }}"
      store: {models: "{{ catalog }}", target: tiny-b, keep: [], deployment_record: /var/lib/modelswap/deployment.json}
  register: host_read
"""

RETURN = r"""
layout:
  description: The slot's layout (paths, install, configuration files) and its settings' C(problems).
  returned: always
  type: dict
refusals:
  description: Every refusal, when the task was refused before the host was reached.
  returned: when refused
  type: list
  elements: str
lease:
  description: M(modelswap.vllm.host_lease)'s result.
  returned: when O(lease) is given and the task was not refused
  type: dict
gpus:
  description: M(modelswap.vllm.gpu_ready)'s result, or C(skipped=true) when O(gpus) is not given.
  returned: when the host was read
  type: dict
service:
  description: M(modelswap.vllm.migrate_info)'s C(service) (and likewise its other return values).
  returned: when the host was read
  type: dict
"""
