#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: run_records
short_description: Write the run records of many hosts as JSON files on the controller, in one task
version_added: "0.1.0"
description:
  - Writes each host's run record as C(<dir>/<host>.json) (indented, keys sorted, as the
    C(to_nice_json) filter writes it), each through a temporary file in the folder, so that a
    reader never sees half a record. A file that already holds the record is left alone.
  - It runs on the controller only (an action plugin) and reaches no host. A copy task looped over
    the hosts costs two module runs per host; the migration writes the records of the hosts a
    run settled at their plan (often every host of a converged rerun) with this one task.
  - The records are a log of the run, not a change to a host, so the task reports no change; what
    it wrote is in RV(written).
options:
  dir:
    description:
      - The run's folder on the controller, an absolute path. It is created (mode 0755) when missing.
    type: path
    required: true
  records:
    description:
      - Each host's run record, by inventory host name. A host name is the file's name, so it
        may hold letters, digits, underscores, dots, colons, at signs and dashes, and may not
        start with a dot or a dash.
    type: dict
    required: true
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Writes nothing; RV(paths) says where each record would go.
  diff_mode:
    support: none
seealso:
  - module: modelswap.vllm.deployment_record
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Write the run records on the controller
  modelswap.vllm.run_records:
    dir: "/var/lib/modelswap/results/{{ run_id }}"
    records: "{{ dict(ansible_play_hosts | zip(ansible_play_hosts | map('extract', hostvars, 'migrate_record'))) }}"
  run_once: true
"""

RETURN = r"""
paths:
  description: Where each host's record is (or would be, in check mode) written.
  returned: always
  type: dict
  sample: {"gpu1": "/var/lib/modelswap/results/20261207T120000Z-ab12/gpu1.json"}
written:
  description: The hosts whose file was written (created or changed) by this task.
  returned: when not in check mode
  type: list
  elements: str
  sample: ["gpu1"]
"""
