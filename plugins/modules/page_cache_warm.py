#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: page_cache_warm
short_description: Pre-stage a model - read its snapshot into the page cache while memory allows
version_added: "0.1.0"
description:
  - Reads every file of a model snapshot (links followed, each file once) sequentially, so the
    kernel's page cache holds the weights before the old server stops; vLLM's load after the
    stop then reads memory instead of the disk, which shortens the downtime by about one
    sequential read of the weights.
  - Reads only when the whole snapshot fits in O(max_fraction) of the host's C(MemAvailable)
    (and in O(max_bytes), when set); otherwise it reads nothing and says why (RV(skipped),
    RV(reason)) - a partial read would evict what it read first.
  - Bounded in time by O(timeout); measures the bytes read, the seconds and the rate.
  - Run it after the download and verification, before the stop. It changes no file and no
    setting (the page cache is the kernel's), so it reports no change.
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
options:
  path:
    description:
      - The snapshot folder to read (a Hugging Face cache C(snapshots/<commit>) folder, whose
        links to blobs are followed, or a plain model folder).
    type: path
    required: true
  max_fraction:
    description:
      - Read only when the snapshot fits in this share of C(MemAvailable) (above 0, at most 1).
    type: float
    default: 0.8
  max_bytes:
    description:
      - Read only when the snapshot holds at most this many bytes; V(0) for no limit but
        O(max_fraction).
    type: int
    default: 0
  timeout:
    description:
      - Stop reading after this many seconds (between two 8 MiB reads); V(0) for no limit.
        What was read stays cached.
    type: float
    default: 600
attributes:
  check_mode:
    support: full
    details:
      - Lists the files and reads C(MemAvailable); says what it would read and reads nothing.
  diff_mode:
    support: none
notes:
  - Reading as root works for any file; the service user's own files need no more.
  - The gain is at most the weights' size over the disk's sequential read rate, and only when the
    cache is cold; the repository's docs/vllm-operations.md has what the lab measured.
seealso:
  - module: modelswap.vllm.hf_snapshot
  - module: modelswap.vllm.vllm_ready
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Read the new weights into the page cache before the old server stops
  modelswap.vllm.page_cache_warm:
    path: /var/lib/modelswap/hf/hub/models--moonshotai--Kimi-K2.5/snapshots/0123456789abcdef0123456789abcdef01234567
    max_fraction: 0.8
    timeout: 900
  register: prestage

- name: Say what it did
  ansible.builtin.debug:
    msg: "{{ prestage.msg }}"
"""

RETURN = r"""
skipped:
  description: Nothing was read, because the snapshot does not fit the budget (or holds no bytes).
  returned: always
  type: bool
  sample: false
reason:
  description: Why it was skipped or stopped early; null when it read everything.
  returned: always
  type: str
  sample: "the snapshot (547.0 GiB) is larger than the budget (409.6 GiB: 80% of 512.0 GiB available): ..."
msg:
  description: One line - what it read (or would read) and how fast, or why not.
  returned: always
  type: str
  sample: read 7 file(s), 6.8 MiB, in 0.0 s (1.2 GiB/s)
files:
  description: Files in the snapshot (each once).
  returned: always
  type: int
  sample: 64
bytes_total:
  description: Bytes of those files.
  returned: always
  type: int
  sample: 587202560000
budget_bytes:
  description: The most it would read - O(max_fraction) of C(MemAvailable), or O(max_bytes) when lower.
  returned: always
  type: int
mem_available_before:
  description: C(MemAvailable) in bytes before reading.
  returned: always
  type: int
mem_available_after:
  description: C(MemAvailable) in bytes after reading (null when nothing was read).
  returned: always
  type: int
bytes_read:
  description: Bytes read (0 in check mode and when skipped).
  returned: always
  type: int
files_read:
  description: Files read whole.
  returned: always
  type: int
seconds:
  description: Seconds the read took.
  returned: always
  type: float
bytes_per_s:
  description: The read rate (null when nothing was read).
  returned: always
  type: int
complete:
  description: Every file was read whole (false when skipped, in check mode, or stopped by O(timeout)).
  returned: always
  type: bool
would_read_bytes:
  description: Check mode - the bytes a real run would read.
  returned: in check mode, when it would read
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.store import page_cache_warm


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            max_fraction=dict(type="float", default=0.8),
            max_bytes=dict(type="int", default=0),
            timeout=dict(type="float", default=600.0),
        ),
        supports_check_mode=True,
    )
    try:
        result = page_cache_warm.run(module.params, module.check_mode)
    except page_cache_warm.WarmError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
