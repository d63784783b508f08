#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: deployment_record
short_description: Record what a vLLM host serves, and what it served before
version_added: "0.1.0"
description:
  - Keeps the host's deployment record, a small JSON file that other roles and modules read
    (the purge never removes the served model; status reports it; rollback returns to
    C(previous)).
  - O(state=present) makes O(deployment) the current deployment. When it differs from the
    recorded one, the recorded one becomes C(previous) and C(when) is set to now; recording the
    current deployment again changes nothing (not even C(when)).
  - Keys that other writers own, such as C(fetched) (model_fetch), are kept. Every write holds
    the record's lock (C(<path>.lock), shared with model_fetch) and replaces the file atomically.
  - With O(saved_dir), the writes are ordered so that a failure at any point (a full disk, an I/O
    error, a host crash) leaves the old state or the new one - the new saved copies are staged in
    C(<saved_dir>/.staged) (its C(for.json), naming the deployment, written last), then the record
    is replaced (the commit), then the staged copies replace C(active) and C(previous) and
    C(.staged) is removed. The next O(state=present) run finds a C(.staged) left behind and
    publishes it when the record names its deployment, or discards it (the record write never
    happened; C(active) and C(previous) were not touched), before it does its own work (see
    RV(recovered)). Recording the same deployment with the same files again stages nothing.
  - O(state=read) only reads it.
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
options:
  path:
    description:
      - The record file.
    type: path
    default: /var/lib/modelswap/deployment.json
  state:
    description:
      - C(present) records O(deployment); C(read) returns the record.
    type: str
    choices: [present, read]
    default: present
  deployment:
    description:
      - The deployment that serves now. Keys - C(model), C(repo_id), C(commit), C(path),
        C(served_model_name), C(unit), C(unit_checksum), C(env_checksum), C(vllm_version),
        C(args) (the ExecStart argv; never a secret), C(host), C(port). C(model), C(path),
        C(served_model_name) and C(unit) are required.
      - Required with O(state=present).
    type: dict
  mode:
    description:
      - Permissions of the record file.
    type: str
    default: "0644"
  unit_file:
    description:
      - The unit file of the deployment; its sha256 becomes C(unit_checksum) unless
        O(deployment) gives one.
    type: path
  env_file:
    description:
      - The environment file of the deployment; its sha256 becomes C(env_checksum) unless
        O(deployment) gives one.
    type: path
  saved_dir:
    description:
      - Keep the deployment's configuration files for rollbacks - C(<saved_dir>/active/<name>)
        holds the live files of the recorded deployment; when a new deployment replaces a
        recorded one, the files saved for that one move to C(<saved_dir>/previous/<name>) first.
        Files are compared by content; nothing is copied when they are equal.
    type: path
  saved_files:
    description:
      - The files to keep under O(saved_dir) (e.g. the unit, its environment file, its API key
        file). Their content is never returned.
    type: list
    elements: dict
    default: []
    suboptions:
      name:
        description: The name under O(saved_dir)C(/active) and C(/previous).
        type: str
        required: true
      path:
        description: The live file.
        type: path
        required: true
      mode:
        description: Permissions of the saved copy.
        type: str
        default: "0600"
attributes:
  check_mode:
    support: full
    details:
      - Predicts C(changed), the diff and RV(recovered); writes nothing (not even the recovery).
  diff_mode:
    support: full
    details:
      - The record before and after, as JSON.
seealso:
  - module: modelswap.vllm.vllm_service_info
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Record the deployment that now serves
  modelswap.vllm.deployment_record:
    deployment:
      model: kimi-k2.5-int4
      repo_id: moonshotai/Kimi-K2.5
      commit: 0123456789abcdef0123456789abcdef01234567
      path: /var/lib/modelswap/hf/hub/models--moonshotai--Kimi-K2.5/snapshots/0123456789abcdef0123456789abcdef01234567
      served_model_name: kimi-k2.5
      unit: vllm.service
      vllm_version: 0.32.0
      port: 8000

- name: Record it, with the unit's checksum, and keep its files for rollbacks
  modelswap.vllm.deployment_record:
    deployment: "{{ deployment }}"
    unit_file: /etc/systemd/system/vllm.service
    env_file: /etc/modelswap/vllm.env
    saved_dir: /var/lib/modelswap/vllm/vllm
    saved_files:
      - {name: unit, path: /etc/systemd/system/vllm.service, mode: "0644"}
      - {name: env, path: /etc/modelswap/vllm.env}
      - {name: secret, path: /etc/modelswap/vllm.secret.env}

- name: Read the record
  modelswap.vllm.deployment_record:
    state: read
  register: record
"""

RETURN = r"""
record:
  description: The record after the task (as it would be, in check mode); null when absent.
  returned: always
  type: dict
deployment:
  description: The current deployment after the task, or null.
  returned: always
  type: dict
previous:
  description: The previous deployment after the task, or null.
  returned: always
  type: dict
path:
  description: The record file.
  returned: always
  type: str
saved:
  description: The saved configuration files copied - C(rotated) (active to previous) and
    C(saved) (live to active), by name (in check mode, what would be copied).
  returned: when O(saved_dir) is given
  type: dict
  sample: {"rotated": ["unit", "env", "secret"], "saved": ["unit", "env", "secret"]}
recovered:
  description:
    - What this run did with a C(<saved_dir>/.staged) that an earlier, interrupted run left -
      C(published) (the record already named its deployment; its copies now are C(active) and
      C(previous)), C(discarded) (the record write never happened, or the run died while staging),
      or null (there was none). In check mode, what it would do. Either counts as a change.
    - C(saved) lists only this run's own copies, after the recovery.
  returned: when O(saved_dir) is given
  type: str
  sample: published
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import deployment_record
from ansible_collections.modelswap.vllm.plugins.module_utils.common.fsutil import locked


def with_checksums(deployment, unit_file, env_file):
    out = dict(deployment)
    for key, path in (("unit_checksum", unit_file), ("env_checksum", env_file)):
        if path and not out.get(key):
            out[key] = deployment_record.sha256_file(path)
    return out


RECOVERED = {"publish": "published", "discard": "discarded"}


def where_it_stopped(phase, saved_dir):
    """What a write that failed in ``phase`` left on the host, for the failure message."""
    if not saved_dir:
        return ""
    if phase in ("publish", "recover-publish"):
        return ("; the record is written and the saved configuration that goes with it waits in %s: "
                "the next run publishes it" % deployment_record.staged_dir(saved_dir))
    if phase in ("stage", "commit", "discard"):
        return "; the record and the saved configurations are as before: the next run starts over"
    return ""


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", default="/var/lib/modelswap/deployment.json"),
            state=dict(type="str", choices=["present", "read"], default="present"),
            deployment=dict(type="dict"),
            mode=dict(type="str", default="0644"),
            unit_file=dict(type="path"),
            env_file=dict(type="path"),
            saved_dir=dict(type="path"),
            saved_files=dict(type="list", elements="dict", default=[], options=dict(
                name=dict(type="str", required=True),
                path=dict(type="path", required=True),
                mode=dict(type="str", default="0600"),
            )),
        ),
        required_if=[("state", "present", ("deployment",))],
        supports_check_mode=True,
    )
    p = module.params
    path = p["path"]
    modes = {}
    why = deployment_record.options_problem(p["mode"], p["saved_files"], p["saved_dir"])
    if why:
        module.fail_json(msg="deployment_record: %s (nothing was written)" % why)
    mode = int(p["mode"], 8)
    for f in p["saved_files"]:
        modes[f["name"]] = int(f["mode"], 8)

    def answer(record, changed, diff=None, saved=None, recovered=None):
        result = {"changed": changed, "record": record, "deployment": deployment_record.current(record),
                  "previous": deployment_record.previous(record), "path": path}
        if saved is not None:
            result["saved"] = saved
            result["recovered"] = recovered
        if diff is not None and module._diff:
            result["diff"] = diff
        module.exit_json(**result)

    def saved_plan(replaced, manifest=None):
        """plan_saved's actions; ``manifest``: a .staged that this run publishes first (check mode
        plans as if it had: its copies stand for active/ and previous/)."""
        if not p["saved_dir"]:
            return []
        overlay = {}
        for entry in (manifest or {}).get("files", []):
            overlay[(entry["to"], entry["name"])] = os.path.join(
                deployment_record.staged_dir(p["saved_dir"]), entry["to"], entry["name"])
        sums = {}
        for f in p["saved_files"]:
            sums[("live", f["name"])] = deployment_record.sha256_file(f["path"])
            for kind in ("active", "previous"):
                sums[(kind, f["name"])] = deployment_record.sha256_file(
                    overlay.get((kind, f["name"])) or os.path.join(p["saved_dir"], kind, f["name"]))
        return deployment_record.plan_saved(p["saved_files"], sums, replaced)

    def summary(actions):
        if not p["saved_dir"]:
            return None
        return {"rotated": [n for a, n in actions if a == "rotate"],
                "saved": [n for a, n in actions if a == "save"]}

    def found_staged(record):
        """(what recovery applies to a .staged, its manifest)."""
        if not p["saved_dir"]:
            return None, None
        staged, manifest = deployment_record.read_staged(p["saved_dir"])
        return deployment_record.recovery(staged, manifest, record), manifest

    recovered = None
    phase = None        # what a failed write was doing (the message says where that leaves the host)
    try:
        if p["state"] == "read":
            answer(deployment_record.read(path), False)
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        deployment = with_checksums(p["deployment"], p["unit_file"], p["env_file"])
        # plan first, without the lock: a bad deployment or an unreadable record changes nothing
        before = deployment_record.read(path)
        after, changed = deployment_record.record_deployment(before, deployment, when)
        if module.check_mode:
            recovery, manifest = found_staged(before)
            recovered = RECOVERED.get(recovery)
            actions = saved_plan(changed and deployment_record.deployment_replaced(before, deployment),
                                 manifest if recovery == "publish" else None)
            answer(after, changed or bool(actions) or bool(recovered),
                   {"before": deployment_record.dumps(before) if before else "", "after": deployment_record.dumps(after),
                    "before_header": path, "after_header": path}, summary(actions), recovered)
        with locked(path):
            before = deployment_record.read(path)
            # a run that died after staging: publish what the record names, or drop what it never got
            recovery, manifest = found_staged(before)
            phase = "recover-publish" if recovery == "publish" else recovery
            if recovery == "publish":
                deployment_record.publish(p["saved_dir"], manifest)
            elif recovery == "discard":
                deployment_record.discard(p["saved_dir"])
            recovered = RECOVERED.get(recovery)
            after, changed = deployment_record.record_deployment(before, deployment, when)
            actions = saved_plan(changed and deployment_record.deployment_replaced(before, deployment))
            manifest, sources = deployment_record.staging_plan(
                p["saved_dir"], p["saved_files"], actions, deployment, modes)
            # stage -> record (the commit) -> publish: a failure anywhere leaves the old state or
            # the new one, and the next run completes it
            if manifest:
                phase = "stage"
                try:
                    deployment_record.stage(p["saved_dir"], manifest, sources)
                except OSError:
                    deployment_record.drop_uncommitted(p["saved_dir"], path)
                    raise
            if changed:
                phase = "commit"
                try:
                    deployment_record.write(path, after, mode)
                except OSError:
                    if manifest:
                        deployment_record.drop_uncommitted(p["saved_dir"], path)
                    raise
            if manifest:
                phase = "publish"
                deployment_record.publish(p["saved_dir"], manifest)
    except deployment_record.RecordError as exc:
        module.fail_json(msg="deployment_record: %s %s failed: %s (nothing was written)" % (
            "reading the deployment record" if p["state"] == "read" else "recording the deployment in",
            path, exc))
    except OSError as exc:
        module.fail_json(msg="deployment_record: writing %s failed: %s; check that its folder "
                             "exists and is writable (run with become)%s"
                             % (getattr(exc, "filename", None) or path, exc.strerror or exc,
                                where_it_stopped(phase, p["saved_dir"])))
    answer(after, changed or bool(actions) or bool(recovered),
           {"before": deployment_record.dumps(before) if before else "", "after": deployment_record.dumps(after),
            "before_header": path, "after_header": path}, summary(actions), recovered)


if __name__ == "__main__":
    main()
