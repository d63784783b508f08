#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: service_files
short_description: Write a service's configuration files in one call, with one diff per file
version_added: "0.2.0"
description:
  - Writes files whose content the controller rendered (a systemd unit, its environment file, its API
    key file) in one call, where M(ansible.builtin.template) costs a task and a round trip per file.
  - Each file is compared with the host's by content (and mode, owner, group) and replaced only when it
    differs, atomically (mode set before the new content is visible). A file with O(files[].validate)
    is checked first, from a copy under its own name in a temporary folder; a failing check changes
    nothing and fails with the check's output.
  - O(secret_files) hold secrets (an API key) - their content is never logged, returned or diffed; their
    diff only says that they would change.
  - Role-private in spirit (the C(vllm_service) role's render step, the C(migrate) role's preview) but
    usable alone.
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Reports what would change, with the diffs; writes nothing and runs no check.
  diff_mode:
    support: full
    details: One diff per changed file; a secret file's only says that it changes.
options:
  directories:
    description: Folders the files live in, created (with missing parents, 0755) and given their mode and owner first.
    type: list
    elements: dict
    default: []
    suboptions:
      path: {description: Absolute path of the folder., type: path, required: true}
      mode: {description: Octal mode as a string (C("0755")); unset keeps the folder's or uses 0755., type: str}
      owner: {description: Owner name., type: str}
      group: {description: Group name., type: str}
  files:
    description: Files whose content may be shown in diffs.
    type: list
    elements: dict
    default: []
    suboptions:
      path: {description: Absolute path of the file., type: path, required: true}
      content: {description: The whole content., type: str, required: true}
      mode: {description: Octal mode as a string (C("0644")); unset keeps the file's or uses 0644., type: str}
      owner: {description: Owner name., type: str}
      group: {description: Group name., type: str}
      validate:
        description:
          - A command that checks the new content before it replaces the file; C(%s) is the path of a copy
            with the file's own name in a temporary folder. Run without a shell; exit 0 accepts.
        type: str
  secret_files:
    description:
      - Files holding secrets (an API key); their content is O(secret_contents), never shown.
    type: list
    elements: dict
    default: []
    suboptions:
      path: {description: Absolute path of the file., type: path, required: true}
      mode: {description: Octal mode as a string., type: str, default: "0600"}
      owner: {description: Owner name., type: str}
      group: {description: Group name., type: str}
  secret_contents:
    description:
      - The whole content of each of O(secret_files), in the same order. A top-level option of its own so
        that Ansible never logs it (a secret nested in a list would reach the host's journal).
    type: list
    elements: str
    default: []
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Write the unit and its environment files
  modelswap.vllm.service_files:
    files:
      - path: /etc/systemd/system/vllm.service
        content: "{{ lookup('ansible.builtin.template', 'vllm.service.j2') }}"
        mode: "0644"
        validate: systemd-analyze verify --man=no %s
      - {path: /etc/modelswap/vllm.env, content: "NCCL_DEBUG=WARN\n", mode: "0600"}
    secret_files:
      - {path: /etc/modelswap/vllm.secret.env, mode: "0600"}
    secret_contents:
      - "VLLM_API_KEY={{ vault_vllm_api_key }}\n"
  become: true
  register: slot_files
"""

RETURN = r"""
files:
  description: Per file, whether it changed (or would), was created, and the sha1 of its new content (not for a secret file).
  returned: success
  type: list
  elements: dict
directories:
  description: Per folder, whether it was created or changed (or would be).
  returned: success
  type: list
  elements: dict
changed_paths:
  description: The paths (folders and files) that changed (or would).
  returned: success
  type: list
  elements: str
"""

import shlex

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import service_files

FILE_OPTIONS = dict(
    path=dict(type="path", required=True),
    content=dict(type="str", required=True),
    mode=dict(type="str"),
    owner=dict(type="str"),
    group=dict(type="str"),
    validate=dict(type="str"),
)
DIR_OPTIONS = dict(
    path=dict(type="path", required=True),
    mode=dict(type="str"),
    owner=dict(type="str"),
    group=dict(type="str"),
)
SECRET_OPTIONS = dict(
    path=dict(type="path", required=True),
    mode=dict(type="str", default="0600"),
    owner=dict(type="str"),
    group=dict(type="str"),
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            directories=dict(type="list", elements="dict", default=[], options=DIR_OPTIONS),
            files=dict(type="list", elements="dict", default=[], options=FILE_OPTIONS),
            # paths and modes only (the contents are secret_contents): nothing here to hide
            secret_files=dict(type="list", elements="dict", default=[], options=SECRET_OPTIONS, no_log=False),
            secret_contents=dict(type="list", elements="str", default=[], no_log=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if len(p["secret_files"]) != len(p["secret_contents"]):
        module.fail_json(msg="service_files: %d secret_files but %d secret_contents; give one content per file, "
                             "in the same order" % (len(p["secret_files"]), len(p["secret_contents"])))
    secrets = [dict(spec, content=content) for spec, content in zip(p["secret_files"], p["secret_contents"])]
    try:
        # plan: every folder and file compared before any is written
        folders = [service_files.plan_directory(d) for d in p["directories"]]
        items = ([service_files.plan_file(f, secret=False) for f in p["files"]]
                 + [service_files.plan_file(f, secret=True) for f in secrets])
        changed_folders = [d for d in folders if d["changed"]]
        changed = [i for i in items if i["changed"]]
        result = {"changed": bool(changed or changed_folders),
                  "directories": [service_files.summary(d) for d in folders],
                  "files": [service_files.summary(i) for i in items],
                  "changed_paths": [i["path"] for i in changed_folders + changed]}
        if module._diff and result["changed"]:
            result["diff"] = [service_files.diff_of(i, module.check_mode) for i in changed_folders + changed]
        if module.check_mode or not result["changed"]:
            module.exit_json(**result)

        # apply: every check first, so a refused file leaves all of them as they were
        def run_validate(command, path):
            rc, out, err = module.run_command(shlex.split(command.replace("%s", shlex.quote(path))),
                                              environ_update={"LANG": "C", "LC_ALL": "C"})
            return rc, (out + err)
        for item in changed:
            service_files.check(item, run_validate)
        for folder in changed_folders:
            service_files.make_directory(folder)
        for item in changed:
            service_files.write(item)
    except service_files.FilesError as exc:
        module.fail_json(msg="service_files: %s" % exc, stderr=str(exc))
    except OSError as exc:
        module.fail_json(msg="service_files: writing %s failed (%s); run with become and check the folder"
                             % (exc.filename, exc.strerror), stderr=str(exc))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
