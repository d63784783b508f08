#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: modelswap_info
short_description: Report which modelswap.vllm code runs on a host
version_added: "0.1.0"
description:
  - Returns the collection name and version of the module code that ran on the host, and the
    host's Python version.
  - Used to prove that modules and their shared helpers resolve the same way from this
    repository and from an installed C(modelswap.vllm) collection.
options: {}
extends_documentation_fragment:
  - modelswap.vllm.attributes.read_only
  - ansible.builtin.action_common_attributes
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Show which modelswap code a host runs
  modelswap.vllm.modelswap_info:
  register: info
"""

RETURN = r"""
collection:
  description: The collection the module belongs to.
  returned: always
  type: str
  sample: modelswap.vllm
version:
  description: The collection version.
  returned: always
  type: str
  sample: 0.1.0
python:
  description: The Python version that ran the module on the host.
  returned: always
  type: str
  sample: 3.11.2
"""

import platform

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common.about import about


def main():
    module = AnsibleModule(argument_spec={}, supports_check_mode=True)
    module.exit_json(changed=False, **about(platform.python_version()))


if __name__ == "__main__":
    main()
