#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: hf_snapshot_progress
short_description: Read the progress of a running hf_snapshot download
version_added: "0.1.0"
description:
  - Read-only. Reads the progress file that M(modelswap.vllm.hf_snapshot) writes while it runs (with
    C(async) and C(poll=0)) and returns one line for humans (bytes, percent, rate, ETA, files) plus
    whether the download has ended.
  - The download has ended (C(finished=true)) when the file says C(done) or C(failed), when the process
    that writes it is gone (its pid and start time are checked in C(/proc), so a reused pid is not
    mistaken for it), or when the Ansible async job's results file (O(results_file)) holds a result.
  - A file that holds another live run's progress is the download this run follows (it waits for that
    run's repository lock and leaves the file to it). RV(following) then names that run, the line starts
    with C(following the download of run <id>) and goes on with that run's line, and the download has
    not ended.
  - Meant for a polling loop (C(loop) with C(loop_control.pause) and C(break_when)); the model_fetch role
    prints one line per host per interval this way, then collects the result with C(async_status).
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
options:
  path:
    description: The progress file (hf_snapshot's O(modelswap.vllm.hf_snapshot#module:progress_file)).
    type: path
    required: true
  progress_id:
    description: Only a progress file with this id counts (hf_snapshot's O(modelswap.vllm.hf_snapshot#module:progress_id));
      an older run's file reads as "waiting for the download to start", another live run's as following it.
    type: str
    default: ""
  results_file:
    description: The async job's results file (C(results_file) of the task started with C(poll=0)).
    type: path
  wait:
    description:
      - Seconds to wait on the host for the download to finish before answering (checked every half
        second); the answer comes as soon as it finishes. A loop that polls every N seconds with
        O(wait=N) and no pause prints a line every N seconds and ends with the download.
    type: float
    default: 0
seealso:
  - module: modelswap.vllm.hf_snapshot
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Show the download's progress every 30 s until it ends
  modelswap.vllm.hf_snapshot_progress:
    path: /var/lib/modelswap/progress/kimi.json
    progress_id: "{{ run_id }}"
    results_file: "{{ fetch_job.results_file }}"
  register: progress
  loop: "{{ range(2880) | list }}"
  loop_control:
    pause: 30
    label: "{{ progress.line | default('') }}"
    break_when:
      - progress.finished | default(true)
"""

RETURN = r"""
finished:
  description: Whether the download has ended (done, failed, its process gone, or the async job ended).
  returned: always
  type: bool
state:
  description: starting, resolving, waiting, cleaning, downloading, verifying, done or failed (C(waiting) while following).
  returned: always
  type: str
line:
  description: One line for humans.
  returned: always
  type: str
  sample: "lab/tiny-a@8976b4494868 downloading 45.2% 120.0 MiB of 265.4 MiB 35.1 MiB/s ETA 0:00:04 3/7 files"
following:
  description: The id of the live run whose progress the file holds, which this run follows (it waits for its lock).
  returned: when the file holds another live run's progress
  type: str
found:
  description: Whether a progress file of this run was found.
  returned: always
  type: bool
alive:
  description: Whether the writing process is alive (null when unknown).
  returned: always
  type: bool
age_s:
  description: Seconds since the file was last written (host clock).
  returned: when found
  type: float
percent:
  description: Percent of the bytes to fetch that have arrived.
  returned: when found
  type: float
bytes_done:
  description: Bytes received so far.
  returned: when found
  type: int
bytes_total:
  description: Bytes to fetch in this run.
  returned: when found
  type: int
rate_bps:
  description: Bytes per second over the last 20 s.
  returned: when found
  type: int
eta_s:
  description: Seconds left at that rate (null when unknown).
  returned: when found
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_snapshot_progress import wait_progress


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            progress_id=dict(type="str", default=""),
            results_file=dict(type="path"),
            wait=dict(type="float", default=0.0),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if p["wait"] < 0:
        module.fail_json(msg="hf_snapshot_progress: wait must be 0 or more seconds, got %s" % p["wait"])
    info = wait_progress(p["path"], p["progress_id"], p["results_file"] or "", p["wait"])
    info.pop("id", None)
    module.exit_json(changed=False, **info)


if __name__ == "__main__":
    main()
