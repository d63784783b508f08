#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: migrate_host_plan
short_description: Plan one host's migration on the controller, failing the host with the plan's refusal
version_added: "0.2.0"
description:
  - Makes one host's migration plan from its read (M(modelswap.vllm.migrate_read)'s result) on the
    controller - what each step would do and which must run, the diffs of the serving slot's files,
    the first refusal - and returns it, for the caller to register. The logic is
    C(plugins/module_utils/fleet/host_plan.py).
  - A plan that refuses fails the task with its sentence (C(msg)) in the same task, before anything
    changes; the failed result still holds the plan (C(failure) names the step).
  - In check mode, with O(probe), a host whose plan keeps what it serves is proved to still serve
    with M(modelswap.vllm.vllm_ready) (port, C(/health), C(/v1/models), a one-token completion), as
    the C(vllm_service) role's verify entry point would; the probe changes nothing. That is the
    only time this task reaches the host.
  - One task per host instead of a fact, a refusal and a probe, because Ansible's cost on the
    controller is per task and host, skipped tasks included.
options:
  target:
    description: The catalog name the host migrates to.
    type: str
    required: true
  read:
    description: M(modelswap.vllm.migrate_read)'s result for the host.
    type: dict
    required: true
  expected:
    description:
      - What the slot should be, as the C(vllm_service) role's expected entry point publishes it
        (C(files), and C(probe) for the probe).
    type: dict
    required: true
  settings:
    description: What the plan weighs besides the read (the migrate role's C(__migrate_plan_settings)).
    type: dict
    required: true
  probe:
    description: In check mode, prove that a slot the plan keeps still serves.
    type: bool
    default: false
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Plans only; the probe of a kept slot runs in check mode only and changes nothing.
  diff_mode:
    support: none
seealso:
  - module: modelswap.vllm.migrate_read
  - module: modelswap.vllm.vllm_ready
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Plan the migration, refusing what a step would refuse
  modelswap.vllm.migrate_host_plan:
    target: tiny-b
    read: "{{ host_read }}"
    expected: "{{ vllm_service_expected }}"
    settings: "{{ plan_settings }}"
    probe: true
  become: true
  register: plan
"""

RETURN = r"""
plan:
  description: The numbered steps as the run record and the preview show them.
  returned: always
  type: dict
todo:
  description: Which steps must run (install, purge, fetch, configure, swap, record, rejoin, drift).
  returned: always
  type: dict
failure:
  description: The first refusal (step, task, msg), or null.
  returned: always
  type: dict
diffs:
  description: The diff entries of the slot's files that would change.
  returned: always
  type: list
  elements: dict
settings:
  description: The settings the plan weighed (for the run record).
  returned: always
  type: dict
marks:
  description: When the plan (C(preflight)) and a probe (C(swap)) began, in seconds since the epoch.
  returned: always
  type: dict
probe:
  description: M(modelswap.vllm.vllm_ready)'s result, when a kept slot was probed.
  returned: when probed
  type: dict
"""
