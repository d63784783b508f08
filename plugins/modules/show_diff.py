#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: show_diff
short_description: Show diffs made on the controller, as a file module would show them
version_added: "0.1.0"
description:
  - Hands the given diff entries to Ansible's output (C(--diff)) and reports a change when there
    is at least one. It runs on the controller only (an action plugin), reaches no host and
    changes nothing.
  - The migration's preview shows the unit and environment changes this way, from the texts its
    one read of each host returned, instead of a second call per host.
options:
  diffs:
    description:
      - Diff entries as modules return them in C(diff), e.g. M(modelswap.vllm.service_files) -
        each a dict with C(before_header), C(after_header), C(before), C(after), or C(prepared)
        (a text shown as is).
    type: list
    elements: dict
    required: true
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Changes nothing in either mode.
  diff_mode:
    support: full
seealso:
  - module: modelswap.vllm.service_files
  - module: modelswap.vllm.migrate_info
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Show the unit and environment changes the plan found
  modelswap.vllm.show_diff:
    diffs: "{{ plan.diffs }}"
  when: ansible_check_mode
"""

RETURN = r"""
changed:
  description: Whether there was at least one diff entry (what the files' writer would change).
  returned: always
  type: bool
"""
